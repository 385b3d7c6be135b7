"""kvroute's REST service: the aiohttp application, its contract checks and its operations."""

from kvroute.api.app import create_app

__all__ = ["create_app"]
