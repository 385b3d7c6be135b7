"""One view's share of a job: passes over paired blocks, and the pieces of blocks a range cuts.

A *pass* is one fragment set applied to two paired block id arrays: the plan's block fragments for
the job's block pairs, or, for a view planned by period, the fragments of one (sender block, receiver
block) pair of the period applied to that pair in every whole period of the token range. The engine
compiles each pass once (cached by its key) and copies it with its fused strategies, so whole
periods cost what whole blocks cost.

*Pieces* are the concrete copies, from ``geometry.range_copies``, of the at most two partial periods
at the ends of a range (a receiver's cached prefix ending mid-block, a chunk boundary). They are few
and irregular, so they run as one indexed gather.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from kvroute.geometry import (
    BlockList,
    PeriodMap,
    TokenRange,
    first_gap,
    full_periods,
    range_copies,
)
from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.jobs import TokenWindow, TransferJob
from kvroute.transfer.plan import ViewCopy

NO_PIECES = np.empty((0, 5), dtype=np.int64)
NO_PIECES.setflags(write=False)


@dataclass(frozen=True, slots=True)
class Pass:
    """``fragments`` copied from each ``src_blocks[i]`` to ``dst_blocks[i]``."""

    key: tuple[Hashable, ...]  # names ``fragments`` in the engine's compiled-program cache
    fragments: np.ndarray  # (n, 3) src_offset, dst_offset, length; sorted by dst_offset
    src_blocks: np.ndarray
    dst_blocks: np.ndarray


@dataclass(frozen=True, slots=True)
class ViewWork:
    passes: tuple[Pass, ...]
    pieces: np.ndarray  # (n, 5) src block id, src offset, dst block id, dst offset, length


def view_work(view: ViewCopy, key: tuple[Hashable, ...], job: TransferJob, where: str) -> ViewWork:
    """What ``job`` copies of ``view``; raises ``TransferValidationError`` naming a gap."""
    if job.window is None and not view.periodic:
        src, dst = job.src_blocks, job.dst_blocks
        if len(src) != len(dst):
            raise TransferValidationError(
                "dst_blocks", f"has {len(dst)} ids but src_blocks has {len(src)}; they pair up"
            )
        return ViewWork((Pass(key, view.fragments, src, dst),), NO_PIECES)
    period = view.period
    if period is None:
        raise TransferValidationError(
            where,
            "has block fragments only; a token range needs the plan's period form "
            "(GET .../plans?fragments=period)",
        )
    window = job.window or TokenWindow()
    tokens, src, dst = window.lists(
        job.src_blocks, job.dst_blocks, period.src_tokens_per_block, period.dst_tokens_per_block
    )
    gap = first_gap(tokens, src, dst)
    if gap is not None:
        raise TransferValidationError(gap.field, gap.detail, code=gap.code, extras=gap.extras)
    whole = full_periods(tokens, period.period_tokens)
    passes = _whole_passes(view, period, key, whole, job, src, dst)
    cuts = [tokens]
    if whole:
        start, stop = whole.start * period.period_tokens, whole.stop * period.period_tokens
        ends = ((tokens.start, start), (stop, tokens.end))
        cuts = [TokenRange(a, b) for a, b in ends if a < b]
    copies = [copy for cut in cuts for copy in range_copies(period, cut, src, dst)]
    pieces = np.array(copies, dtype=np.int64).reshape(-1, 5) if copies else NO_PIECES
    return ViewWork(passes, pieces)


def _whole_passes(
    view: ViewCopy,
    period: PeriodMap,
    key: tuple[Hashable, ...],
    whole: range,
    job: TransferJob,
    src: BlockList,
    dst: BlockList,
) -> tuple[Pass, ...]:
    if not whole:
        return ()
    index = np.arange(whole.start, whole.stop, dtype=np.int64)
    if not view.periodic:  # equal block sizes: a period is one block, moved by block fragments
        src_ids = job.src_blocks[index - src.first_block]
        return (Pass(key, view.fragments, src_ids, job.dst_blocks[index - dst.first_block]),)
    src_step, dst_step = period.src_blocks_per_period, period.dst_blocks_per_period
    passes = []
    for (src_block, dst_block), fragments in period_groups(period).items():
        src_ids = job.src_blocks[index * src_step + src_block - src.first_block]
        dst_ids = job.dst_blocks[index * dst_step + dst_block - dst.first_block]
        passes.append(Pass((*key, src_block, dst_block), fragments, src_ids, dst_ids))
    return tuple(passes)


def period_groups(period: PeriodMap) -> dict[tuple[int, int], np.ndarray]:
    """The period's fragments per (sender block, receiver block) pair, as block fragments."""
    spans = np.array(period.spans, dtype=np.int64).reshape(-1, 7)
    order = np.lexsort((spans[:, 3], spans[:, 2], spans[:, 0]))
    spans = spans[order]
    pairs = spans[:, (0, 2)]
    breaks = np.flatnonzero(np.any(pairs[1:] != pairs[:-1], axis=1)) + 1
    groups = {}
    for part in np.split(spans, breaks):
        fragments = np.ascontiguousarray(part[:, (1, 3, 4)])
        fragments.setflags(write=False)
        groups[int(part[0, 0]), int(part[0, 2])] = fragments
    return groups
