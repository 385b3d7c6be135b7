"""Pictures for people: plans and the compatibility matrix as standalone SVG documents.

Pure functions of the JSON documents the API serves (plan, compatibility matrix), so the service,
the CLI, the web console and a worker holding a fetched document all draw the same thing.
"""

from kvroute.pictures.matrix import compatibility_svg
from kvroute.pictures.plan import plan_svg

__all__ = ["compatibility_svg", "plan_svg"]
