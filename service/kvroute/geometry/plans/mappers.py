"""Byte fragments for one matched view pair, relative to a slot start on each side.

Fragments are built from head intervals: the receiver's heads and the sender's heads under the pair's
head total, intersected. Offsets inside a buffer are (head - first held head) x unit, which stays
right under head replication where modulo-based formulas fetch the wrong head.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvroute.geometry.checks.pairs import PairGeometry
from kvroute.geometry.leaves.heads import head_range
from kvroute.geometry.registration.model import RankRegistration, View

Fragment = tuple[int, int, int]  # (src_offset, dst_offset, length)


def coalesce(fragments: Iterable[Fragment]) -> list[Fragment]:
    """Merges fragments contiguous on both sides into maximal runs.

    Destination ranges of one view pair never overlap (each byte is written once), so in destination
    order any two fragments that can merge are neighbours and one pass finds the maximal runs.
    """
    runs: list[list[int]] = []
    for src, dst, length in sorted(fragments, key=lambda f: f[1]):
        if runs:
            last = runs[-1]
            if last[0] + last[2] == src and last[1] + last[2] == dst:
                last[2] += length
                continue
        runs.append([src, dst, length])
    return [(src, dst, length) for src, dst, length in runs]


def held_heads(reg: RankRegistration, total: int) -> tuple[int, int]:
    return head_range(total, reg.tp_per_dp, reg.tp_rank_in_group)


HeadRange = tuple[int, int]


@dataclass(frozen=True, slots=True)
class MatchedPair:
    """A receiver view (``dst`` of ``receiver``) and the sender view matched to it (``src`` of
    ``sender``), with the pair's geometry: what the fragments and the token layout are built from."""

    sender: RankRegistration
    src: View
    receiver: RankRegistration
    dst: View
    geometry: PairGeometry

    def heads(self) -> tuple[HeadRange, HeadRange, HeadRange]:
        """The heads the sender holds, those the receiver holds, and those both hold (``lo >=
        hi``: none), under the pair's head total; for a sliced or intact mapper only."""
        s_lo, s_hi = held_heads(self.sender, self.geometry.total_heads)
        r_lo, r_hi = held_heads(self.receiver, self.geometry.total_heads)
        return (s_lo, s_hi), (r_lo, r_hi), (max(s_lo, r_lo), min(s_hi, r_hi))


def pair_fragments(pair: MatchedPair, layers: Iterable[int]) -> list[Fragment]:
    """Uncoalesced fragments moving ``layers`` of the pair from its sender to its receiver."""
    src, dst, geometry = pair.src, pair.dst, pair.geometry
    src_offsets, dst_offsets = src.offsets, dst.offsets
    if geometry.mapper == "replicated":
        return [(src_offsets[layer], dst_offsets[layer], geometry.unit) for layer in layers]
    (s_lo, s_hi), (r_lo, r_hi), (lo, hi) = pair.heads()
    if lo >= hi:
        return []
    if geometry.mapper == "intact":
        # Equal per-rank heads under one total means aligned, equal intervals: the whole region moves.
        return [(src_offsets[layer], dst_offsets[layer], geometry.unit) for layer in layers]
    unit, buffers = geometry.unit, src.buffers_per_layer
    length = (hi - lo) * unit
    if geometry.mapper == "hnd" and src.interior is not None and src.interior.heads_outer:
        # Each head holds all its buffers in one run (both sides tile alike, or the pair re-cuts).
        head = buffers * unit
        return [
            (src_offsets[layer] + (lo - s_lo) * head, dst_offsets[layer] + (lo - r_lo) * head,
             (hi - lo) * head)
            for layer in layers
        ]  # fmt: skip
    if geometry.mapper == "hnd":
        src_buffer, dst_buffer = src.buffer_bytes, dst.buffer_bytes
        src_head, dst_head = (lo - s_lo) * unit, (lo - r_lo) * unit
        return [
            (
                src_offsets[layer] + b * src_buffer + src_head,
                dst_offsets[layer] + b * dst_buffer + dst_head,
                length,
            )
            for layer in layers
            for b in range(buffers)
        ]
    # NHD: heads are interleaved per token, so a head slice is one fragment per token.
    tokens = geometry.tokens
    src_token, dst_token = (s_hi - s_lo) * unit, (r_hi - r_lo) * unit
    src_buffer, dst_buffer = tokens * src_token, tokens * dst_token
    src_head, dst_head = (lo - s_lo) * unit, (lo - r_lo) * unit
    return [
        (
            src_offsets[layer] + b * src_buffer + t * src_token + src_head,
            dst_offsets[layer] + b * dst_buffer + t * dst_token + dst_head,
            length,
        )
        for layer in layers
        for b in range(buffers)
        for t in range(tokens)
    ]
