"""Where every moved token of one view pair lives on each side: its rows, from which periods are cut.

A row is one run of a token's bytes that sits at the same place of every token's row on both sides
(``periods``). Classic hnd views give one row per moved head and buffer, nhd views one row of head
slices per buffer; a view that declares an ``Interior`` (a transposed or packed K, heads outermost)
gives one row per plane of the two sides' common refinement, so a block of any size on either
side is still a cut of the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from kvroute.geometry.leaves.parts import Interior, Tiling
from kvroute.geometry.leaves.spread import IDENTITY, Spread
from kvroute.geometry.plans.mappers import MatchedPair
from kvroute.geometry.registration.model import Kind
from kvroute.geometry.tokens.periods import PeriodMap, Row, period_spans, spread_spans


@dataclass(frozen=True)
class TokenAxis:
    """Where every moved token of one view pair lives on each side, from which periods are cut."""

    src_tokens: int
    dst_tokens: int
    token_unit: int  # bytes per token-head (per token, replicated); 0: no exact per-token layout
    head_major: bool  # HND and replicated: a head's tokens are contiguous
    layers: tuple[tuple[int, int], ...]  # (src offset, dst offset) of each moved layer region
    buffers: int
    src_buffer: int
    dst_buffer: int
    src_held: int  # heads each side holds in the view
    dst_held: int
    src_first: int  # first moved head, counted from each side's first held head
    dst_first: int
    moved: int  # heads moved per layer buffer
    src_spread: Spread = IDENTITY  # the prompt tokens each side's rank holds (CP)
    dst_spread: Spread = IDENTITY
    src_interior: Interior | None = None  # how each side tiles a head's tokens (hnd views)
    dst_interior: Interior | None = None

    @property
    def periodic(self) -> bool:
        """Block sizes differ, a side is context parallel or the sides tile tokens differently:
        the plan must state a period (its block fragments cannot)."""
        return (
            self.src_tokens != self.dst_tokens
            or not (self.src_spread.trivial and self.dst_spread.trivial)
            or self.src_interior != self.dst_interior
        )

    @property
    def token_group(self) -> int:
        return max(
            interior.token_group if interior is not None else 1
            for interior in (self.src_interior, self.dst_interior)
        )

    @cached_property
    def rows(self) -> tuple[Row, ...]:
        if not self.token_unit:
            raise ValueError(
                "the view pair's bytes per layer are not a whole number of token rows, so no "
                "token range can be cut from its blocks"
            )
        if self.src_interior is not None or self.dst_interior is not None:
            return tuple(row for layer in self.layers for row in self._tiled_rows(*layer))
        unit, rows = self.token_unit, []
        for src_layer, dst_layer in self.layers:
            for buffer in range(self.buffers):
                src = src_layer + buffer * self.src_buffer
                dst = dst_layer + buffer * self.dst_buffer
                if self.head_major:
                    src += self.src_first * self.src_tokens * unit
                    dst += self.dst_first * self.dst_tokens * unit
                    src_pitch, dst_pitch = self.src_tokens * unit, self.dst_tokens * unit
                    rows += [
                        (src + k * src_pitch, dst + k * dst_pitch, unit, unit, unit)
                        for k in range(self.moved)
                    ]
                else:
                    rows.append(
                        (
                            src + self.src_first * unit,
                            dst + self.dst_first * unit,
                            self.src_held * unit,
                            self.dst_held * unit,
                            self.moved * unit,
                        )
                    )
        return tuple(rows)

    def _tiled_rows(self, src_layer: int, dst_layer: int) -> list[Row]:
        """One layer's rows where a side declares an ``Interior``: per buffer and moved head, one
        row per plane of the two tilings' common refinement (a plane of either side is a whole
        number of them), each holding the same bytes of every token on both sides."""
        row, rows = self.token_unit, []
        for buffer in range(self.buffers):
            src_tiling = _tiling(self.src_interior, buffer)
            dst_tiling = _tiling(self.dst_interior, buffer)
            planes = math.lcm(src_tiling.planes, dst_tiling.planes)
            for k in range(self.moved):
                src_tile = self._tile(src_layer, buffer, self.src_first + k, "src")
                dst_tile = self._tile(dst_layer, buffer, self.dst_first + k, "dst")
                rows += [
                    (
                        src_tile + _plane_at(q, planes, src_tiling, self.src_tokens, row),
                        dst_tile + _plane_at(q, planes, dst_tiling, self.dst_tokens, row),
                        row // src_tiling.planes,
                        row // dst_tiling.planes,
                        row // planes,
                    )
                    for q in range(planes)
                ]
        return rows

    def _tile(self, layer: int, buffer: int, head: int, side: str) -> int:
        """Where one held head's buffer starts in a side's layer region."""
        interior = self.src_interior if side == "src" else self.dst_interior
        tokens = self.src_tokens if side == "src" else self.dst_tokens
        held = self.src_held if side == "src" else self.dst_held
        tile = tokens * self.token_unit
        if interior is not None and interior.heads_outer:
            return layer + (head * self.buffers + buffer) * tile
        return layer + (buffer * held + head) * tile

    @cached_property
    def period_map(self) -> PeriodMap:
        spreads = self.src_spread, self.dst_spread
        if spreads == (IDENTITY, IDENTITY):
            spans = period_spans(self.rows, *self.tokens)
        else:
            spans = spread_spans(self.rows, *self.tokens, *spreads)
        return PeriodMap(
            self.src_tokens, self.dst_tokens, spans, *spreads, token_group=self.token_group
        )

    @property
    def tokens(self) -> tuple[int, int]:
        return self.src_tokens, self.dst_tokens


def _tiling(interior: Interior | None, buffer: int) -> Tiling:
    return interior.tiling(buffer) if interior is not None else Tiling()


def _plane_at(q: int, planes: int, tiling: Tiling, tokens: int, row: int) -> int:
    """Offset in a head's buffer tile of piece ``q`` of ``planes`` (token 0): inside plane
    ``q // (planes / tiling.planes)`` of the tiling, at its share of that plane's bytes."""
    per_plane = planes // tiling.planes
    return (q // per_plane) * tokens * row // tiling.planes + (q % per_plane) * (row // planes)


def token_axis(
    pair: MatchedPair, layers: Iterable[int], prompt_tokens: int | None = None
) -> TokenAxis:
    """The token layout of ``layers`` of a matched pair, sender to receiver (planner orientation),
    for a prompt of ``prompt_tokens`` where a side's CP chunks depend on it."""
    src, dst, geometry = pair.src, pair.dst, pair.geometry
    if geometry.mapper == "replicated":
        held, first, moved, head_major = (1, 1), (0, 0), 1, True
    else:
        (s_lo, s_hi), (r_lo, r_hi), (lo, hi) = pair.heads()
        held, first, moved = (s_hi - s_lo, r_hi - r_lo), (lo - s_lo, lo - r_lo), max(0, hi - lo)
        head_major = src.kind is not Kind.NHD
    return TokenAxis(
        src_tokens=geometry.tokens,
        dst_tokens=geometry.peer_tokens,
        token_unit=geometry.token_unit,
        head_major=head_major,
        layers=tuple((src.offsets[layer], dst.offsets[layer]) for layer in layers),
        buffers=src.buffers_per_layer,
        src_buffer=src.buffer_bytes,
        dst_buffer=dst.buffer_bytes,
        src_held=held[0],
        dst_held=held[1],
        src_first=first[0],
        dst_first=first[1],
        moved=moved,
        src_spread=pair.sender.placement(prompt_tokens),
        dst_spread=pair.receiver.placement(prompt_tokens),
        src_interior=src.interior if head_major else None,
        dst_interior=dst.interior if head_major else None,
    )
