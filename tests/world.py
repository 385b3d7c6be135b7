"""A synthetic deployment for planner tests: one model served by a context and a generation instance.

A *world* is one model (view classes with their own head totals, layouts and byte sizes) served by a
context and a generation instance with their own TP/PP/attention-DP layouts and tokens per block.
Every rank's registration document is laid out here from first principles, never by the planner's
code. ``tests/truth.py`` fills the pools from one logical tensor and computes the expected receiver
bytes; ``tests/executor.py`` runs a plan document on those bytes.

Hybrid worlds add recurrent state (one slot per request: SSM heads, conv sections or replicated
state, split over the DP group's TP) on a subset of the layers, and sliding windows on block views.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.geometry import RankRegistration, check_registration


@dataclass(frozen=True)
class ViewClass:
    """One role class of the model: the same on both sides unless a test mutates it."""

    roles: tuple[str, ...]
    owner: str  # "target" | "draft"
    kind: str  # "hnd" | "nhd" | "replicated" | "ssm" | "conv"
    total_heads: int  # 1 for replicated; the model's SSM heads for ssm
    buffers: int
    unit: int  # bytes per token-head (sharded), per token (replicated), per SSM head, per state
    dtype: str | None = None
    layers: frozenset[int] | None = None  # the target layers of this class (None: every layer)
    sections: tuple[int, ...] = ()  # conv: the model's bytes of each section
    per_request: bool = False  # replicated: per-request state of ``unit`` bytes per layer
    window: int | None = None  # sliding window in tokens (block kinds)

    @property
    def is_state(self) -> bool:
        return self.per_request or self.kind in ("ssm", "conv")


@dataclass(frozen=True)
class Side:
    role: str
    tp_size: int
    layers_per_stage: tuple[int, ...]
    dp_size: int = 1  # attention DP when > 1
    attention_dp: bool = False
    legacy: frozenset[int] = frozenset()  # class indices registered without num_kv_heads
    declare_totals: bool = True
    tokens_per_block: int = 4
    head_dim: int = 8
    dtype: str = "bfloat16"
    num_draft_layers: int = 0
    shared_pool: bool = True
    seed: int = 0
    draft_stage: int = -1  # the PP stage whose ranks declare the draft layers (-1: the last)
    num_slots: int = 3
    windows: tuple[tuple[int, int | None], ...] = ()  # (class index, window) overriding the class
    shared_state_pool: bool = False  # state regions in pool 0, overlapping the block regions
    cp_size: int = 1  # context parallelism: prompt tokens dealt round robin to the CP ranks
    cp_interleave: int = 1  # ... this many at a time
    quantization: tuple[tuple[str, Any], ...] = ()  # the document's kv_quantization members
    cp_layout: str = "interleaved"  # or prefill chunks: "contiguous", "zigzag"
    prompt_tokens: int = 0  # the prompt the chunks split (chunked layouts)
    # (class index, interior): "head_buffer" or "buffer_head" and one (planes, token_group) or
    # (planes, token_group, group_planes) per buffer, for hnd classes whose blocks this side lays
    # out other than [buffers][heads][tokens]
    interiors: tuple[tuple[int, tuple[str, tuple[tuple[int, ...], ...]]], ...] = ()

    def interior(self, c: int) -> tuple[str, tuple[tuple[int, ...], ...]] | None:
        return dict(self.interiors).get(c)

    @property
    def pp_size(self) -> int:
        return len(self.layers_per_stage)

    @property
    def tp_per_dp(self) -> int:
        return self.tp_size // self.dp_size if self.attention_dp else self.tp_size

    @property
    def state_tp(self) -> int:
        """The ranks recurrent state is split over: the DP group's TP times CP (helix)."""
        return self.tp_per_dp * self.cp_size

    @property
    def ranks(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size

    def position(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, tp_rank, cp_rank) of a rank number: CP fastest, then TP, then PP."""
        return (
            rank // (self.tp_size * self.cp_size),
            rank // self.cp_size % self.tp_size,
            (rank % self.cp_size),
        )

    @property
    def chunked(self) -> bool:
        return self.cp_size > 1 and self.cp_layout != "interleaved"

    def chunk_tokens(self, cp_rank: int) -> np.ndarray:
        """A chunked CP rank's prompt positions in local order: numpy's array_split of the prompt
        into cp (contiguous) or 2 cp (zig-zag: rank r takes chunks r and 2 cp - 1 - r) chunks."""
        c = self.cp_size
        zigzag = self.cp_layout == "zigzag"
        parts = np.array_split(np.arange(self.prompt_tokens), 2 * c if zigzag else c)
        chunks = (cp_rank, 2 * c - 1 - cp_rank) if zigzag else (cp_rank,)
        return np.concatenate([parts[chunk] for chunk in chunks])

    def prompt_position(self, cp_rank: int, local: Any) -> Any:
        """The prompt position at local cache position ``local`` of CP rank ``cp_rank``: chunks of
        ``cp_interleave`` tokens dealt round robin, or the rank's prefill chunks back to back
        (past them, positions from the prompt's end on: filler no transfer may move)."""
        if self.chunked:
            held, at = self.chunk_tokens(cp_rank), np.asarray(local)
            past = self.prompt_tokens + at - len(held)
            inside = held[np.clip(at, 0, len(held) - 1)] if len(held) else past
            position = np.where(at < len(held), inside, past)
            return int(position) if position.ndim == 0 else position
        n, c = self.cp_interleave, self.cp_size
        return local // n * (n * c) + cp_rank * n + local % n

    def holder(self, position: int) -> tuple[int, int]:
        """(CP rank, local position) of a prompt position (below ``prompt_tokens`` if chunked)."""
        if self.chunked:
            for cp_rank in range(self.cp_size):
                found = np.flatnonzero(self.chunk_tokens(cp_rank) == position)
                if len(found):
                    return cp_rank, int(found[0])
            raise ValueError(f"position {position} is past the {self.prompt_tokens}-token prompt")
        n, c = self.cp_interleave, self.cp_size
        return position // n % c, position // (n * c) * n + position % n


def true_heads(total: int, tp: int, q: int) -> list[int]:
    """Rule 1, written independently of kvroute.geometry.leaves.heads."""
    if tp <= total:
        return list(range(q * (total // tp), (q + 1) * (total // tp)))
    return [q * total // tp]


@dataclass
class Layout:
    doc: dict[str, Any]
    # (class index, layer) -> (pool_id, offset); pool_id -> (slot_bytes, slot_stride, num_slots)
    regions: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    pools: dict[int, tuple[int, int, int]] = field(default_factory=dict)


def side_window(side: Side, c: int, cls: ViewClass) -> int | None:
    return dict(side.windows).get(c, cls.window)


def rank_layers(side: Side, cls: ViewClass, pp_rank: int) -> list[int]:
    if cls.owner == "draft":
        # Draft layers are not split by stage: one stage declares them all (usually the last,
        # where serving stacks place the MTP/Eagle head).
        return (
            list(range(side.num_draft_layers)) if pp_rank == side.draft_stage % side.pp_size else []
        )
    start = sum(side.layers_per_stage[:pp_rank])
    stage = range(start, start + side.layers_per_stage[pp_rank])
    return [layer for layer in stage if cls.layers is None or layer in cls.layers]


def per_rank_heads(cls: ViewClass, side: Side) -> int:
    if cls.kind == "ssm":
        return cls.total_heads // side.state_tp  # state is split, never replicated
    return 1 if cls.kind == "replicated" else len(true_heads(cls.total_heads, side.tp_per_dp, 0))


def layer_bytes(cls: ViewClass, side: Side) -> int:
    if cls.kind == "ssm":
        return per_rank_heads(cls, side) * cls.unit
    if cls.kind == "conv":
        return sum(cls.sections) // side.state_tp
    if cls.per_request:
        return cls.unit
    tokens = side.tokens_per_block
    return cls.buffers * tokens * cls.unit * per_rank_heads(cls, side)


def _pool_of(side: Side, cls: ViewClass) -> tuple[int, str]:
    """(pool id, slot axis) a class's regions go to."""
    if cls.is_state:
        return (0 if side.shared_state_pool else 2), "state"
    return (0 if side.shared_pool or cls.owner != "draft" else 1), "block"


def _state_members(cls: ViewClass, side: Side) -> dict[str, Any]:
    if cls.kind == "ssm":
        return {"ssm_bytes_per_head": cls.unit}
    if cls.kind == "conv":
        return {"conv_sections": [size // side.state_tp for size in cls.sections]}
    return {"per_request": True}


def layout_rank(
    side: Side, classes: list[ViewClass], rank: int, num_slots: int | None = None
) -> Layout:
    """A registration document (docs/geometry.md) for one rank, with layers placed in a shuffled order with gaps."""
    num_slots = side.num_slots if num_slots is None else num_slots
    rng = random.Random(side.seed * 1000 + rank)
    pp_rank = side.position(rank)[0]
    regions = [
        (c, layer) for c, cls in enumerate(classes) for layer in rank_layers(side, cls, pp_rank)
    ]
    rng.shuffle(regions)
    layout = Layout(doc={})
    cursor: dict[tuple[int, str], int] = {}
    for c, layer in regions:
        where = _pool_of(side, classes[c])
        offset = cursor.get(where, 0) + rng.choice([0, 0, 1, 3])
        layout.regions[(c, layer)] = (where[0], offset)
        cursor[where] = offset + layer_bytes(classes[c], side)
    views = [
        _view_doc(side, c, cls, layout)
        for c, cls in enumerate(classes)
        if any(cc == c for cc, _ in layout.regions)
    ]
    pools = []
    for pool in sorted({pool for pool, _ in cursor}):
        end = max(stop for (p, _), stop in cursor.items() if p == pool)
        slot_bytes = end + rng.choice([0, 2])
        stride = slot_bytes + rng.choice([0, 0, 5])
        layout.pools[pool] = (slot_bytes, stride, num_slots)
        pools.append(
            {
                "pool_id": pool,
                "slot_bytes": slot_bytes,
                "slot_stride": stride,
                "num_slots": num_slots,
            }
        )
    layout.doc = _rank_doc(side, classes, rank, pools, views)
    return layout


def _rank_doc(
    side: Side, classes: list[ViewClass], rank: int, pools: list[Any], views: list[Any]
) -> dict[str, Any]:
    pp_rank, tp_rank, cp_rank = side.position(rank)
    block_classes = [c for c, cls in enumerate(classes) if not cls.is_state]
    legacy_heads = [per_rank_heads(classes[c], side) for c in side.legacy]
    attention_heads = (
        legacy_heads[0]
        if legacy_heads
        else per_rank_heads(classes[block_classes[0]], side)
        if block_classes
        else 1
    )
    return {
        "role": side.role,
        "tp_size": side.tp_size,
        "tp_rank": tp_rank,
        "pp_size": side.pp_size,
        "pp_rank": pp_rank,
        "attention_dp": side.attention_dp,
        "dp_size": side.dp_size if side.attention_dp else 1,
        "dp_rank": tp_rank // side.tp_per_dp if side.attention_dp else 0,
        "cp_size": side.cp_size,
        "cp_rank": cp_rank,
        "cp_interleave": side.cp_interleave,
        "cp_layout": side.cp_layout,
        "layers_per_stage": list(side.layers_per_stage),
        "num_draft_layers": side.num_draft_layers,
        "tokens_per_block": side.tokens_per_block,
        "attention": {
            "num_kv_heads": attention_heads,
            "head_dim": side.head_dim,
            "dtype": side.dtype,
            "is_mla": False,
        },
        "pools": pools,
        "views": views,
        "lease_seconds": 30,
        **({"kv_quantization": dict(side.quantization)} if side.quantization else {}),
    }


def _view_doc(side: Side, c: int, cls: ViewClass, layout: Layout) -> dict[str, Any]:
    layers = sorted((layer, off) for (cc, layer), (_, off) in layout.regions.items() if cc == c)
    view: dict[str, Any] = {
        "view_id": c,
        "pool_id": layout.regions[(c, layers[0][0])][0],
        "kind": cls.kind,
        "roles": list(cls.roles),
        "owner": cls.owner,
        "buffers_per_layer": cls.buffers,
        "bytes_per_layer": layer_bytes(cls, side),
        "layers": [{"layer": layer, "offset": off} for layer, off in layers],
    }
    if cls.is_state:
        view.update(_state_members(cls, side))
    elif cls.kind != "replicated":
        if c not in side.legacy:
            view["num_kv_heads"] = per_rank_heads(cls, side)
        if side.declare_totals:
            view["total_kv_heads"] = cls.total_heads
    window = None if cls.is_state else side_window(side, c, cls)
    if window is not None:
        view["sliding_window"] = window
    interior = side.interior(c)
    if interior is not None:
        order, tilings = interior
        view["interior"] = {
            "order": order,
            "tilings": [_tiling(*tiling) for tiling in tilings],
        }
    if cls.dtype:
        view["dtype"] = cls.dtype
    return view


def instance(
    side: Side, classes: list[ViewClass], name: str, num_slots: int | None = None
) -> tuple[list[RankRegistration], list[Layout]]:
    layouts = [layout_rank(side, classes, r, num_slots) for r in range(side.ranks)]
    regs = [
        RankRegistration.from_json(layout.doc, deployment="world", instance=name, rank=r)
        for r, layout in enumerate(layouts)
    ]
    return regs, layouts


def admitted(
    classes: list[ViewClass], ctx: Side, gen: Side
) -> tuple[list[RankRegistration], list[Layout], list[RankRegistration], list[Layout]]:
    """Both instances of a world, each checked against the other as registration checks it (a
    refusal raises): context ranks and layouts, then generation ranks and layouts."""
    senders, sender_layouts = instance(ctx, classes, "ctx")
    receivers, receiver_layouts = instance(gen, classes, "gen")
    check_registration(senders[0], senders[1:], receivers)
    check_registration(receivers[-1], receivers[:-1], senders)
    return senders, sender_layouts, receivers, receiver_layouts


def _tiling(planes: int, group: int, pieces: int = 1) -> dict[str, int]:
    doc = {"planes": planes, "token_group": group}
    if pieces != 1:
        doc["group_planes"] = pieces
    return doc
