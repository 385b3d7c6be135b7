"""Typed answers of the kvroute REST API (API.md shapes) as frozen dataclasses.

A worker reads ``registered.generation`` rather than ``body["generation"]``: a renamed field fails
here, at parse time, with the field named, instead of as a KeyError deep inside a worker. Plans and
compatibility matrices also keep their raw JSON (``document``), because plans are data that other
tools (NIXL descriptor building, rendering) consume as such.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

Json = Mapping[str, Any]

# API.md's job states that never change again; the wire contract, not the server's enum.
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


def _time(value: Any) -> datetime:
    return datetime.fromisoformat(str(value))


def _opt_time(value: Any) -> datetime | None:
    return None if value is None else _time(value)


@dataclass(frozen=True, slots=True)
class Registered:
    """A registration the service accepted: ``created`` is true for a new generation (201)."""

    generation: int
    lease_expires_at: datetime
    created: bool

    @classmethod
    def from_json(cls, body: Json, *, created: bool) -> Registered:
        return cls(int(body["generation"]), _time(body["lease_expires_at"]), created)


@dataclass(frozen=True, slots=True)
class Lease:
    """A renewed lease (``POST .../heartbeat``)."""

    lease_expires_at: datetime

    @classmethod
    def from_json(cls, body: Json) -> Lease:
        return cls(_time(body["lease_expires_at"]))


@dataclass(frozen=True, slots=True)
class RankInfo:
    deployment: str
    instance: str
    rank: int
    role: str
    generation: int
    state: str
    lease_seconds: int
    lease_expires_at: datetime
    registered_at: datetime
    document: dict[str, Any]

    @classmethod
    def from_json(cls, body: Json) -> RankInfo:
        return cls(
            deployment=body["deployment"],
            instance=body["instance"],
            rank=int(body["rank"]),
            role=body["role"],
            generation=int(body["generation"]),
            state=body["state"],
            lease_seconds=int(body["lease_seconds"]),
            lease_expires_at=_time(body["lease_expires_at"]),
            registered_at=_time(body["registered_at"]),
            document=dict(body["document"]),
        )


@dataclass(frozen=True, slots=True)
class DeploymentSummary:
    name: str
    created_at: datetime
    instances: int
    live_ranks: int
    expired_ranks: int

    @classmethod
    def from_json(cls, body: Json) -> DeploymentSummary:
        return cls(
            body["name"],
            _time(body["created_at"]),
            int(body["instances"]),
            int(body["live_ranks"]),
            int(body["expired_ranks"]),
        )


@dataclass(frozen=True, slots=True)
class RankSummary:
    rank: int
    role: str
    generation: int
    state: str
    lease_expires_at: datetime

    @classmethod
    def from_json(cls, body: Json) -> RankSummary:
        return cls(
            int(body["rank"]),
            body["role"],
            int(body["generation"]),
            body["state"],
            _time(body["lease_expires_at"]),
        )


@dataclass(frozen=True, slots=True)
class InstanceSummary:
    name: str
    role: str
    tp_size: int
    pp_size: int
    attention_dp: bool
    dp_size: int
    live_ranks: int
    expired_ranks: int
    ranks: tuple[RankSummary, ...] = ()  # filled by ``instance()``, empty in listings

    @classmethod
    def from_json(cls, body: Json) -> InstanceSummary:
        return cls(
            name=body["name"],
            role=body["role"],
            tp_size=int(body["tp_size"]),
            pp_size=int(body["pp_size"]),
            attention_dp=bool(body["attention_dp"]),
            dp_size=int(body["dp_size"]),
            live_ranks=int(body["live_ranks"]),
            expired_ranks=int(body["expired_ranks"]),
            ranks=tuple(RankSummary.from_json(rank) for rank in body.get("ranks", ())),
        )


@dataclass(frozen=True, slots=True)
class Rejection:
    """One entry of the bounded refusal log (``GET /v1/rejections``)."""

    id: int
    at: datetime
    deployment: str
    instance: str
    rank: int
    stage: str
    code: str
    field: str | None
    detail: str
    problem: dict[str, Any]

    @classmethod
    def from_json(cls, body: Json) -> Rejection:
        return cls(
            id=int(body["id"]),
            at=_time(body["at"]),
            deployment=body["deployment"],
            instance=body["instance"],
            rank=int(body["rank"]),
            stage=body["stage"],
            code=body["code"],
            field=body.get("field"),
            detail=body["detail"],
            problem=dict(body.get("problem") or {}),
        )


@dataclass(frozen=True, slots=True)
class PlanDocument:
    """A plan as served: the generations it was built from, and the API.md JSON (``document``)."""

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

    @classmethod
    def from_json(cls, body: Json) -> PlanDocument:
        sender, receiver = body["sender"], body["receiver"]
        generations = sender.get("generations") or {}
        return cls(
            deployment=body["deployment"],
            sender=sender["instance"],
            sender_generations={int(rank): gen for rank, gen in generations.items()},
            receiver=receiver["instance"],
            receiver_rank=int(receiver["rank"]),
            receiver_generation=receiver.get("generation"),
            fingerprint=body["fingerprint"],
            expected_writers=int(body["expected_writers"]),
            fanin_bounce_safe=bool(body["fanin_bounce_safe"]),
            document=dict(body),
        )

    @property
    def sending_ranks(self) -> tuple[int, ...]:
        return tuple(peer["rank"] for peer in self.document["peers"] if peer["sends"])

    @property
    def fragments_per_block(self) -> int:
        """Fragments per receiver block (where a view pair states a period, the most any receiver
        block of the period needs)."""
        return sum(
            int(view.get("descriptors_per_block", len(view.get("fragments", ()))))
            for peer in self.document["peers"]
            for view in peer["views"]
        )

    @property
    def periodic(self) -> bool:
        """Some view pair moves by period: the two sides cut tokens into blocks of other sizes
        (or the plan was fetched with ``period=True``)."""
        return any(
            "period_tokens" in view for peer in self.document["peers"] for view in peer["views"]
        )

    @property
    def bytes_per_block(self) -> int:
        return sum(int(peer["bytes_per_block"]) for peer in self.document["peers"])

    @property
    def state_bytes(self) -> int:
        """Recurrent-state bytes the receiver gets per request (0 for a plan without state)."""
        return int(self.document.get("state_bytes", 0))

    @property
    def state_fragments(self) -> int:
        return int(self.document.get("state_fragments", 0))


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """A transfer job as ``POST .../transfers`` and ``GET /v1/transfers/{id}`` report it."""

    id: str
    state: str  # queued | running | succeeded | failed | cancelled
    bytes: int
    fragments: int
    duration_seconds: float | None
    error: str | None
    document: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: Json) -> TransferStatus:
        duration = body.get("duration_seconds")
        return cls(
            id=str(body["id"]),
            state=str(body["state"]),
            bytes=int(body.get("bytes") or 0),
            fragments=int(body.get("fragments") or 0),
            duration_seconds=None if duration is None else float(duration),
            error=body.get("error"),
            document=dict(body),
        )

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def gigabytes_per_second(self) -> float | None:
        if not self.duration_seconds:
            return None
        return self.bytes / self.duration_seconds / 1e9


@dataclass(frozen=True, slots=True)
class CompatibilityPair:
    """One (context, generation) instance pair: ``status`` compatible | incompatible | incomplete."""

    context: str
    generation: str
    status: str
    compatible: bool | None
    refusal: (
        dict[str, Any] | None
    )  # code, field, detail, local, peer, generation_rank, context_rank
    missing_ranks: dict[str, list[int]]

    @classmethod
    def from_json(cls, body: Json) -> CompatibilityPair:
        refusal = body.get("refusal")
        return cls(
            context=body["context"],
            generation=body["generation"],
            status=body["status"],
            compatible=body.get("compatible"),
            refusal=None if refusal is None else dict(refusal),
            missing_ranks={k: list(v) for k, v in (body.get("missing_ranks") or {}).items()},
        )


@dataclass(frozen=True, slots=True)
class Compatibility:
    """The context x generation matrix of a deployment (``GET .../compatibility``)."""

    deployment: str
    pairs: tuple[CompatibilityPair, ...]
    document: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: Json) -> Compatibility:
        return cls(
            deployment=body["deployment"],
            pairs=tuple(CompatibilityPair.from_json(pair) for pair in body["pairs"]),
            document=dict(body),
        )

    def pair(self, context: str, generation: str) -> CompatibilityPair:
        for pair in self.pairs:
            if (pair.context, pair.generation) == (context, generation):
                return pair
        raise KeyError(f"no pair ({context}, {generation}) in {self.deployment}")
