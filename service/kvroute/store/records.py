"""Plain, immutable results of store queries.

Nothing outside the store sees an ORM object, so nothing there can trigger lazy loads or hold a
session open. What the REST layer renders, the store returns as ``kvroute.wire`` models; these are
the results that stay inside the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

LeaseState = Literal["live", "expired"]


def lease_state(lease_expires_at: datetime, now: datetime) -> LeaseState:
    """A lease is live strictly before its expiry instant."""
    return "live" if lease_expires_at > now else "expired"


@dataclass(frozen=True, slots=True)
class RegisterOutcome:
    generation: int
    lease_expires_at: datetime
    created: bool  # True: the rank did not exist (HTTP 201); False: renewed or re-registered (200)


@dataclass(frozen=True, slots=True, order=True)
class RankName:
    """Which rank, for logs and metrics: ``llama/ctx0 rank 1``."""

    deployment: str
    instance: str
    rank: int

    def __str__(self) -> str:
        return f"{self.deployment}/{self.instance} rank {self.rank}"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """A lease and the ranks it keeps (``(instance, rank)``, in order)."""

    deployment: str
    lease_id: str
    lease_seconds: int
    lease_expires_at: datetime
    ranks: tuple[tuple[str, int], ...]
