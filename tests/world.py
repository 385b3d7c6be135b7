"""A synthetic deployment and an independent ground truth for planner tests.

A *world* is one model (view classes with their own head totals, layouts and byte sizes) served by a
context and a generation instance with their own TP/PP/attention-DP layouts. Every rank's registration
document is laid out here from first principles, every pool is filled from one logical KV tensor, and
the expected receiver bytes are computed by the same first principles — never by the planner's code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.geometry import BlockList, PeriodMap, RankRegistration, TokenRange, range_copies


@dataclass(frozen=True)
class ViewClass:
    """One role class of the model: the same on both sides unless a test mutates it."""

    roles: tuple[str, ...]
    owner: str  # "target" | "draft"
    kind: str  # "hnd" | "nhd" | "replicated"
    total_heads: int  # 1 for replicated
    buffers: int
    unit: int  # bytes per token-head (sharded) or per token (replicated)
    dtype: str | None = None


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


def rank_layers(side: Side, cls: ViewClass, pp_rank: int) -> list[int]:
    if cls.owner == "draft":
        # Draft layers are not split by stage: one stage declares them all (usually the last,
        # where serving stacks place the MTP/Eagle head).
        return (
            list(range(side.num_draft_layers)) if pp_rank == side.draft_stage % side.pp_size else []
        )
    start = sum(side.layers_per_stage[:pp_rank])
    return list(range(start, start + side.layers_per_stage[pp_rank]))


def per_rank_heads(cls: ViewClass, side: Side) -> int:
    return 1 if cls.kind == "replicated" else len(true_heads(cls.total_heads, side.tp_per_dp, 0))


def layer_bytes(cls: ViewClass, side: Side) -> int:
    tokens = side.tokens_per_block
    return cls.buffers * tokens * cls.unit * per_rank_heads(cls, side)


def layout_rank(
    side: Side, classes: list[ViewClass], rank: int, num_slots: int | None = None
) -> Layout:
    """An API.md document for one rank, with layers placed in a shuffled order with gaps."""
    num_slots = side.num_slots if num_slots is None else num_slots
    rng = random.Random(side.seed * 1000 + rank)
    tp_rank, pp_rank = rank % side.tp_size, rank // side.tp_size
    regions = [
        (c, layer) for c, cls in enumerate(classes) for layer in rank_layers(side, cls, pp_rank)
    ]
    rng.shuffle(regions)
    layout = Layout(doc={})
    cursor: dict[int, int] = {}
    for c, layer in regions:
        pool = 0 if side.shared_pool else (1 if classes[c].owner == "draft" else 0)
        offset = cursor.get(pool, 0) + rng.choice([0, 0, 1, 3])
        layout.regions[(c, layer)] = (pool, offset)
        cursor[pool] = offset + layer_bytes(classes[c], side)
    views = []
    for c, cls in enumerate(classes):
        layers = sorted((layer, off) for (cc, layer), (_, off) in layout.regions.items() if cc == c)
        if not layers:
            continue
        pool = layout.regions[(c, layers[0][0])][0]
        view: dict[str, Any] = {
            "view_id": c,
            "pool_id": pool,
            "kind": cls.kind,
            "roles": list(cls.roles),
            "owner": cls.owner,
            "buffers_per_layer": cls.buffers,
            "bytes_per_layer": layer_bytes(cls, side),
            "layers": [{"layer": layer, "offset": off} for layer, off in layers],
        }
        if cls.kind != "replicated":
            if c not in side.legacy:
                view["num_kv_heads"] = per_rank_heads(cls, side)
            if side.declare_totals:
                view["total_kv_heads"] = cls.total_heads
        if cls.dtype:
            view["dtype"] = cls.dtype
        views.append(view)
    pools = []
    for pool, end in sorted(cursor.items()):
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
    legacy_heads = [per_rank_heads(classes[c], side) for c in side.legacy]
    attention_heads = legacy_heads[0] if legacy_heads else per_rank_heads(classes[0], side)
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


def instance(
    side: Side, classes: list[ViewClass], name: str
) -> tuple[list[RankRegistration], list[Layout]]:
    layouts = [layout_rank(side, classes, r) for r in range(side.tp_size * side.pp_size)]
    regs = [
        RankRegistration.from_json(layout.doc, deployment="world", instance=name, rank=r)
        for r, layout in enumerate(layouts)
    ]
    return regs, layouts


class Truth:
    """Byte contents from the logical tensor: every logical byte of the prompt has a unique id.

    A byte is named by its view class, prompt position (token), layer, buffer, global head and byte
    within the token-head, so the two sides may cut the prompt into blocks of any size and a byte
    still has one id wherever it lands.
    """

    MAX_POSITIONS = 512

    def __init__(self, classes: list[ViewClass], tokens: int | None = None) -> None:
        del tokens  # each side's block size comes with its Side
        self.classes = classes
        # The byte index's radix fits the widest unit, so ids stay unique for any head size.
        self.unit_radix = max(c.unit for c in classes)

    def logical_id(
        self,
        c: int,
        position: np.ndarray,
        layer: int,
        buf: int,
        head: np.ndarray,
        k: np.ndarray,
    ) -> np.ndarray:
        slot = (((c * self.MAX_POSITIONS + position) * 64 + layer) * 4 + buf) * 64 + head
        return slot * self.unit_radix + k + 1

    def fill(
        self, side: Side, layout: Layout, rank: int, blocks: list[int], content: list[int]
    ) -> dict[int, np.ndarray]:
        """Pool arrays (one int64 'byte' per element) of a rank holding logical blocks ``content`` at ``blocks``."""
        tokens = side.tokens_per_block
        placement = {
            block: logical * tokens for block, logical in zip(blocks, content, strict=True)
        }
        return self.place(side, layout, rank, placement)

    def place(
        self,
        side: Side,
        layout: Layout,
        rank: int,
        placement: dict[int, int],
        positions: range | None = None,
        into: dict[int, np.ndarray] | None = None,
    ) -> dict[int, np.ndarray]:
        """Pool arrays of a rank whose slot ``s`` holds the block starting at prompt position
        ``placement[s]``; only ``positions`` are written (every position when None), into copies of
        ``into`` (zeros when None)."""
        arrays = {
            pool: np.zeros(stride * slots, dtype=np.int64) if into is None else into[pool].copy()
            for pool, (_, stride, slots) in layout.pools.items()
        }
        q = (rank % side.tp_size) % side.tp_per_dp
        slots = np.array(sorted(placement), dtype=np.int64)
        starts = np.array([placement[s] for s in sorted(placement)], dtype=np.int64)
        for (c, layer), (pool, offset) in layout.regions.items():
            cls = self.classes[c]
            stride = layout.pools[pool][1]
            heads = np.array(
                [0] if cls.kind == "replicated" else true_heads(cls.total_heads, side.tp_per_dp, q)
            )
            h, t, u = len(heads), side.tokens_per_block, cls.unit
            n, j, tok, k = np.ogrid[: len(slots), :h, :t, :u]
            # nhd is token-major; hnd and replicated (one pseudo-head) are head-major.
            position = tok * (h * u) + j * u + k if cls.kind == "nhd" else j * (t * u) + tok * u + k
            prompt = starts[n] + tok
            shape = (len(slots), h, t, u)
            keep = np.ones(shape, bool)
            if positions is not None:
                keep &= (prompt >= positions.start) & (prompt < positions.stop)
            assert (prompt < self.MAX_POSITIONS).all()
            for b in range(cls.buffers):
                at = np.broadcast_to(slots[n] * stride + offset + b * h * t * u + position, shape)
                ids = np.broadcast_to(self.logical_id(c, prompt, layer, b, heads[j], k), shape)
                arrays[pool][at[keep]] = ids[keep]
        return arrays


def background(layout: Layout) -> dict[int, np.ndarray]:
    """Receiver pools before a transfer: a distinct negative value per byte, never a logical id."""
    return {
        pool: -np.arange(1, stride * slots + 1, dtype=np.int64)
        for pool, (_, stride, slots) in layout.pools.items()
    }


def _apply(out: np.ndarray, writes: np.ndarray, src: np.ndarray, copies: np.ndarray) -> None:
    """Runs (src_start, dst_start, length) rows; counts every destination byte written."""
    if not len(copies):
        return
    lengths = copies[:, 2]
    step = np.repeat(np.cumsum(lengths) - lengths, lengths)
    inner = np.arange(lengths.sum()) - step
    src_at, dst_at = (
        np.repeat(copies[:, 0], lengths) + inner,
        np.repeat(copies[:, 1], lengths) + inner,
    )
    out[dst_at] = src[src_at]
    np.add.at(writes, dst_at, 1)


def execute(
    plan_json: dict[str, Any],
    sender_pools: dict[int, dict[int, np.ndarray]],
    sender_layouts: dict[int, Layout],
    receiver_layout: Layout,
    src_blocks: list[int],
    dst_blocks: list[int],
    *,
    tokens: TokenRange | None = None,
    firsts: tuple[int | None, int | None] = (None, None),
    into: dict[int, np.ndarray] | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Runs a plan on numpy arrays; returns the receiver's pools and a per-byte write count.

    Without ``tokens`` block ``src_blocks[i]`` goes to ``dst_blocks[i]`` by block fragments; with
    it, each view pair's period form is cut to the range (``firsts``: each side's first token, None
    for upstream's suffix rule).
    """
    out = {
        pool: np.zeros(stride * slots, dtype=np.int64) if into is None else into[pool].copy()
        for pool, (_, stride, slots) in receiver_layout.pools.items()
    }
    writes = {pool: np.zeros_like(arr) for pool, arr in out.items()}
    for peer in plan_json["peers"]:
        src_layout = sender_layouts[peer["rank"]]
        for view in peer["views"]:
            src_stride = src_layout.pools[view["src_pool"]][1]
            dst_stride = receiver_layout.pools[view["dst_pool"]][1]
            if tokens is None:
                copies = [
                    (sb * src_stride + s, db * dst_stride + d, n)
                    for sb, db in zip(src_blocks, dst_blocks, strict=True)
                    for s, d, n in view["fragments"]
                ]
            else:
                cut = _cut(view, tokens, src_blocks, dst_blocks, firsts)
                copies = [(sb * src_stride + s, db * dst_stride + d, n) for sb, s, db, d, n in cut]
            _apply(
                out[view["dst_pool"]],
                writes[view["dst_pool"]],
                sender_pools[peer["rank"]][view["src_pool"]],
                np.array(copies, dtype=np.int64).reshape(-1, 3),
            )
    return out, writes


def _cut(
    view: dict[str, Any],
    tokens: TokenRange,
    src_blocks: list[int],
    dst_blocks: list[int],
    firsts: tuple[int | None, int | None],
) -> list[tuple[int, int, int, int, int]]:
    period = PeriodMap.from_json(view)
    lists = []
    for blocks, first, tpb, name in (
        (src_blocks, firsts[0], period.src_tokens_per_block, "src_blocks"),
        (dst_blocks, firsts[1], period.dst_tokens_per_block, "dst_blocks"),
    ):
        if first is None:
            lists.append(BlockList.suffix(blocks, tokens.end, tpb, name))
        else:
            lists.append(BlockList(blocks, first, tpb))
    return range_copies(period, tokens, lists[0], lists[1])
