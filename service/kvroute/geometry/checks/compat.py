"""Peer compatibility and the full registration check (docs/geometry.md "Rejected at the boundary").

Checks run stage by stage across all peers (model identity and KV quantization, rank-wide fields,
then view matching, then per-pair geometry: KV heads and sliding windows of block views, SSM heads, TP-aggregated bytes and conv
sections of state views), so a draft-layer mismatch is always reported as such, never as the
geometry error it would otherwise surface as on the draft views.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvroute.geometry.checks.instance import check_instance
from kvroute.geometry.checks.matching import match_view
from kvroute.geometry.checks.pairs import PairGeometry, pair_geometry
from kvroute.geometry.checks.state import StateGeometry, state_geometry
from kvroute.geometry.checks.validate import check_self
from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import DTYPE_BITS, View
from kvroute.geometry.registration.identity import check_identity

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


MatchedPair = tuple["RankRegistration", View, "RankRegistration", View]


def _rank_fields(reg: RankRegistration) -> list[tuple[str, str, object]]:
    """(code, field, value) in check order. The layer-count check is kvroute's addition: a peer with
    another number of target layers is another model, and the layers only one side has would silently
    stay unwritten.

    Tokens per block are not compared here: plans re-cut blocks over a period of tokens (see
    ``periods``). ``tokens_per_block_mismatch`` remains only for a view pair whose block sizes differ
    and whose bytes per layer on either side are not a whole number of token rows (buffers x heads x
    tokens), since such a block has no per-token layout to re-cut (``pairs.pair_geometry``)."""
    bits = DTYPE_BITS[reg.attention.dtype]
    return [
        ("draft_layers_mismatch", "num_draft_layers", reg.num_draft_layers),
        ("layer_count_mismatch", "layers_per_stage", reg.num_layers),
        ("mla_mismatch", "attention.is_mla", reg.attention.is_mla),
        ("element_size_mismatch", "attention.dtype", f"{reg.attention.dtype} ({bits} bits)"),
        ("dtype_mismatch", "attention.dtype", reg.attention.dtype),
        ("head_dim_mismatch", "attention.head_dim", reg.attention.head_dim),
    ]


def check_rank_fields(reg: RankRegistration, peer: RankRegistration) -> None:
    for (code, field, mine), (_, _, theirs) in zip(
        _rank_fields(reg), _rank_fields(peer), strict=True
    ):
        if (
            code == "element_size_mismatch"
            and DTYPE_BITS[reg.attention.dtype] == DTYPE_BITS[peer.attention.dtype]
        ):
            continue
        if mine != theirs:
            detail = f"{field} differs from {peer.label()}: local={mine}, peer={theirs}"
            raise GeometryError.against(peer, code, detail, field=field, local=mine, theirs=theirs)


def matched_pairs(reg: RankRegistration, peer: RankRegistration) -> list[MatchedPair]:
    """Every matched view pair, checked in both directions so neither side has a view left unpaired."""
    pairs: list[MatchedPair] = []
    for view in reg.views:
        theirs = match_view(view, reg, peer)
        if theirs is not None:
            pairs.append((reg, view, peer, theirs))
    for theirs in peer.views:
        match_view(theirs, peer, reg)
    return pairs


def check_pair(
    local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> PairGeometry | StateGeometry:
    """One matched pair's geometry: KV heads and windows for block views, 2.10 for state views."""
    if view.is_state:
        return state_geometry(local, view, peer, theirs)
    return pair_geometry(local, view, peer, theirs)


def matched_geometries(
    reg: RankRegistration, peer: RankRegistration
) -> list[PairGeometry | StateGeometry]:
    return [check_pair(*pair) for pair in matched_pairs(reg, peer)]


# The peer checks in order; each raises the pair's first failure at its stage.
PEER_STAGES: tuple[Callable[[RankRegistration, RankRegistration], object], ...] = (
    check_identity,  # another model or KV format: its geometry is not worth comparing
    check_rank_fields,
    matched_pairs,
    matched_geometries,
)


def check_peers(reg: RankRegistration, peers: Sequence[RankRegistration]) -> None:
    ordered = sorted(peers, key=lambda p: (p.instance, p.rank))
    for stage in PEER_STAGES:
        for peer in ordered:
            stage(reg, peer)


def check_registration(
    candidate: RankRegistration,
    instance_ranks: Sequence[RankRegistration],
    peer_ranks: Sequence[RankRegistration],
) -> None:
    """Every check of docs/geometry.md "Rejected at the boundary", in its order; raises the first failure."""
    check_self(candidate)
    check_instance(candidate, instance_ranks)
    check_peers(candidate, [peer for peer in peer_ranks if peer.role is not candidate.role])
