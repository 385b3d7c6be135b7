"""Runs a plan document on numpy arrays, the way a data plane would, counting every byte it writes.

Block view pairs copy block pairs by their block fragments, or a token range cut from their period
form (``geometry.ranges``; lists named by their first token or by upstream's suffix rule; a prompt
length alone: the tokens both lists hold up to the prompt's last token). A windowed pair copies its
part of the range from its window's first token on (``geometry.window``), by its period or, with
equal block sizes, by whole blocks of its block fragments. A pair stated ``token_rows: false``
cannot be cut: a prompt-only job moves whole blocks of it. Recurrent-state pairs copy each (sender
slot, receiver slot) pair once. What the bytes should be is ``tests/truth.py``'s business, never
this module's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.geometry import (
    PeriodMap,
    Spread,
    TokenRange,
    TokenWindow,
    block_ends,
    check_covered,
    range_copies,
    window_start,
    windowed_range,
)
from tests.world import Layout

Copy = tuple[int, int, int, int, int]  # src slot, src offset, dst slot, dst offset, length


@dataclass(frozen=True)
class Request:
    """What a transfer names: block lists, a token range and first tokens, state slot pairs and
    the prompt's length."""

    src_blocks: list[int]
    dst_blocks: list[int]
    tokens: TokenRange | None = None
    firsts: tuple[int | None, int | None] = (None, None)
    state_pairs: Sequence[tuple[int, int]] = ()
    prompt_tokens: int | None = None

    def copies(self, view: dict[str, Any]) -> list[Copy]:
        """Every copy of one block view pair (raises ``TokenGap`` where a list falls short)."""
        window = view.get("window")
        prompt_only = self.tokens is None and self.firsts == (None, None)
        whole_only = view.get("token_rows") is False
        if prompt_only and window is None and "fragments" in view:
            if self.prompt_tokens is None:
                return self._pairs(view, self.src_blocks, self.dst_blocks)
            if whole_only:  # equal sizes: both suffix lists end with the prompt's last block
                n = min(len(self.src_blocks), len(self.dst_blocks))
                return self._pairs(view, self.src_blocks[-n:], self.dst_blocks[-n:])
        if "period_fragments" not in view and window is None:
            raise ValueError("a token range needs the pair's period form")
        period = PeriodMap.from_json(view) if "period_fragments" in view else None
        spreads = (Spread(), Spread())
        if period is not None:
            sizes = (period.src_tokens_per_block, period.dst_tokens_per_block)
            spreads = (period.src_spread, period.dst_spread)
        else:
            sizes = (window["src_tokens_per_block"], window["dst_tokens_per_block"])
        asked = TokenWindow(self.tokens, *self.firsts, self.prompt_tokens)
        span, src, dst = asked.lists(self.src_blocks, self.dst_blocks, *sizes, spreads)
        if window is not None:
            prompt = asked.prompt
            assert prompt is not None, "a windowed plan needs the prompt length"
            part = windowed_range(span, window_start(window["tokens"], prompt, *sizes, spreads))
            if part is None:
                return []
            span = part
        if whole_only and prompt_only:
            span = block_ends(span, sizes[0])
        if period is not None:
            return range_copies(period, span, src, dst)
        check_covered(span, src, dst)
        size = sizes[0]
        assert sizes[0] == sizes[1], "the block form pairs blocks of one size"
        if span.start % size or span.end % size:
            raise ValueError("the block form moves whole blocks only")
        blocks = range(span.start // size, -(-span.end // size))
        return self._pairs(
            view, [src.block_id(b) for b in blocks], [dst.block_id(b) for b in blocks]
        )

    @staticmethod
    def _pairs(view: dict[str, Any], src: Sequence[int], dst: Sequence[int]) -> list[Copy]:
        return [
            (sb, s, db, d, n)
            for sb, db in zip(src, dst, strict=True)
            for s, d, n in view["fragments"]
        ]


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
    request: Request,
    *,
    into: dict[int, np.ndarray] | None = None,
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Runs a plan on numpy arrays; returns the receiver's pools and a per-byte write count."""
    out = {
        pool: np.zeros(stride * slots, dtype=np.int64) if into is None else into[pool].copy()
        for pool, (_, stride, slots) in receiver_layout.pools.items()
    }
    writes = {pool: np.zeros_like(arr) for pool, arr in out.items()}
    for peer in plan_json["peers"]:
        src_layout = sender_layouts[peer["rank"]]
        parts = [(view, request.copies(view)) for view in peer["views"]]
        parts += [
            (
                state,
                [(s, a, d, b, n) for s, d in request.state_pairs for a, b, n in state["fragments"]],
            )
            for state in peer.get("states", [])
        ]
        for transfer, copies in parts:
            src_stride = src_layout.pools[transfer["src_pool"]][1]
            dst_stride = receiver_layout.pools[transfer["dst_pool"]][1]
            rows = [(sb * src_stride + s, db * dst_stride + d, n) for sb, s, db, d, n in copies]
            _apply(
                out[transfer["dst_pool"]],
                writes[transfer["dst_pool"]],
                sender_pools[peer["rank"]][transfer["src_pool"]],
                np.array(rows, dtype=np.int64).reshape(-1, 3),
            )
    return out, writes
