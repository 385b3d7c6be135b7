"""Typed answers of the kvroute REST API, as a worker reads them.

The answers' shapes are ``kvroute.wire``'s models, which the server renders too (one description,
checked against the spec by ``tests/contract/test_wire.py``); they are re-exported here under the
names workers use. A worker reads ``info.generation`` rather than ``body["generation"]``: a renamed
member fails at parse time, naming it, instead of as a KeyError deep inside a worker. Plans are read
into the geometry core's typed plan (``PlanDocument.plan``, by ``Plan.from_json``) and keep their
raw JSON (``document``) beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvroute import wire
from kvroute.geometry import Plan
from kvroute.wire import (
    TERMINAL_STATES,
    Compatibility,
    CompatibilityInstance,
    CompatibilityPair,
    DeploymentSummary,
    EngineLease,
    Instance,
    InstanceSummary,
    RankSummary,
    Rejection,
)
from kvroute.wire import LeaseRenewed as Lease
from kvroute.wire import Rank as RankInfo
from kvroute.wire import TransferJob as TransferStatus

Json = Mapping[str, Any]

__all__ = [
    "TERMINAL_STATES",
    "Compatibility",
    "CompatibilityInstance",
    "CompatibilityPair",
    "DeploymentSummary",
    "EngineLease",
    "Instance",
    "InstanceSummary",
    "Lease",
    "PlanDocument",
    "RankInfo",
    "RankSummary",
    "Registered",
    "Rejection",
    "TransferStatus",
]


@dataclass(frozen=True, slots=True)
class Registered:
    """A registration the service accepted: ``created`` is true for a new generation (201)."""

    generation: int
    lease_expires_at: datetime
    created: bool

    @classmethod
    def from_json(cls, body: Json, *, created: bool) -> Registered:
        answer = wire.from_json(wire.Registered, body)
        return cls(answer.generation, answer.lease_expires_at, created)


@dataclass(frozen=True, slots=True)
class PlanDocument:
    """A plan as served: the typed plan (``plan``, with the generations it was built from) and
    the JSON of docs/api.md (``document``)."""

    deployment: str
    sender: str
    sender_generations: dict[int, int | None]
    receiver: str
    receiver_rank: int
    receiver_generation: int | None
    fingerprint: str
    expected_writers: int
    fanin_bounce_safe: bool
    document: dict[str, Any] = field(repr=False)
    plan: Plan = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, body: Json) -> PlanDocument:
        """Reads a served plan; ``GeometryError`` (``invalid_plan``) names a member that is not
        what a plan says."""
        plan = Plan.from_json(body)
        return cls(
            deployment=plan.deployment,
            sender=plan.sender_instance,
            sender_generations=dict(plan.sender_generations),
            receiver=plan.receiver_instance,
            receiver_rank=plan.receiver_rank,
            receiver_generation=plan.receiver_generation,
            fingerprint=plan.fingerprint,
            expected_writers=plan.expected_writers,
            fanin_bounce_safe=plan.fanin_bounce_safe,
            document=dict(body),
            plan=plan,
        )

    @property
    def sending_ranks(self) -> tuple[int, ...]:
        return tuple(peer.rank for peer in self.plan.peers if peer.sends)

    @property
    def fragments_per_block(self) -> int:
        """Fragments per receiver block (where a view pair states a period, the most any receiver
        block of the period needs)."""
        return self.plan.fragments_per_block

    @property
    def periodic(self) -> bool:
        """Some view pair moves by period: the two sides cut tokens into blocks of other sizes
        (or the plan was fetched with ``period=True``)."""
        return any(view.periodic for peer in self.plan.peers for view in peer.views)

    @property
    def bytes_per_block(self) -> int:
        return self.plan.bytes_per_block

    @property
    def state_bytes(self) -> int:
        """Recurrent-state bytes the receiver gets per request (0 for a plan without state)."""
        return self.plan.state_bytes

    @property
    def state_fragments(self) -> int:
        return self.plan.state_fragments
