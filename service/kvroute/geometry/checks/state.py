"""Recurrent state (Mamba2 SSM and conv) between peers: checks, pairing and byte fragments.

A state view holds one slot per request, not per token block: the slot's region for a layer is the
request's whole state for that layer on this rank (reference 2.10). Three layouts exist:

- ``ssm``: ``[heads][head_dim][d_state]``; the heads are split contiguously over the mamba TP
  (``RankRegistration.state_tp``), so a rank holds ``bytes_per_layer / ssm_bytes_per_head`` heads.
- ``conv``: sections back to back (``[x | B | C]`` for Mamba2, ``[Q | K | V]`` for GDN), each
  channel-major and split contiguously over the mamba TP, with per-rank sizes ``conv_sections``.
- ``replicated`` with ``per_request``: identical bytes on every TP rank, copied whole.

Pairing is positional, as for KV heads: sender rank ``q`` of mamba TP ``s`` holds the fraction
``[q/s, (q+1)/s)`` of every section, receiver rank ``p`` of ``t`` holds ``[p/t, (p+1)/t)``, and a
pair moves the intersection. For TPs that divide one another this is the reference's pairing
(``peer_rank // (p/s) == my_rank``) and mapper (``min`` of the sizes at ``(fine rank mod ratio) x
copy`` on the coarse side, section starts accumulating per side); it also stays exact for ratios
the reference does not support (context TP3 to generation TP2). Unpaired ranks are never heard
from; replicated state has one elected writer, like replicated KV views.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvroute.geometry.checks.pairs import PairFailer
from kvroute.geometry.leaves.parts import Kind, View

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


Fragment = tuple[int, int, int]  # (src_offset, dst_offset, length)


@dataclass(frozen=True, slots=True)
class StateGeometry:
    """How one matched state view pair moves; ``local`` is the side it was computed from."""

    mapper: str  # "ssm" | "conv" | "replicated"
    local_sections: tuple[int, ...]  # per-rank bytes of each section of a layer region
    peer_sections: tuple[int, ...]
    unit: int  # bytes per SSM head; 1 for conv; bytes_per_layer for replicated state

    def total_units(self, local_tp: int, peer_tp: int) -> int:
        """The shard positions both sides are described in: heads (ssm) or lcm(TPs) parts (conv)."""
        if self.mapper == "ssm":
            return self.local_sections[0] // self.unit * local_tp
        if self.mapper == "conv":
            return math.lcm(local_tp, peer_tp)
        return 1


def sections(view: View) -> tuple[int, ...]:
    if view.kind is Kind.CONV and view.conv_sections is not None:
        return view.conv_sections
    return (view.bytes_per_layer,)


def state_geometry(
    local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> StateGeometry:
    """Checks one matched state pair (reference 2.10's compatibility rules) and describes it."""
    fail = PairFailer(local, view, peer)
    if view.dtype and theirs.dtype and view.dtype != theirs.dtype:
        raise fail("view_dtype_mismatch", "dtype", view.dtype, theirs.dtype)
    if view.kind is Kind.REPLICATED:
        fail.unless_same(
            theirs,
            "bytes_per_layer",
            "bytes_per_layer_mismatch",
            reason="replicated state differs for overlapping layers: "
            f"bytes_per_layer local={view.bytes_per_layer}, peer={theirs.bytes_per_layer}",
        )
        return StateGeometry("replicated", sections(view), sections(theirs), view.bytes_per_layer)
    if view.kind is Kind.SSM:
        _check_ssm(fail, local, view, peer, theirs)
    else:
        _check_conv(fail, local, view, peer, theirs)
    unit = view.ssm_bytes_per_head or 1
    return StateGeometry(view.kind.value, sections(view), sections(theirs), unit)


def _check_ssm(
    fail: PairFailer, local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> None:
    fail.unless_same(
        theirs,
        "ssm_bytes_per_head",
        "ssm_bytes_per_head_mismatch",
        reason=f"ssm_bytes_per_head differs: local={view.ssm_bytes_per_head}, "
        f"peer={theirs.ssm_bytes_per_head}; check head_dim / d_state / mamba_ssm_cache_dtype",
    )
    mine = view.bytes_per_layer * local.state_tp
    other = theirs.bytes_per_layer * peer.state_tp
    if mine != other:
        raise fail(
            "state_bytes_mismatch",
            "bytes_per_layer",
            mine,
            other,
            reason="global (TP-aggregated) SSM state differs: "
            f"local {view.bytes_per_layer} bytes/rank x mamba_tp {local.state_tp} = {mine}, "
            f"peer {theirs.bytes_per_layer} x mamba_tp {peer.state_tp} = {other}",
        )


def _check_conv(
    fail: PairFailer, local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> None:
    mine, other = sections(view), sections(theirs)
    if len(mine) != len(other):
        raise fail(
            "conv_sections_count_mismatch",
            "conv_sections",
            len(mine),
            len(other),
            reason=f"conv section counts differ: local {len(mine)} {list(mine)}, "
            f"peer {len(other)} {list(other)}",
        )
    for index, (a, b) in enumerate(zip(mine, other, strict=True)):
        if a * local.state_tp != b * peer.state_tp:
            raise fail(
                "conv_section_mismatch",
                f"conv_sections[{index}]",
                a * local.state_tp,
                b * peer.state_tp,
                reason=f"global (TP-aggregated) conv section {index} differs: "
                f"local {a} bytes/rank x mamba_tp {local.state_tp} = {a * local.state_tp}, "
                f"peer {b} x mamba_tp {peer.state_tp} = {b * peer.state_tp}",
            )


def shard(reg: RankRegistration, total: int) -> tuple[int, int]:
    """The positions (of ``total``) of every section a rank holds."""
    per_rank = total // reg.state_tp
    return reg.state_rank * per_rank, (reg.state_rank + 1) * per_rank


def state_fragments(
    sender: RankRegistration,
    src: View,
    receiver: RankRegistration,
    dst: View,
    geometry: StateGeometry,
    layers: Iterable[int],
) -> list[Fragment]:
    """Uncoalesced fragments moving ``layers`` of a pair, relative to a state slot on each side.

    ``geometry`` is computed from the sender's side (``local`` = sender).
    """
    src_offsets, dst_offsets = src.offsets, dst.offsets
    if geometry.mapper == "replicated":
        return [(src_offsets[layer], dst_offsets[layer], geometry.unit) for layer in layers]
    q, p = sender.state_rank, receiver.state_rank
    pieces = []  # (src offset in a layer region, dst offset, length), one per section
    src_start = dst_start = 0
    for mine, theirs in zip(geometry.local_sections, geometry.peer_sections, strict=True):
        # In a section's global bytes (mine x sender TP == theirs x receiver TP, checked) the
        # sender holds [q*mine, (q+1)*mine) and the receiver [p*theirs, (p+1)*theirs).
        lo, hi = max(q * mine, p * theirs), min((q + 1) * mine, (p + 1) * theirs)
        if lo < hi:
            pieces.append((src_start + lo - q * mine, dst_start + lo - p * theirs, hi - lo))
        src_start, dst_start = src_start + mine, dst_start + theirs
    return [
        (src_offsets[layer] + a, dst_offsets[layer] + b, length)
        for layer in layers
        for a, b, length in pieces
    ]
