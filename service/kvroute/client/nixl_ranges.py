"""A token range's copies cut from a view pair's period, as (src block, src offset, dst block, dst
offset, length) rows for ``client.nixl_descs``: whole pieces by the period's fragments over every
period where they lie inside the range, the few tokens at each end by ``geometry.range_copies``.
Pure arithmetic, no NIXL import.
"""

from __future__ import annotations

import numpy as np

from kvroute.geometry import (
    BlockList,
    PeriodMap,
    TokenRange,
    periods_inside,
    range_copies,
    whole_pieces,
)


def range_rows(
    period: PeriodMap,
    tokens: TokenRange,
    src: BlockList,
    dst: BlockList,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
) -> np.ndarray:
    """(src block, src offset, dst block, dst offset, length) of every copy of the range."""
    parts = []
    # A context-parallel pair's blocks hold local positions: it is cut from its period whole.
    inner = (
        None
        if period.context_parallel
        else whole_pieces(tokens, period.src_tokens_per_block, period.dst_tokens_per_block)
    )
    cuts = [tokens]
    if inner is not None:
        spans = np.array(period.spans, dtype=np.int64).reshape(-1, 7)
        for (sb, db), group in _span_groups(spans):
            first, end = int(group[:, 5].min()), int((group[:, 5] + group[:, 6]).max())
            inside = periods_inside(first, end, inner, period.period_tokens)
            periods = np.arange(inside.start, inside.stop, dtype=np.int64)[:, None]
            ids_src = src_blocks[periods * period.src_blocks_per_period + sb - src.first_block]
            ids_dst = dst_blocks[periods * period.dst_blocks_per_period + db - dst.first_block]
            block = np.empty((len(periods), len(group), 5), dtype=np.int64)
            block[..., 0], block[..., 2] = ids_src, ids_dst
            block[..., 1], block[..., 3], block[..., 4] = group[:, 1], group[:, 3], group[:, 4]
            parts.append(block.reshape(-1, 5))
        ends = ((tokens.start, inner.start), (inner.end, tokens.end))
        cuts = [TokenRange(a, b) for a, b in ends if a < b]
    for cut in cuts:
        parts.append(np.array(range_copies(period, cut, src, dst), dtype=np.int64).reshape(-1, 5))
    return np.concatenate(parts) if parts else np.empty((0, 5), dtype=np.int64)


def _span_groups(spans: np.ndarray) -> list[tuple[tuple[int, int], np.ndarray]]:
    spans = spans[np.lexsort((spans[:, 3], spans[:, 2], spans[:, 0]))]
    breaks = np.flatnonzero(np.any(spans[1:, (0, 2)] != spans[:-1, (0, 2)], axis=1)) + 1
    return [((int(g[0, 0]), int(g[0, 2])), g) for g in np.split(spans, breaks) if len(g)]
