"""Plain, immutable results of store queries.

Handlers receive these instead of ORM objects, so nothing outside the store can trigger lazy loads
or hold a session open; every field is a value the API can render directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

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
class RankSummary:
    rank: int
    role: str
    generation: int
    registered_at: datetime
    lease_expires_at: datetime
    lease: LeaseState


@dataclass(frozen=True, slots=True)
class RankRecord:
    deployment: str
    instance: str
    rank: int
    role: str
    generation: int
    lease_seconds: int
    registered_at: datetime
    lease_expires_at: datetime
    lease: LeaseState
    document: dict[str, Any]  # the registration document as stored (API.md shape)


@dataclass(frozen=True, slots=True)
class InstanceSummary:
    deployment: str
    name: str
    role: str
    tp_size: int
    pp_size: int
    attention_dp: bool
    dp_size: int
    created_at: datetime
    live_ranks: int
    expired_ranks: int


@dataclass(frozen=True, slots=True)
class InstanceRecord:
    summary: InstanceSummary
    ranks: tuple[RankSummary, ...]  # ordered by rank number


@dataclass(frozen=True, slots=True)
class DeploymentSummary:
    name: str
    created_at: datetime
    instances: int
    live_ranks: int
    expired_ranks: int


@dataclass(frozen=True, slots=True)
class DeploymentRecord:
    name: str
    created_at: datetime
    instances: tuple[InstanceSummary, ...]  # ordered by instance name

    @property
    def live_ranks(self) -> int:
        return sum(instance.live_ranks for instance in self.instances)

    @property
    def expired_ranks(self) -> int:
        return sum(instance.expired_ranks for instance in self.instances)


@dataclass(frozen=True, slots=True)
class RejectionRecord:
    id: int
    at: datetime
    deployment: str
    instance: str
    rank: int
    stage: str
    code: str
    field: str
    detail: str
    problem: dict[str, Any]  # GeometryError.to_problem(), without the HTTP status


@dataclass(frozen=True, slots=True)
class TransferJobRecord:
    id: str
    deployment: str
    sender: str
    receiver: str
    receiver_ranks: tuple[int, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    state: str
    bytes: int
    fragments: int
    plan_fingerprint: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
