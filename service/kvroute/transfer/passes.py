"""One view's share of a job as passes: fragment sets applied to paired block id arrays.

A token range splits at the block boundaries of either side into pieces that each lie in one sender
block and one receiver block (``geometry.periods``). Between the first and the last such boundary
inside the range, every piece is whole: it moves with the fragments of its (sender block, receiver
block) pair of the period, the same in every period, so each pair becomes one pass over all the
periods where it lies inside (with equal block sizes, the plan's block fragments over the whole
blocks). The engine compiles each such pass once, cached by its key, and copies it with its fused
strategies, so a range costs what its whole blocks cost.

Only the tokens before the first boundary and after the last (fewer than one block of either side
at each end: a receiver's cached prefix ending mid-block, a chunk boundary) are cut by arithmetic
(``geometry.range_copies``); they form one small pass per block pair, compiled for the job alone.

A windowed view moves the job's range from its window's first token on (``geometry.window``), by the
same passes; a recurrent-state view is one pass over the request's state slot pair.

A prompt-only job (a prompt length, no range) moves every view pair's tokens up to the prompt's last
token (``geometry.resolve_lists``), so the last block is cut like a range's end. Only a pair whose
bytes are not whole token rows (sub-byte rows, equal block sizes) cannot be cut: it moves the
lists' common suffix of whole blocks, the block holding the prompt's last token whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import numpy as np

from kvroute.geometry import (
    BlockList,
    TokenRange,
    block_ends,
    first_gap,
    periods_inside,
    range_copies,
    whole_pieces,
    windowed_range,
)
from kvroute.transfer.errors import TransferValidationError
from kvroute.transfer.jobs import TransferJob
from kvroute.transfer.plan import ViewCopy
from kvroute.transfer.slots import state_slots


@dataclass(frozen=True, slots=True)
class Pass:
    """``fragments`` copied from each ``src_blocks[i]`` to ``dst_blocks[i]``."""

    key: tuple[Hashable, ...] | None  # names ``fragments`` in the engine's cache; None: this job's
    fragments: np.ndarray  # (n, 3) src_offset, dst_offset, length; sorted by dst_offset
    src_blocks: np.ndarray
    dst_blocks: np.ndarray


def view_work(
    view: ViewCopy, key: tuple[Hashable, ...], job: TransferJob, where: str
) -> tuple[Pass, ...]:
    """What ``job`` copies of ``view``; raises ``TransferValidationError`` naming a gap."""
    if view.state:
        return (Pass(key, view.fragments, *state_slots(job)),)
    window = job.window
    whole = view.sliding_window is None and not view.periodic
    if whole and window.pairs_blocks:
        src_blocks, dst_blocks = job.src_blocks, job.dst_blocks
        if len(src_blocks) != len(dst_blocks):
            raise TransferValidationError(
                "dst_blocks",
                f"has {len(dst_blocks)} ids but src_blocks has {len(src_blocks)}; they pair up",
            )
        return (Pass(key, view.fragments, src_blocks, dst_blocks),)
    if whole and not view.token_rows and not window.names_tokens:
        # Equal block sizes: both suffix lists end with the block holding the prompt's last token.
        count = min(len(job.src_blocks), len(job.dst_blocks))
        return (Pass(key, view.fragments, job.src_blocks[-count:], job.dst_blocks[-count:]),)
    sizes = view.tokens_per_block
    if sizes is None:
        raise _needs_period(view, where)
    tokens, src, dst = job.lists(*sizes, view.spreads)
    if view.sliding_window is not None:
        assert window.prompt is not None  # slots.check_leg refused a windowed job without it
        start = view.sliding_window.first_token(window.prompt, view.spreads)
        windowed = windowed_range(tokens, start)
        if windowed is None:
            return ()
        tokens = windowed
    if not view.token_rows and not window.names_tokens:
        tokens = block_ends(tokens, sizes[0])
    gap = first_gap(tokens, src, dst)
    if gap is not None:
        raise TransferValidationError(gap.field, gap.detail, code=gap.code, extras=gap.extras)
    return _range_passes(view, key, job, where, tokens, src, dst)


def _needs_period(view: ViewCopy, where: str) -> TransferValidationError:
    if not view.token_rows:
        return TransferValidationError(
            where,
            "has bytes per layer that are not whole token rows (sub-byte rows), so no token "
            "range can be cut from its blocks: block pairs or a prompt length alone move it, "
            "in whole blocks",
        )
    return TransferValidationError(
        where,
        "has block fragments only; a token range needs the plan's period form "
        "(GET .../plans?fragments=period)",
    )


def _range_passes(
    view: ViewCopy,
    key: tuple[Hashable, ...],
    job: TransferJob,
    where: str,
    tokens: TokenRange,
    src: BlockList,
    dst: BlockList,
) -> tuple[Pass, ...]:
    """Whole pieces by cached passes, the ends of the range cut from the period.

    A context-parallel pair is cut from its period whole: its blocks hold local positions, so no
    prompt position is a block boundary on both sides the way ``whole_pieces`` needs."""
    cp = view.period is not None and view.period.context_parallel
    inner = None if cp else whole_pieces(tokens, src.tokens_per_block, dst.tokens_per_block)
    if inner is None:
        cuts = [tokens]
    else:
        ends = ((tokens.start, inner.start), (inner.end, tokens.end))
        cuts = [TokenRange(start, end) for start, end in ends if start < end]
    if cuts and view.period is None:
        raise _needs_period(view, where)
    passes = [] if inner is None else list(_inner_passes(view, key, inner, job, src, dst))
    for cut in cuts:
        passes += _cut_passes(view, cut, src, dst)
    return tuple(passes)


def _inner_passes(
    view: ViewCopy,
    key: tuple[Hashable, ...],
    inner: TokenRange,
    job: TransferJob,
    src: BlockList,
    dst: BlockList,
) -> Iterator[Pass]:
    if not view.periodic:  # equal block sizes: whole blocks, by the plan's block fragments
        size = src.tokens_per_block
        blocks = np.arange(inner.start // size, inner.end // size, dtype=np.int64)
        src_ids = job.src_blocks[blocks - src.first_block]
        yield Pass(key, view.fragments, src_ids, job.dst_blocks[blocks - dst.first_block])
        return
    assert view.period is not None
    length = view.period.period_tokens
    src_step, dst_step = view.period.src_blocks_per_period, view.period.dst_blocks_per_period
    for group in view.groups:
        inside = periods_inside(group.first_token, group.end_token, inner, length)
        if not inside:
            continue
        periods = np.arange(inside.start, inside.stop, dtype=np.int64)
        src_ids = job.src_blocks[periods * src_step + group.src_block - src.first_block]
        dst_ids = job.dst_blocks[periods * dst_step + group.dst_block - dst.first_block]
        pair = (*key, group.src_block, group.dst_block)
        yield Pass(pair, group.fragments, src_ids, dst_ids)


def _cut_passes(view: ViewCopy, tokens: TokenRange, src: BlockList, dst: BlockList) -> list[Pass]:
    """The copies of a range inside one piece per period end, one pass per block pair."""
    assert view.period is not None
    copies = np.array(range_copies(view.period, tokens, src, dst), dtype=np.int64).reshape(-1, 5)
    copies = copies[np.lexsort((copies[:, 3], copies[:, 2], copies[:, 0]))]
    breaks = np.flatnonzero(np.any(copies[1:, (0, 2)] != copies[:-1, (0, 2)], axis=1)) + 1
    passes = []
    for part in np.split(copies, breaks) if len(copies) else []:
        fragments = np.ascontiguousarray(part[:, (1, 3, 4)])
        passes.append(Pass(None, fragments, part[:1, 0].copy(), part[:1, 2].copy()))
    return passes
