"""The checks a parsed plan must pass before any job runs it: every destination byte written once.

Destination bytes are compared per receiver pool and slot axis: two fragments (of one view, of two
views, of two sender ranks) that write one byte of a block, or one byte of a state slot, refuse the
plan. Block and state regions of one pool may share slot bytes, never a slot: such pools are
reported (``shared_slot_pools``) so that a job naming one slot id both ways is refused by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.fragments import DST, SRC

if TYPE_CHECKING:
    from kvroute.transfer.plan import CopyPlan, ViewCopy


def check_exactly_once(plan: CopyPlan) -> None:
    """Refuse a plan in which two fragments write the same destination byte of a block (or of a
    state slot)."""
    by_pool: dict[tuple[int, bool], list[tuple[ViewCopy, int, int]]] = {}
    for peer in plan.senders:
        for index, view in enumerate(peer.copies):
            by_pool.setdefault((view.dst_pool, view.state), []).append((view, peer.rank, index))
    for (pool_id, _), parts in by_pool.items():
        blocks = _common_blocks([view for view, _, _ in parts])
        rows = [
            _destination_intervals(view, f"rank {rank} view #{index}", blocks)
            for view, rank, index in parts
        ]
        starts = np.concatenate([row[:, 0] for row in rows])
        ends = starts + np.concatenate([row[:, 1] for row in rows])
        owners = np.concatenate([np.full(len(row), n) for n, row in enumerate(rows)])
        order = np.argsort(starts, kind="stable")
        clash = np.flatnonzero(starts[order][1:] < ends[order][:-1])
        if len(clash):
            first, second = order[clash[0]], order[clash[0] + 1]
            a, b = parts[owners[first]], parts[owners[second]]
            raise TransferValidationError(
                "plan.peers",
                f"destination bytes of pool {pool_id} at offset "
                f"{int(starts[second]) % _BLOCK_KEY} are written twice: by rank {a[1]} view "
                f"#{a[2]} and by rank {b[1]} view #{b[2]}",
            )


# Destination bytes are keyed ``block * _BLOCK_KEY + offset`` where views must be told apart by
# the receiver block of their period (context parallelism): no slot is this large.
_BLOCK_KEY = 1 << 40


def _common_blocks(views: list[ViewCopy]) -> int:
    """Receiver blocks over which views of one pool are compared: one, unless a context-parallel
    period writes different bytes into different receiver blocks (each sender CP rank its own
    tokens); then the lcm of those periods' receiver blocks."""
    sizes = [
        view.period.dst_blocks_per_period
        for view in views
        if view.periodic and view.period is not None and view.period.context_parallel
    ]
    return math.lcm(*sizes) if sizes else 1


def _destination_intervals(view: ViewCopy, name: str, blocks: int = 1) -> np.ndarray:
    """(key, length) rows a view writes in ``blocks`` consecutive receiver slots (see
    ``_BLOCK_KEY``), or in one slot.

    A period writes the same bytes into each of its receiver blocks (every row, that block's
    tokens), though cut at other tokens where the block sizes do not divide one another (a 4-token
    receiver block of a 6 -> 4 period holds one piece or two). So after checking each block on its
    own, the union of what all blocks write stands for the view beside the others, in every one
    of the compared blocks. A context-parallel period writes only its own tokens' bytes: its
    blocks are laid out as they are, period after period.
    """
    if not view.periodic:
        return _tiled(view.slot_spans(DST), blocks)
    assert view.period is not None
    spans = np.array(view.period.spans, dtype=np.int64).reshape(-1, 7)
    order = np.lexsort((spans[:, 3], spans[:, 2]))
    block, start, length = spans[order, 2], spans[order, 3], spans[order, 4]
    overlap = (block[1:] == block[:-1]) & (start[1:] < start[:-1] + length[:-1])
    if overlap.any():
        at = int(np.flatnonzero(overlap)[0]) + 1
        raise TransferValidationError(
            "plan.peers",
            f"{name} writes offset {int(start[at])} of its receiver block {int(block[at])} twice",
        )
    if blocks > 1 and view.period.context_parallel:
        step = view.period.dst_blocks_per_period
        periods = np.arange(blocks // step, dtype=np.int64)[:, None] * step
        keys = ((periods + block) * _BLOCK_KEY + start).reshape(-1)
        return np.stack(
            [keys, np.broadcast_to(length, (len(periods), len(length))).reshape(-1)], axis=1
        )
    return _tiled(_union(start, start + length), blocks)


def _tiled(spans: np.ndarray, blocks: int) -> np.ndarray:
    """(offset, length) rows of one slot, repeated in ``blocks`` slots as keys."""
    if blocks == 1:
        return spans
    keys = (np.arange(blocks, dtype=np.int64)[:, None] * _BLOCK_KEY + spans[:, 0]).reshape(-1)
    return np.stack([keys, np.tile(spans[:, 1], blocks)], axis=1)


def _union(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Maximal (offset, length) runs covering the [start, end) intervals, overlaps merged."""
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    breaks = np.flatnonzero(starts[1:] > ends[:-1]) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks - 1, [len(starts) - 1]))
    return np.stack([starts[first], ends[last] - starts[first]], axis=1)


def _spans(views: list[ViewCopy], column: int) -> np.ndarray:
    """[start, end) of every fragment of some views in a slot on one side, sorted by start."""
    if not views:
        return np.empty((0, 2), dtype=np.int64)
    joined = np.concatenate([view.slot_spans(column) for view in views])
    spans = np.stack([joined[:, 0], joined[:, 0] + joined[:, 1]], axis=1)
    return spans[np.argsort(spans[:, 0], kind="stable")]


def _intersect(blocks: np.ndarray, states: np.ndarray) -> bool:
    """Whether two span lists (sorted by start) share a byte: some state span starts before the
    furthest end of the block spans that start before it ends."""
    if not len(blocks) or not len(states):
        return False
    ends = np.maximum.accumulate(blocks[:, 1])
    index = np.searchsorted(blocks[:, 0], states[:, 1], side="left") - 1
    return bool(((index >= 0) & (ends[np.maximum(index, 0)] > states[:, 0])).any())


def shared_slot_pools(plan: CopyPlan) -> tuple[frozenset[int], frozenset[tuple[int, int]]]:
    """(receiver pools, (sender rank, pool)s) whose block and state regions overlap in a slot."""
    senders = plan.senders
    dst = {
        pool
        for pool in {view.dst_pool for peer in senders for view in peer.states}
        if _intersect(
            _spans([v for p in senders for v in p.views if v.dst_pool == pool], DST),
            _spans([v for p in senders for v in p.states if v.dst_pool == pool], DST),
        )
    }
    src = {
        (peer.rank, pool)
        for peer in senders
        for pool in {view.src_pool for view in peer.states}
        if _intersect(
            _spans([v for v in peer.views if v.src_pool == pool], SRC),
            _spans([v for v in peer.states if v.src_pool == pool], SRC),
        )
    }
    return frozenset(dst), frozenset(src)
