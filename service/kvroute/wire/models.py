"""The REST answers' shapes, once: the server renders these and the client parses them; and the
one request body with members of its own, the transfer request, which the client renders and the
server parses.

Each class is named after its schema in ``api_spec/openapi.yaml`` and its fields are that schema's
members; ``tests/contract/test_wire.py`` renders every one, validates it against the spec and parses
it back. Plans are not here: they are the geometry core's own documents (``Plan.to_json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from kvroute.wire.codec import OMIT_NONE
from kvroute.wire.pairs import Pairing

# The job states of docs/api.md "Transfer jobs" that never change again.
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(frozen=True, slots=True)
class Registered:
    """``PUT .../ranks/{rank}``: 201 for a new generation, 200 for the same or a renewed one."""

    generation: int
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class LeaseRenewed:
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class LeasedRank:
    instance: str
    rank: int


@dataclass(frozen=True, slots=True)
class EngineLease:
    """An engine lease as granted, renewed or read: the ranks it keeps (renewed, on a renewal)."""

    deployment: str
    lease_id: str
    lease_seconds: int
    lease_expires_at: datetime
    ranks: tuple[LeasedRank, ...]  # ordered by instance, then rank


@dataclass(frozen=True, slots=True)
class Event:
    """One change of a deployment (``GET .../events``), numbered by the deployment's revision.

    ``kind``: rank_registered | rank_expired | rank_deleted (``data.reason``) | plans_invalidated
    (``data.reason``: the kind of the rank events that caused it, ``instance`` whose plans).
    """

    revision: int
    deployment: str
    kind: str
    at: datetime
    instance: str | None = field(default=None, metadata=OMIT_NONE)
    rank: int | None = field(default=None, metadata=OMIT_NONE)
    generation: int | None = field(default=None, metadata=OMIT_NONE)
    data: dict[str, Any] | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True, slots=True)
class Rank:
    deployment: str
    instance: str
    rank: int
    role: str
    generation: int
    state: str  # live | expired
    lease_seconds: int
    lease_expires_at: datetime
    registered_at: datetime
    document: dict[str, Any]  # the registration document as stored


@dataclass(frozen=True, slots=True)
class RankSummary:
    rank: int
    role: str
    generation: int
    state: str
    registered_at: datetime
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class InstanceSummary:
    name: str
    role: str
    tp_size: int
    pp_size: int
    attention_dp: bool
    dp_size: int
    created_at: datetime
    live_ranks: int
    expired_ranks: int
    cp_size: int = 1  # context-parallel ranks per TP position (1: a server from before CP)


@dataclass(frozen=True, slots=True)
class Instance:
    """An instance with each of its ranks (``GET .../instances/{instance}``)."""

    name: str
    role: str
    tp_size: int
    pp_size: int
    attention_dp: bool
    dp_size: int
    created_at: datetime
    live_ranks: int
    expired_ranks: int
    deployment: str
    ranks: tuple[RankSummary, ...]  # ordered by rank number
    cp_size: int = 1


@dataclass(frozen=True, slots=True)
class DeploymentSummary:
    name: str
    created_at: datetime
    instances: int
    live_ranks: int
    expired_ranks: int


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    created_at: datetime
    live_ranks: int
    expired_ranks: int
    instances: tuple[InstanceSummary, ...]  # ordered by instance name
    pairing: Pairing | None = field(default=None, metadata=OMIT_NONE)  # only when set


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
    field: str
    detail: str
    problem: dict[str, Any]  # the refusal's problem body, without the HTTP status


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Prompt positions ``[start, end)``."""

    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferOptions:
    """A transfer request's optional members: which tokens move (a range, each list's first token,
    the prompt's length) and the request's recurrent-state slots. None: not given. A job's row
    stores them and its answer echoes them as the request gave them; ``control`` checks them
    (``geometry.TokenWindow``)."""

    tokens: TokenRange | None = field(default=None, metadata=OMIT_NONE)
    src_first_token: int | None = field(default=None, metadata=OMIT_NONE)
    dst_first_token: int | None = field(default=None, metadata=OMIT_NONE)
    src_state_slot: int | None = field(default=None, metadata=OMIT_NONE)
    dst_state_slot: int | None = field(default=None, metadata=OMIT_NONE)
    prompt_tokens: int | None = field(default=None, metadata=OMIT_NONE)

    def options(self) -> dict[str, Any]:
        """The optional members by name (given or not)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}


OPTION_NAMES = tuple(option.name for option in fields(TransferOptions))


@dataclass(frozen=True, slots=True)
class TransferRequest(TransferOptions):
    """A ``POST .../transfers`` body (the deployment is the path's): the one request model the
    client sends, the api parses, ``control`` plans and checks and the job row stores."""

    sender: str
    receiver: str
    receiver_ranks: tuple[int, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    sender_dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class TransferJob(TransferOptions):
    """A transfer job as ``POST .../transfers`` and ``GET /v1/transfers/{id}`` report it, with the
    request's optional members (``TransferOptions``) as it gave them."""

    id: str
    deployment: str
    sender: str
    receiver: str
    receiver_ranks: tuple[int, ...]
    blocks: int
    state: str  # queued | running | succeeded | failed | cancelled
    bytes: int
    fragments: int
    duration_seconds: float | None
    error: str | None
    plan_fingerprints: tuple[str, ...]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def gigabytes_per_second(self) -> float | None:
        if not self.duration_seconds:
            return None
        return self.bytes / self.duration_seconds / 1e9


@dataclass(frozen=True, slots=True)
class CompatibilityInstance:
    instance: str
    expected_ranks: int
    live_ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    complete: bool


@dataclass(frozen=True, slots=True)
class CompatibilityPair:
    """One (context, generation) instance pair: ``status`` compatible | incompatible | incomplete.

    ``refusal`` (code, field, detail, local, peer, generation_rank, context_rank) comes with an
    incompatible pair, ``missing_ranks`` (instance -> ranks) with an incomplete one.
    """

    context: str
    generation: str
    status: str
    compatible: bool | None
    refusal: dict[str, Any] | None = field(default=None, metadata=OMIT_NONE)
    missing_ranks: dict[str, list[int]] | None = field(default=None, metadata=OMIT_NONE)
    # With a pairing policy: {"allowed", "shared_domains", and "exclusion" when not allowed}.
    pairing: dict[str, Any] | None = field(default=None, metadata=OMIT_NONE)


@dataclass(frozen=True, slots=True)
class Compatibility:
    """The context x generation matrix of a deployment (``GET .../compatibility``)."""

    deployment: str
    context: tuple[CompatibilityInstance, ...]
    generation: tuple[CompatibilityInstance, ...]
    pairs: tuple[CompatibilityPair, ...]

    def pair(self, context: str, generation: str) -> CompatibilityPair:
        for pair in self.pairs:
            if (pair.context, pair.generation) == (context, generation):
                return pair
        raise KeyError(f"no pair ({context}, {generation}) in {self.deployment}")
