"""A synthetic deployment and an independent ground truth for planner tests.

A *world* is one model (view classes with their own head totals, layouts and byte sizes) served by a
context and a generation instance with their own TP/PP/attention-DP layouts. Every rank's registration
document is laid out here from first principles, every pool is filled from one logical KV tensor, and
the expected receiver bytes are computed by the same first principles — never by the planner's code.

Hybrid worlds add recurrent state (one slot per request: SSM heads, conv sections or replicated
state, split over the DP group's TP) on a subset of the layers, and sliding windows on block views:
a windowed block holds data on the receiver only if it holds a token the next token attends to.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.geometry import RankRegistration
from kvroute.geometry.window import window_skip


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
    windows: tuple[tuple[int, int | None], ...] = ()  # (class index, window) overriding the class
    shared_state_pool: bool = False  # state regions in pool 0, overlapping the block regions

    @property
    def pp_size(self) -> int:
        return len(self.layers_per_stage)

    @property
    def tp_per_dp(self) -> int:
        return self.tp_size // self.dp_size if self.attention_dp else self.tp_size


def true_heads(total: int, tp: int, q: int) -> list[int]:
    """Rule 1, written independently of kvroute.geometry.heads."""
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
        return cls.total_heads // side.tp_per_dp  # state is split, never replicated
    return 1 if cls.kind == "replicated" else len(true_heads(cls.total_heads, side.tp_per_dp, 0))


def layer_bytes(cls: ViewClass, side: Side) -> int:
    if cls.kind == "ssm":
        return per_rank_heads(cls, side) * cls.unit
    if cls.kind == "conv":
        return sum(cls.sections) // side.tp_per_dp
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
        return {"conv_sections": [size // side.tp_per_dp for size in cls.sections]}
    return {"per_request": True}


def layout_rank(side: Side, classes: list[ViewClass], rank: int, num_slots: int = 3) -> Layout:
    """An API.md document for one rank, with layers placed in a shuffled order with gaps."""
    rng = random.Random(side.seed * 1000 + rank)
    tp_rank, pp_rank = rank % side.tp_size, rank // side.tp_size
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
    block_classes = [c for c, cls in enumerate(classes) if not cls.is_state]
    legacy_heads = [per_rank_heads(classes[c], side) for c in side.legacy]
    attention_heads = (
        legacy_heads[0]
        if legacy_heads
        else per_rank_heads(classes[block_classes[0]], side)
        if block_classes
        else 1
    )
    layout.doc = {
        "role": side.role,
        "tp_size": side.tp_size,
        "tp_rank": tp_rank,
        "pp_size": side.pp_size,
        "pp_rank": pp_rank,
        "attention_dp": side.attention_dp,
        "dp_size": side.dp_size if side.attention_dp else 1,
        "dp_rank": tp_rank // side.tp_per_dp if side.attention_dp else 0,
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
    }
    return layout


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
    if cls.dtype:
        view["dtype"] = cls.dtype
    return view


def instance(
    side: Side, classes: list[ViewClass], name: str, num_slots: int = 3
) -> tuple[list[RankRegistration], list[Layout]]:
    layouts = [layout_rank(side, classes, r, num_slots) for r in range(side.tp_size * side.pp_size)]
    regs = [
        RankRegistration.from_json(layout.doc, deployment="world", instance=name, rank=r)
        for r, layout in enumerate(layouts)
    ]
    return regs, layouts


def in_window(
    ctx: Side, gen: Side, classes: list[ViewClass], prompt_tokens: int, list_length: int
) -> Callable[[int, int], bool]:
    """keep(class, j): whether position ``j`` of a block list (the prompt's last ``list_length``
    blocks) holds a token the next token attends to under the smaller of the two windows."""
    tokens = gen.tokens_per_block
    first = -(-prompt_tokens // tokens) - list_length

    def keep(c: int, j: int) -> bool:
        declared = [side_window(side, c, classes[c]) for side in (ctx, gen)]
        windows = [w for w in declared if w is not None]
        if not windows:
            return True
        block = first + j
        last_token = min((block + 1) * tokens, prompt_tokens) - 1
        return last_token >= prompt_tokens + 1 - min(windows)

    return keep


class Truth:
    """Byte contents from the logical tensor: every logical byte of every block has a unique id."""

    def __init__(self, classes: list[ViewClass], tokens: int) -> None:
        self.classes = classes
        self.tokens = tokens
        # The byte index's radix fits the widest unit or conv section, so ids stay unique.
        self.unit_radix = max(max((c.unit, *c.sections)) for c in classes)

    def logical_id(
        self,
        c: int,
        block: int,
        layer: int,
        buf: int,
        head: np.ndarray | int,
        tok: np.ndarray | int,
        k: np.ndarray,
    ) -> np.ndarray:
        slot = (
            ((((c * 8 + block) * 64 + layer) * 4 + buf) * 64 + head) * 64 + tok
        ) * self.unit_radix
        return slot + k + 1

    def fill(
        self,
        side: Side,
        layout: Layout,
        rank: int,
        blocks: list[int],
        content: list[int],
        *,
        state_slots: Sequence[int] = (),
        state_content: Sequence[int] = (),
        keep: Callable[[int, int], bool] | None = None,
    ) -> dict[int, np.ndarray]:
        """Pool arrays (one int64 'byte' per element) of a rank holding logical blocks ``content`` at
        ``blocks`` (only list positions ``keep`` allows) and requests ``state_content``'s state at
        ``state_slots``."""
        arrays = {
            pool: np.zeros(stride * slots, dtype=np.int64)
            for pool, (_, stride, slots) in layout.pools.items()
        }
        q = (rank % side.tp_size) % side.tp_per_dp
        for (c, layer), (pool, offset) in layout.regions.items():
            cls = self.classes[c]
            stride = layout.pools[pool][1]
            if cls.is_state:
                for slot, request in zip(state_slots, state_content, strict=True):
                    position, ids = self._state(c, cls, side, q, layer, request)
                    arrays[pool][slot * stride + offset + position] = ids
                continue
            heads = np.array(
                [0] if cls.kind == "replicated" else true_heads(cls.total_heads, side.tp_per_dp, q)
            )
            h, t, u = len(heads), self.tokens, cls.unit
            j, tok, k = np.meshgrid(np.arange(h), np.arange(t), np.arange(u), indexing="ij")
            # nhd is token-major; hnd and replicated (one pseudo-head) are head-major.
            token_major = cls.kind == "nhd"
            position = tok * (h * u) + j * u + k if token_major else j * (t * u) + tok * u + k
            buf_bytes = h * t * u
            for index, (block, logical) in enumerate(zip(blocks, content, strict=True)):
                if keep is not None and not keep(c, index):
                    continue
                for b in range(cls.buffers):
                    base = block * stride + offset + b * buf_bytes
                    arrays[pool][base + position] = self.logical_id(
                        c, logical, layer, b, heads[j], tok, k
                    )
        return arrays

    def _state(
        self, c: int, cls: ViewClass, side: Side, q: int, layer: int, request: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(positions in the layer region, ids) of one request's state held by TP rank ``q``."""
        if cls.kind == "ssm":
            per_rank = cls.total_heads // side.tp_per_dp
            j, k = np.meshgrid(np.arange(per_rank), np.arange(cls.unit), indexing="ij")
            ids = self.logical_id(c, request, layer, 0, q * per_rank + j, 0, k)
            return (j * cls.unit + k).reshape(-1), ids.reshape(-1)
        if cls.kind == "conv":
            positions, ids, start = [], [], 0
            for section, size in enumerate(cls.sections):
                per_rank = size // side.tp_per_dp
                positions.append(start + np.arange(per_rank))
                # A section's bytes are channel-major and split contiguously over the TP.
                ids.append(
                    self.logical_id(
                        c, request, layer, section, 0, 0, q * per_rank + np.arange(per_rank)
                    )
                )
                start += per_rank
            return np.concatenate(positions), np.concatenate(ids)
        k = np.arange(cls.unit)
        return k, self.logical_id(c, request, layer, 0, 0, 0, k)


def execute(
    plan_json: dict[str, Any],
    sender_pools: dict[int, dict[int, np.ndarray]],
    sender_layouts: dict[int, Layout],
    receiver_layout: Layout,
    src_blocks: list[int],
    dst_blocks: list[int],
    *,
    state_pairs: Sequence[tuple[int, int]] = (),
    prompt_tokens: int | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Runs a plan on numpy arrays; returns the receiver's pools and a per-byte write count.

    Block views copy every block pair (a windowed view only those in its window, by
    ``kvroute.geometry.window``); state views copy each (sender slot, receiver slot) pair.
    """
    out = {
        pool: np.zeros(stride * slots, dtype=np.int64)
        for pool, (_, stride, slots) in receiver_layout.pools.items()
    }
    writes = {pool: np.zeros_like(arr) for pool, arr in out.items()}
    for peer in plan_json["peers"]:
        src_layout = sender_layouts[peer["rank"]]
        block_pairs = list(zip(src_blocks, dst_blocks, strict=True))
        for view in peer["views"]:
            skip = 0
            if "window" in view:
                assert prompt_tokens is not None, "a windowed plan needs the prompt length"
                window = view["window"]
                skip = window_skip(
                    window["tokens"], window["tokens_per_block"], prompt_tokens, len(block_pairs)
                )
            _copy(
                view,
                block_pairs[skip:],
                sender_pools[peer["rank"]],
                src_layout,
                receiver_layout,
                out,
                writes,
            )
        for state in peer.get("states", []):
            _copy(
                state,
                state_pairs,
                sender_pools[peer["rank"]],
                src_layout,
                receiver_layout,
                out,
                writes,
            )
    return out, writes


def _copy(
    transfer: dict[str, Any],
    pairs: Sequence[tuple[int, int]],
    pools: dict[int, np.ndarray],
    src_layout: Layout,
    receiver_layout: Layout,
    out: dict[int, np.ndarray],
    writes: dict[int, np.ndarray],
) -> None:
    src = pools[transfer["src_pool"]]
    src_stride = src_layout.pools[transfer["src_pool"]][1]
    dst_stride = receiver_layout.pools[transfer["dst_pool"]][1]
    for sb, db in pairs:
        for s_off, d_off, length in transfer["fragments"]:
            s0, d0 = sb * src_stride + s_off, db * dst_stride + d_off
            out[transfer["dst_pool"]][d0 : d0 + length] = src[s0 : s0 + length]
            writes[transfer["dst_pool"]][d0 : d0 + length] += 1
