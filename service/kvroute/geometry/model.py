"""Immutable model of what a rank registers: its parallel layout, pools and views.

The model is the API.md registration document made typed. Geometry that is derived (a view's head count
after the legacy fallback, a stage's layer range, the DP-group TP size) lives here as properties so every
check and the planner agree on one definition.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any, NamedTuple

from kvroute.geometry.spread import Spread


class Role(StrEnum):
    CONTEXT = "context"
    GENERATION = "generation"

    @property
    def opposite(self) -> Role:
        return Role.GENERATION if self is Role.CONTEXT else Role.CONTEXT


class Kind(StrEnum):
    """How a view lays out its bytes inside one layer region."""

    HND = "hnd"  # [heads][tokens][bytes]: head-major
    NHD = "nhd"  # [tokens][heads][bytes]: token-major
    REPLICATED = "replicated"  # identical bytes on every TP rank (MLA latent, indexer keys)
    SSM = "ssm"  # recurrent SSM state per request, [heads][head_dim][d_state], heads split by TP
    CONV = "conv"  # recurrent conv state per request: sections back to back, each split by TP

    @property
    def sharded(self) -> bool:
        """Split by KV heads (the attention kinds that carry ``num_kv_heads``)."""
        return self in (Kind.HND, Kind.NHD)

    @property
    def recurrent(self) -> bool:
        """Recurrent state: one slot per request, never per-token blocks."""
        return self in (Kind.SSM, Kind.CONV)


class CpLayout(StrEnum):
    """How a context-parallel instance deals a request's prompt tokens to its CP ranks."""

    INTERLEAVED = "interleaved"  # round robin by cp_interleave tokens (decode CP, helix)
    CONTIGUOUS = "contiguous"  # one contiguous chunk per CP rank (prefill ring attention)
    ZIGZAG = "zigzag"  # 2 x cp chunks, rank c holding chunks c and 2cp-1-c (load-balanced prefill)


class Axis(StrEnum):
    """What a view's slot ids name: a request's KV blocks, or the request's one state slot.

    Views of different axes are never matched with each other, even when they list the same global
    layer id (a hybrid layer can have both attention KV and recurrent state).
    """

    BLOCK = "block"
    STATE = "state"


class Owner(StrEnum):
    """Target and draft layers live in separate layer-id namespaces and never match each other."""

    TARGET = "target"
    DRAFT = "draft"


# Bits per element: the only place dtype names mean anything. Byte geometry is always derived from
# registered byte sizes, never from these, so sub-byte formats stay exact.
DTYPE_BITS: Mapping[str, int] = {
    "float64": 64,
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
    "uint8": 8,
    "nvfp4": 4,
    "float4_e2m1": 4,
    "int4": 4,
}


class LayerSlot(NamedTuple):
    """One layer's region inside a slot: global layer id (owner namespace) and its byte offset.

    A tuple of two ints: a cache of thousands of registrations holds hundreds of thousands of
    these, and the cyclic collector stops tracking such tuples, which dataclass instances it never
    does (full collections over them stalled the server).
    """

    layer: int
    offset: int


@dataclass(frozen=True, slots=True)
class Pool:
    pool_id: int
    slot_bytes: int
    slot_stride: int
    num_slots: int
    memory: Mapping[str, Any] | None = None

    @property
    def size_bytes(self) -> int:
        return self.num_slots * self.slot_stride


@dataclass(frozen=True)
class View:
    """The bytes of one role class for a set of layers inside one pool, with one uniform geometry."""

    view_id: int
    pool_id: int
    kind: Kind
    roles: frozenset[str]
    owner: Owner
    layers: tuple[LayerSlot, ...]
    buffers_per_layer: int
    bytes_per_layer: int
    num_kv_heads: int | None = None
    total_kv_heads: int | None = None
    tokens_per_block: int | None = None
    dtype: str | None = None
    per_request: bool = False  # declared per-request (state) slots; implied by the recurrent kinds
    ssm_bytes_per_head: int | None = None  # kind ssm: head_dim x d_state x element size
    conv_sections: tuple[int, ...] | None = None  # kind conv: per-rank bytes of each section
    sliding_window: int | None = None  # attention window in tokens; None is full attention

    @cached_property
    def axis(self) -> Axis:
        # Cached: view matching asks it of every peer view for every receiver view.
        return Axis.STATE if self.per_request or self.kind.recurrent else Axis.BLOCK

    @property
    def is_state(self) -> bool:
        return self.axis is Axis.STATE

    @cached_property
    def offsets(self) -> dict[int, int]:
        """Layer id -> byte offset of that layer's region inside a slot."""
        return {slot.layer: slot.offset for slot in self.layers}

    @cached_property
    def layer_ids(self) -> frozenset[int]:
        return frozenset(self.offsets)

    @property
    def buffer_bytes(self) -> int:
        return self.bytes_per_layer // self.buffers_per_layer

    @property
    def is_legacy(self) -> bool:
        return self.num_kv_heads is None

    def label(self) -> str:
        state = " state" if self.is_state else ""
        return f"view {self.view_id} ({self.owner}, roles={sorted(self.roles)}, {self.kind}{state})"


@dataclass(frozen=True, slots=True)
class Attention:
    """Rank-wide attention defaults; a view without its own head count falls back to num_kv_heads."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    is_mla: bool = False


@dataclass(frozen=True)
class RankRegistration:
    deployment: str
    instance: str
    rank: int
    role: Role
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    layers_per_stage: tuple[int, ...]
    tokens_per_block: int
    attention: Attention
    pools: tuple[Pool, ...]
    views: tuple[View, ...]
    attention_dp: bool = False
    dp_size: int = 1
    dp_rank: int = 0
    num_draft_layers: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    cp_layout: CpLayout = (
        CpLayout.INTERLEAVED
    )  # how prompt tokens are dealt to CP ranks (see ``spread``)
    cp_interleave: int = 1  # tokens dealt to a CP rank at a time (interleaved layout)
    lease_seconds: int = 30
    endpoint: str | None = None
    nixl_agent_metadata: str | None = None

    @classmethod
    def from_json(
        cls, doc: Mapping[str, Any], *, deployment: str, instance: str, rank: int
    ) -> RankRegistration:
        from kvroute.geometry.document import parse_registration

        return parse_registration(doc, deployment=deployment, instance=instance, rank=rank)

    def to_json(self) -> dict[str, Any]:
        from kvroute.geometry.document import render_registration

        return render_registration(self)

    def canonical(self) -> str:
        """Canonical JSON of the document: equal strings mean an identical registration."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @cached_property
    def canonical_digest(self) -> str:
        """sha256 of ``canonical()``: equal digests mean an identical registration."""
        import hashlib

        return hashlib.sha256(self.canonical().encode()).hexdigest()

    @cached_property
    def geometry_digest(self) -> str:
        """sha256 of what can change a plan: the document less lease, memory and endpoints."""
        import hashlib

        from kvroute.geometry.document import render_registration

        doc = {
            "instance": self.instance,
            "rank": self.rank,
            **render_registration(self, geometry_only=True),
        }
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @cached_property
    def class_digest(self) -> str:
        """sha256 of the rank's face (``faces``), all peer checks see: ranks of one PP stage of an
        instance share it, whatever their layout inside the slot."""
        from kvroute.geometry.classes import class_digest

        return class_digest(self)

    @property
    def key(self) -> tuple[str, int]:
        return self.instance, self.rank

    @property
    def tp_per_dp(self) -> int:
        """TP size of one attention-DP group: the TP over which KV heads are divided."""
        return self.tp_size // self.dp_size if self.attention_dp else self.tp_size

    @property
    def tp_rank_in_group(self) -> int:
        return self.tp_rank % self.tp_per_dp

    @property
    def spread(self) -> Spread:
        """Which prompt tokens this rank holds, and where (the identity without CP)."""
        if self.cp_size == 1:
            return Spread()
        return Spread(self.cp_size, self.cp_rank, self.cp_interleave)

    @property
    def state_tp(self) -> int:
        """Mamba TP: the ranks one request's recurrent state is split over (reference 2.10).

        The reference takes (1, 0) under attention DP, since a DP rank serves its requests alone;
        kvroute generalises that to the DP group's TP, which is 1 when dp_size == tp_size as the
        reference assumes, and (tp, tp_rank) without attention DP. With context parallelism the
        state is split over TP x CP, CP-minor (helix repurposes CP as TP for non-attention layers):
        CP rank c of TP position q holds share ``q * cp_size + c``.
        """
        return self.tp_per_dp * self.cp_size

    @property
    def state_rank(self) -> int:
        return self.tp_rank_in_group * self.cp_size + self.cp_rank

    @property
    def group(self) -> int:
        """The attention-DP group this rank serves (0 without attention DP)."""
        return self.dp_rank if self.attention_dp else 0

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    @cached_property
    def stage_range(self) -> range:
        """Target layers owned by this rank's PP stage (uneven splits allowed)."""
        start = sum(self.layers_per_stage[: self.pp_rank])
        return range(start, start + self.layers_per_stage[self.pp_rank])

    @cached_property
    def pools_by_id(self) -> dict[int, Pool]:
        return {pool.pool_id: pool for pool in self.pools}

    def heads(self, view: View) -> int:
        """Per-rank KV heads of a view: its own count, or the rank-wide one for a legacy view."""
        return view.num_kv_heads if view.num_kv_heads is not None else self.attention.num_kv_heads

    def tokens(self, view: View) -> int:
        return view.tokens_per_block if view.tokens_per_block is not None else self.tokens_per_block

    def held_layers(self, owner: Owner) -> frozenset[int]:
        """Layers this rank is responsible for in an owner's namespace.

        Target layers are split by PP stage, so a stage holds its whole range whether or not it
        registered a view for each layer; draft layers sit on whichever ranks declare them.
        """
        return self._held_layers[owner]

    @cached_property
    def _held_layers(self) -> dict[Owner, frozenset[int]]:
        draft = frozenset(
            layer for view in self.views if view.owner is Owner.DRAFT for layer in view.layer_ids
        )
        return {Owner.TARGET: frozenset(self.stage_range), Owner.DRAFT: draft}

    def label(self) -> str:
        return f"{self.instance} rank {self.rank}"
