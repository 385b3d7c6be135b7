"""The parts a rank's registration is made of: roles, view kinds and owners, pools, views.

They sit below ``model`` (the registration itself, with its JSON and digests) so that the
document codec and the class digest can build and read them without importing the registration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any, NamedTuple


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


@dataclass(frozen=True, slots=True)
class Tiling:
    """How one buffer (K or V) of one head lays out a block's tokens: ``[planes][tokens /
    token_group][group_planes][token_group][row / (planes x group_planes)]``.

    Plane ``p`` holds bytes ``[p x row / planes, (p + 1) x row / planes)`` of every token's row (``row``:
    the bytes of one token-head in the buffer), tokens in order. ``planes > 1`` is a transposed K
    (vLLM's CPU ``vec`` kernels: one plane per element). Inside a plane, ``token_group``
    consecutive tokens are packed into one run, which holds their chunks cut again into
    ``group_planes`` pieces, piece by piece and token by token inside each: vLLM's ``amx`` kernels
    keep K as pairs of elements across 16 tokens (``token_group`` 16, ``group_planes`` head_size /
    2) and V as 16 elements across pairs of tokens (``planes`` head_size / 16, ``token_group`` 2,
    ``group_planes`` 16). A group is never split by a transfer.
    """

    planes: int = 1
    token_group: int = 1
    # Optional in digests (left out while 1): ranks registered before it keep their classes.
    group_planes: int = field(default=1, metadata={"optional": True})

    def to_json(self) -> dict[str, int]:
        doc = {"planes": self.planes, "token_group": self.token_group}
        if self.group_planes != 1:
            doc["group_planes"] = self.group_planes
        return doc


class HeadOrder(StrEnum):
    """Whether a layer region holds each buffer for every head, or each head with every buffer."""

    BUFFER_HEAD = "buffer_head"  # [buffers][heads][tokens...]: kvroute's classic hnd
    HEAD_BUFFER = "head_buffer"  # [heads][buffers][tokens...]: per head, K then V (vLLM CPU)


@dataclass(frozen=True, slots=True)
class Interior:
    """What an hnd view's layer region looks like inside, where it is not the classic
    ``[buffers][heads][tokens][row]``: the head/buffer order and each buffer's tiling.

    Attention kernels read their cache in layouts that strides do not show (vLLM's CPU backend keeps
    K transposed per head, then V); a view declares the layout its kernels read, so token re-cuts
    move the right bytes.
    """

    order: HeadOrder
    tilings: tuple[Tiling, ...]  # one per buffer

    @property
    def token_group(self) -> int:
        """Tokens no cut may separate: the lcm of every buffer's group."""
        return math.lcm(*(tiling.token_group for tiling in self.tilings))

    @property
    def heads_outer(self) -> bool:
        return self.order is HeadOrder.HEAD_BUFFER

    @property
    def trivial(self) -> bool:
        return self.order is HeadOrder.BUFFER_HEAD and all(t == Tiling() for t in self.tilings)

    def tiling(self, buffer: int) -> Tiling:
        return self.tilings[buffer]

    def to_json(self) -> dict[str, Any]:
        return {"order": self.order.value, "tilings": [t.to_json() for t in self.tilings]}


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
    interior: Interior | None = None  # kind hnd: a layout other than [buffers][heads][tokens][row]
    # The engine's KV cache group (its own block table): views of different groups may overlap in
    # a pool, since a block id belongs to one group at a time. None: overlaps nothing.
    kv_group: int | None = None

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
        return view_label(self)


def view_label(view: Any) -> str:
    """How refusals name a view (a ``View`` or its face)."""
    state = " state" if view.is_state else ""
    return f"view {view.view_id} ({view.owner}, roles={sorted(view.roles)}, {view.kind}{state})"


@dataclass(frozen=True, slots=True)
class Attention:
    """Rank-wide attention defaults; a view without its own head count falls back to num_kv_heads."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    is_mla: bool = False
