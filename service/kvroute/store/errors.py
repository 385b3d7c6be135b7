"""Domain errors of the store, independent of the database and of HTTP.

The HTTP layer maps them to status codes in one place: ``NotFound`` (and its ``LeaseExpired``)
-> 404, ``Conflict`` (and its ``InvalidTransition``) -> 409. Geometry refusals are not store
errors: admission raises ``kvroute.geometry.GeometryError`` unchanged.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of the store's domain errors; ``str(error)`` is a sentence fit for a problem detail."""


class NotFound(StoreError):
    """The addressed deployment, instance, rank or transfer job does not exist."""


class LeaseExpired(NotFound):
    """The rank exists but its lease ran out: it is no longer a peer and must register again."""


class Conflict(StoreError):
    """The request contradicts the stored state."""

    code = "conflict"


class HeldByEngineLease(Conflict):
    """A per-rank heartbeat for a rank an engine lease keeps: only that lease renews it."""

    code = "rank_held_by_engine_lease"


class InvalidTransition(Conflict):
    """A transfer job cannot move from its current state to the requested one."""
