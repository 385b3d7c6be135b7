"""Plans between blocks of different sizes: one period of tokens that both sides cut evenly.

A view pair's moved bytes are *rows*: for every moved layer and buffer, one row per moved head (HND
and replicated views, where a head's tokens are contiguous) or one row of head slices (NHD, where a
token's heads are contiguous). Inside a row, token t sits at ``base + (t mod tpb) x pitch`` of the
block holding t, on each side. Over ``L = lcm(tpb_src, tpb_dst)`` tokens both sides cut evenly, so a
plan states one period (L / tpb_src sender blocks to L / tpb_dst receiver blocks) and it repeats.

Cutting [0, L) at every block boundary of either side gives pieces that each lie in one sender block
and one receiver block. A row's piece is one fragment when the row's tokens are contiguous on both
sides (pitch = width: HND heads, replicated rows, NHD rows of every head) and one fragment per token
otherwise (NHD head slices). Those are maximal runs when the block sizes differ: two pieces of a row
are split by a block boundary, and two rows only touch on both sides where a piece fills a whole
block on both, which needs equal sizes.

Every fragment (a *span*) names its token interval, and its bytes are those tokens in order, the same
number per token on both sides, so any token range is cut from it by arithmetic (``ranges``).

With context parallelism (``spread``) a side's rank holds only some prompt tokens, at local
positions of its own cache, and its blocks cut local positions. The period is then the lcm of both
sides' placement periods (``cp x lcm(interleave, tpb)`` each, ``tpb`` without CP), a side's blocks
per period are its *local* blocks, and a span is a run of prompt tokens both ranks hold that stays
inside one interleave chunk and one block on each side, so its tokens are consecutive local
positions on both and cut by the same arithmetic. Prompt positions (``first_token``, a job's token
range) stay global throughout.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvroute.geometry.leaves.spread import IDENTITY, Piece, Spread, shared_runs

Row = tuple[int, int, int, int, int]  # src_base, dst_base, src_pitch, dst_pitch, width (bytes)
# (src_block, src_offset, dst_block, dst_offset, length, first_token, tokens): blocks are indices
# within the period on each side, offsets are relative to that block's slot start, first_token is
# relative to the period start; the ``length`` bytes are the ``tokens`` tokens in order.
Span = tuple[int, int, int, int, int, int, int]
SPAN_FIELDS = (
    "src_block",
    "src_offset",
    "dst_block",
    "dst_offset",
    "length",
    "first_token",
    "tokens",
)


@dataclass(frozen=True, slots=True)
class PeriodMap:
    """One view pair's transfer over one period, as fragments with their token spans."""

    src_tokens_per_block: int
    dst_tokens_per_block: int
    spans: tuple[Span, ...]  # sorted by (dst_block, dst_offset)
    src_spread: Spread = IDENTITY
    dst_spread: Spread = IDENTITY
    token_group: int = 1  # tokens packed together (``Tiling``): a range is cut at their multiples

    @property
    def context_parallel(self) -> bool:
        return not (self.src_spread.trivial and self.dst_spread.trivial)

    @property
    def period_tokens(self) -> int:
        return math.lcm(
            self.src_spread.period(self.src_tokens_per_block),
            self.dst_spread.period(self.dst_tokens_per_block),
        )

    @property
    def src_blocks_per_period(self) -> int:
        """The sender rank's local blocks per period."""
        return self.period_tokens // (self.src_spread.size * self.src_tokens_per_block)

    @property
    def dst_blocks_per_period(self) -> int:
        return self.period_tokens // (self.dst_spread.size * self.dst_tokens_per_block)

    @property
    def bytes_per_period(self) -> int:
        return sum(span[4] for span in self.spans)

    @property
    def bytes_per_dst_block(self) -> int:
        """The most bytes any receiver block of a period receives from this pair.

        Without context parallelism every receiver block gets the same: all rows, tpb_dst tokens.
        With it, a block may get a share of its tokens from this sender rank (or none).
        """
        per_block = Counter[int]()
        for span in self.spans:
            per_block[span[2]] += span[4]
        return max(per_block.values(), default=0)

    @property
    def descriptors_per_dst_block(self) -> int:
        """The most fragments any one receiver block of the period receives."""
        counts = Counter(span[2] for span in self.spans)
        return max(counts.values(), default=0)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "descriptors_per_block": self.descriptors_per_dst_block,
            "period_tokens": self.period_tokens,
            "src_blocks_per_period": self.src_blocks_per_period,
            "dst_blocks_per_period": self.dst_blocks_per_period,
            "bytes_per_period": self.bytes_per_period,
            "descriptors_per_period": len(self.spans),
            "period_fragments": [list(span) for span in self.spans],
        }
        for name, spread in (("src_cp", self.src_spread), ("dst_cp", self.dst_spread)):
            if not spread.trivial:
                doc[name] = spread.to_json()
        if self.token_group > 1:
            doc["token_group"] = self.token_group
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> PeriodMap:
        """Parses the period members of a plan's view pair; ``ValueError`` names what is wrong."""
        period = _positive(doc, "period_tokens")
        src_blocks = _positive(doc, "src_blocks_per_period")
        dst_blocks = _positive(doc, "dst_blocks_per_period")
        spreads = [
            Spread.from_json(doc[name], name) if name in doc else IDENTITY
            for name in ("src_cp", "dst_cp")
        ]
        src_local, dst_local = (period // spread.size for spread in spreads)
        if (
            period % spreads[0].size
            or period % spreads[1].size
            or (src_local % src_blocks or dst_local % dst_blocks)
        ):
            raise ValueError(
                f"period_tokens {period} is not a whole number of blocks "
                f"({src_blocks} sender, {dst_blocks} receiver blocks per period)"
            )
        src_spread, dst_spread = spreads
        result = cls(src_local // src_blocks, dst_local // dst_blocks, (), src_spread, dst_spread)
        if result.period_tokens != period:
            raise ValueError(
                f"period_tokens {period} is not the least common multiple of the block sizes "
                f"{result.src_tokens_per_block} and {result.dst_tokens_per_block}"
                + (" under their CP placements" if result.context_parallel else "")
            )
        group = _positive(doc, "token_group") if "token_group" in doc else 1
        if min(result.src_tokens_per_block, result.dst_tokens_per_block) % group:
            raise ValueError(f"token_group {group} does not divide both sides' blocks")
        raw = doc.get("period_fragments")
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise ValueError("period_fragments must be a list of 7-integer fragments")
        spans = tuple(result.checked_span(span, index) for index, span in enumerate(raw))
        sizes = result.src_tokens_per_block, result.dst_tokens_per_block
        return cls(*sizes, spans, src_spread, dst_spread, token_group=group)

    def checked_span(self, span: object, index: int) -> Span:
        """``span`` as a Span when it lies inside one block on each side; ``ValueError`` otherwise."""
        where = f"period_fragments[{index}]"
        if (
            not isinstance(span, Sequence)
            or len(span) != len(SPAN_FIELDS)
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in span)
        ):
            raise ValueError(f"{where} must be [{', '.join(SPAN_FIELDS)}] with integers >= 0")
        src_block, _, dst_block, _, length, first, tokens = span
        last = first + tokens - 1
        ts, td = self.src_tokens_per_block, self.dst_tokens_per_block
        if tokens == 0 or length == 0 or length % tokens:
            raise ValueError(
                f"{where}: length {length} is not a positive multiple of {tokens} tokens"
            )
        if last >= self.period_tokens:
            raise ValueError(f"{where}: tokens [{first}, {last + 1}) leave the period")
        if self.context_parallel:
            self._check_spread_span(where, first, last, src_block, dst_block)
            return tuple(span)
        if (first // ts, last // ts, first // td, last // td) != (
            src_block,
            src_block,
            dst_block,
            dst_block,
        ):
            raise ValueError(
                f"{where}: tokens [{first}, {last + 1}) are not inside sender block {src_block} "
                f"({ts} tokens each) and receiver block {dst_block} ({td} tokens each)"
            )
        return tuple(span)

    def _check_spread_span(
        self, where: str, first: int, last: int, src_block: int, dst_block: int
    ) -> None:
        """Both ranks hold the span's tokens as one run of consecutive local positions, in the
        named block of each side."""
        for side, spread, tokens, block in (
            ("sender", self.src_spread, self.src_tokens_per_block, src_block),
            ("receiver", self.dst_spread, self.dst_tokens_per_block, dst_block),
        ):
            held = spread.holds(first) and spread.holds(last)
            local = spread.local(first), spread.local(last)
            if (
                not held
                or local[1] - local[0] != last - first
                or {
                    local[0] // tokens,
                    local[1] // tokens,
                }
                != {block}
            ):
                raise ValueError(
                    f"{where}: tokens [{first}, {last + 1}) are not one run of the {side} CP rank "
                    f"{spread.rank} of {spread.size} (interleave {spread.interleave}) inside its "
                    f"local block {block} ({tokens} tokens each)"
                )


def _positive(doc: Mapping[str, Any], name: str) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1")
    return value


def period_spans(rows: Iterable[Row], src_tokens: int, dst_tokens: int) -> tuple[Span, ...]:
    """Fragments of one period: every row cut at every block boundary of either side."""
    period = math.lcm(src_tokens, dst_tokens)
    cuts = sorted({*range(0, period, src_tokens), *range(0, period, dst_tokens), period})
    pieces: list[Piece] = []
    for t0, t1 in pairwise(cuts):
        sb, db = t0 // src_tokens, t0 // dst_tokens
        pieces.append((t0, t1, sb, t0 - sb * src_tokens, db, t0 - db * dst_tokens))
    return _cut_rows(rows, pieces)


def spread_spans(
    rows: Iterable[Row], src_tokens: int, dst_tokens: int, src: Spread, dst: Spread
) -> tuple[Span, ...]:
    """Fragments of one period between context-parallel placements: every row cut at the shared
    runs (``period_spans`` with local positions in place of prompt positions)."""
    return _cut_rows(rows, shared_runs(src_tokens, dst_tokens, src, dst))


def _cut_rows(rows: Iterable[Row], pieces: Sequence[Piece]) -> tuple[Span, ...]:
    """Every row cut at every piece (a run inside one block on both sides): one span per piece
    where both sides' rows are contiguous, else one per token."""
    spans: list[Span] = []
    for src_base, dst_base, src_pitch, dst_pitch, width in rows:
        contiguous = src_pitch == width == dst_pitch
        for t0, t1, sb, s_at, db, d_at in pieces:
            src_at, dst_at = src_base + s_at * src_pitch, dst_base + d_at * dst_pitch
            if contiguous:
                spans.append((sb, src_at, db, dst_at, (t1 - t0) * width, t0, t1 - t0))
            else:
                spans += [
                    (sb, src_at + k * src_pitch, db, dst_at + k * dst_pitch, width, t0 + k, 1)
                    for k in range(t1 - t0)
                ]
    spans.sort(key=lambda span: (span[2], span[3]))
    return tuple(spans)
