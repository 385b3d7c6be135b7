"""The geometry of one matched view pair: which mapper moves it and in what byte units.

Computed from the pair's own head counts (DESIGN.md rule 2), never from a rank-wide count: a cache
that holds target layers with 8 KV heads and draft layers with 1 gets a different answer per view.
Compatibility checks and the planner share this one definition, so whatever registration admits the
planner can move, and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.geometry.errors import GeometryError
from kvroute.geometry.heads import pair_total
from kvroute.geometry.model import Kind, RankRegistration, View
from kvroute.geometry.window import Window, pair_window


@dataclass(frozen=True, slots=True)
class PairGeometry:
    mapper: str  # "replicated" | "intact" | "hnd" | "nhd"
    total_heads: int  # head total the pair is planned with (1 for replicated views)
    local_heads: int
    peer_heads: int
    unit: int  # bytes per head (hnd), per token-head (nhd), per layer (intact, replicated)
    tokens: int
    window: Window | None = None  # the sliding window the pair moves; None: every block

    @property
    def slices_heads(self) -> bool:
        return self.mapper in ("hnd", "nhd")


def duplication(local_heads: int, local_tp: int, peer_heads: int, peer_tp: int) -> tuple[int, int]:
    """(duplicate_head_factor, peer_duplicate_head_factor): head slots on one side per slot on the other."""
    local_slots, peer_slots = local_heads * local_tp, peer_heads * peer_tp
    return max(1, local_slots // peer_slots), max(1, peer_slots // local_slots)


def pair_geometry(
    local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> PairGeometry:
    """Checks one matched pair and describes how it moves; raises on any mismatch."""
    fail = PairFailer(local, view, peer)
    if view.buffers_per_layer != theirs.buffers_per_layer:
        raise fail(
            "buffers_mismatch",
            "buffers_per_layer",
            view.buffers_per_layer,
            theirs.buffers_per_layer,
        )
    if view.dtype and theirs.dtype and view.dtype != theirs.dtype:
        raise fail("view_dtype_mismatch", "dtype", view.dtype, theirs.dtype)
    window = pair_window(local, view, peer, theirs)
    if view.kind is Kind.REPLICATED:
        if view.bytes_per_layer != theirs.bytes_per_layer:
            raise fail(
                "bytes_per_layer_mismatch",
                "bytes_per_layer",
                view.bytes_per_layer,
                theirs.bytes_per_layer,
            )
        return PairGeometry("replicated", 1, 1, 1, view.bytes_per_layer, local.tokens(view), window)
    local_heads, peer_heads = local.heads(view), peer.heads(theirs)
    total = pair_total(
        local_heads,
        local.tp_per_dp,
        view.total_kv_heads,
        peer_heads,
        peer.tp_per_dp,
        theirs.total_kv_heads,
    )
    if total.total is None:
        both_declared = view.total_kv_heads and theirs.total_kv_heads
        code = "total_kv_heads_mismatch" if both_declared else "head_count_mismatch"
        field = "total_kv_heads" if both_declared else "num_kv_heads"
        local_value = view.total_kv_heads if both_declared else local_heads
        peer_value = theirs.total_kv_heads if both_declared else peer_heads
        raise fail(code, field, local_value, peer_value, reason=total.problem)
    tokens, peer_tokens = local.tokens(view), peer.tokens(theirs)
    if view.kind is Kind.NHD and tokens != peer_tokens:
        raise fail("tokens_per_block_mismatch", "tokens_per_block", tokens, peer_tokens)
    if local_heads == peer_heads:
        if view.bytes_per_layer != theirs.bytes_per_layer:
            raise fail(
                "bytes_per_layer_mismatch",
                "bytes_per_layer",
                view.bytes_per_layer,
                theirs.bytes_per_layer,
            )
        return PairGeometry(
            "intact", total.total, local_heads, peer_heads, view.bytes_per_layer, tokens, window
        )
    unit = _head_unit(view, local_heads, tokens)
    peer_unit = _head_unit(theirs, peer_heads, peer_tokens)
    if unit != peer_unit:
        what = "bytes per token-head" if view.kind is Kind.NHD else "bytes per head"
        raise fail(
            "bytes_per_head_mismatch",
            "bytes_per_layer",
            unit,
            peer_unit,
            reason=f"{view.kind} {what} mismatch: local={unit}, peer={peer_unit} "
            f"(local heads={local_heads}, peer heads={peer_heads})",
        )
    return PairGeometry(view.kind.value, total.total, local_heads, peer_heads, unit, tokens, window)


def _head_unit(view: View, heads: int, tokens: int) -> int:
    # Exact by construction: check_self refused any view whose bytes do not divide this way.
    per = view.buffers_per_layer * heads * (tokens if view.kind is Kind.NHD else 1)
    return view.bytes_per_layer // per


class PairFailer:
    """Builds pair errors that name both views, both values and the peer rank."""

    def __init__(self, local: RankRegistration, view: View, peer: RankRegistration) -> None:
        self.local, self.view, self.peer = local, view, peer

    def __call__(
        self, code: str, attribute: str, mine: object, theirs: object, *, reason: str | None = None
    ) -> GeometryError:
        index = next(i for i, view in enumerate(self.local.views) if view is self.view)
        detail = reason or f"{attribute} differs: local={mine}, peer={theirs}"
        return GeometryError(
            code,
            f"{self.view.label()} of {self.local.label()} vs {self.peer.label()}: {detail}",
            field=f"views[{index}].{attribute}",
            local=mine,
            peer=theirs,
            stage="peer",
            peer_instance=self.peer.instance,
            peer_rank=self.peer.rank,
        )
