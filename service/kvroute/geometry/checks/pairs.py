"""The geometry of one matched view pair: which mapper moves it and in what byte units.

Computed from the pair's own head counts (docs/geometry.md rule 2), never from a rank-wide count: a cache
that holds target layers with 8 KV heads and draft layers with 1 gets a different answer per view.
Compatibility checks and the planner share this one definition, so whatever registration admits the
planner can move, and vice versa. Two sides with different tokens per block are compared per token:
a block of either side is then just a cut of the same token rows (see ``periods``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.heads import pair_total
from kvroute.geometry.leaves.parts import Kind, Role, Tiling, View
from kvroute.geometry.tokens.window import Window

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


@dataclass(frozen=True, slots=True)
class PairGeometry:
    mapper: str  # "replicated" | "intact" | "hnd" | "nhd"
    total_heads: int  # head total the pair is planned with (1 for replicated views)
    local_heads: int
    peer_heads: int
    # bytes per head (hnd), per token-head (nhd and any re-blocked sliced pair), per layer (intact,
    # replicated; the local side's layer when the two sides' blocks differ)
    unit: int
    tokens: int  # tokens per block on the local side
    peer_tokens: int
    token_unit: int  # bytes per token-head (per token for replicated); 0 when not exact
    window: Window | None = None  # the sliding window the pair moves; None: every token
    context_parallel: bool = False  # either side spreads tokens over CP ranks
    interiors_differ: bool = False  # the two sides tile a head's tokens differently (``Interior``)

    @property
    def reblocks(self) -> bool:
        """True when a block of one side is not a block of the other: different block sizes,
        tokens spread over CP ranks, or tokens placed differently inside a block (a pair then
        moves by period, never by block pair)."""
        return self.peer_tokens != self.tokens or self.context_parallel or self.interiors_differ

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
    """Checks one matched pair and describes how it moves; raises on any mismatch.

    Different tokens per block on the two sides are compatible: the pair is then compared in
    bytes per token(-head), which must be exact on both sides (``tokens_per_block_mismatch``
    otherwise, the one re-blocking refusal left) and equal.
    """
    fail = PairFailer(local, view, peer)
    fail.unless_same(theirs, "buffers_per_layer", "buffers_mismatch")
    if view.dtype and theirs.dtype and view.dtype != theirs.dtype:
        raise fail("view_dtype_mismatch", "dtype", view.dtype, theirs.dtype)
    tokens, peer_tokens = local.tokens(view), peer.tokens(theirs)
    window = pair_window(local, view, peer, theirs)
    cp = local.cp_size > 1 or peer.cp_size > 1
    if view.kind is Kind.REPLICATED:
        token_unit = _token_units(
            fail, view, 1, tokens, theirs, 1, peer_tokens, same_heads=True, recut=cp
        )
        _check_same_bytes(fail, view, theirs, tokens, peer_tokens)
        return PairGeometry(
            "replicated", 1, 1, 1, view.bytes_per_layer, tokens, peer_tokens, token_unit, window, cp
        )
    local_heads, peer_heads = local.heads(view), peer.heads(theirs)
    total = _head_total(fail, local, view, peer, theirs)
    same = local_heads == peer_heads
    differ = view.interior != theirs.interior
    token_unit = _token_units(
        fail,
        view,
        local_heads,
        tokens,
        theirs,
        peer_heads,
        peer_tokens,
        same_heads=same,
        recut=cp or differ,
    )
    if differ:
        _check_interiors(fail, view, theirs, token_unit)
        return PairGeometry(
            view.kind.value, total, local_heads, peer_heads, token_unit, tokens, peer_tokens,
            token_unit, window, cp, interiors_differ=True,
        )  # fmt: skip
    if same:
        _check_same_bytes(fail, view, theirs, tokens, peer_tokens)
        unit, mapper = view.bytes_per_layer, "intact"
    elif tokens != peer_tokens or cp:
        unit, mapper = token_unit, view.kind.value  # re-cut: only bytes per token-head matter
    else:
        unit, mapper = _sliced_unit(fail, view, local_heads, theirs, peer_heads, tokens)
    return PairGeometry(
        mapper, total, local_heads, peer_heads, unit, tokens, peer_tokens, token_unit, window, cp
    )


def _check_interiors(fail: PairFailer, view: View, theirs: View, row: int) -> None:
    """Differently tiled sides re-cut rows into pieces both hold whole: planes of a common
    refinement, which must divide a row; a packed token group has no such pieces, so it pairs only
    with the same tiling."""
    local = _tilings(view)
    peer = _tilings(theirs)
    for index, (mine, their) in enumerate(zip(local, peer, strict=True)):
        grouped = mine.token_group > 1 or their.token_group > 1
        if (grouped and mine != their) or row % math.lcm(mine.planes, their.planes):
            raise fail(
                "interior_mismatch",
                "interior",
                _interior_json(view),
                _interior_json(theirs),
                reason=f"buffer {index} is tiled {mine.to_json()} here and {their.to_json()} on "
                f"the peer; a {row}-byte token row cannot be moved between them",
            )


def _tilings(view: View) -> tuple[Tiling, ...]:
    if view.interior is None:
        return (Tiling(),) * view.buffers_per_layer
    return view.interior.tilings


def _interior_json(view: View) -> object:
    return view.interior.to_json() if view.interior is not None else None


def _head_total(
    fail: PairFailer, local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> int:
    """The head total the pair is planned with (rule 1); raises when no total fits both sides."""
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
    return total.total


def _check_same_bytes(
    fail: PairFailer, view: View, theirs: View, tokens: int, peer_tokens: int
) -> None:
    """Equal heads and equal blocks move whole layer regions, which must be the same size."""
    if tokens == peer_tokens:
        fail.unless_same(theirs, "bytes_per_layer", "bytes_per_layer_mismatch")


def _sliced_unit(
    fail: PairFailer, view: View, heads: int, theirs: View, peer_heads: int, tokens: int
) -> tuple[int, str]:
    unit, peer_unit = _head_unit(view, heads, tokens), _head_unit(theirs, peer_heads, tokens)
    if unit != peer_unit:
        what = "bytes per token-head" if view.kind is Kind.NHD else "bytes per head"
        raise fail(
            "bytes_per_head_mismatch",
            "bytes_per_layer",
            unit,
            peer_unit,
            reason=f"{view.kind} {what} mismatch: local={unit}, peer={peer_unit} "
            f"(local heads={heads}, peer heads={peer_heads})",
        )
    return unit, view.kind.value


def _token_units(
    fail: PairFailer,
    view: View,
    heads: int,
    tokens: int,
    theirs: View,
    peer_heads: int,
    peer_tokens: int,
    *,
    same_heads: bool,
    recut: bool = False,
) -> int:
    """Bytes per token-head of the pair (0 when not exact and both sides cut blocks alike).

    With equal block sizes and no context parallelism nothing is re-cut and today's checks stand,
    so an inexact division only means a mid-block token range cannot be cut from this pair. With
    different sizes or tokens spread over CP ranks (``recut``) both sides must divide exactly into
    token rows, and the rows must be the same size.
    """
    unit = _token_unit(view, heads, tokens)
    if tokens == peer_tokens and not recut:
        return unit or 0
    peer_unit = _token_unit(theirs, peer_heads, peer_tokens)
    for side_unit, side_view, side_heads, side_tokens in (
        (unit, view, heads, tokens),
        (peer_unit, theirs, peer_heads, peer_tokens),
    ):
        if side_unit is None:
            raise fail(
                "tokens_per_block_mismatch",
                "tokens_per_block",
                tokens,
                peer_tokens,
                reason=f"tokens are re-cut (tokens_per_block local={tokens}, peer={peer_tokens}, "
                "or context parallelism on a side) and "
                f"view {side_view.view_id}'s bytes_per_layer {side_view.bytes_per_layer} is not a "
                f"whole number of token rows ({side_view.buffers_per_layer} buffers x "
                f"{side_heads} heads x {side_tokens} tokens), so its blocks cannot be re-cut",
            )
    if unit != peer_unit:
        what = "token" if same_heads else "token-head"
        raise fail(
            "bytes_per_layer_mismatch" if same_heads else "bytes_per_head_mismatch",
            "bytes_per_layer",
            unit,
            peer_unit,
            reason=f"bytes per {what} mismatch: local={unit}, peer={peer_unit} (local "
            f"{tokens} tokens x {heads} heads per block, peer {peer_tokens} x {peer_heads})",
        )
    assert unit is not None
    return unit


def _token_unit(view: View, heads: int, tokens: int) -> int | None:
    per = view.buffers_per_layer * heads * tokens
    return view.bytes_per_layer // per if view.bytes_per_layer % per == 0 else None


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
        return GeometryError.against(
            self.peer,
            code,
            f"{self.view.label()} of {self.local.label()} vs {self.peer.label()}: {detail}",
            field=f"views[{index}].{attribute}",
            local=mine,
            theirs=theirs,
        )

    def unless_same(
        self, theirs: View, attribute: str, code: str, *, reason: str | None = None
    ) -> None:
        """Raises ``code`` naming both values when the two views' ``attribute`` differ."""
        mine, other = getattr(self.view, attribute), getattr(theirs, attribute)
        if mine != other:
            raise self(code, attribute, mine, other, reason=reason)


def pair_window(
    local: RankRegistration, view: View, peer: RankRegistration, theirs: View
) -> Window | None:
    """The window of a matched block-view pair, or None when neither side is windowed."""
    if view.sliding_window is None and theirs.sliding_window is None:
        return None
    mine, other = (
        (view.sliding_window, local.tokens(view)),
        (theirs.sliding_window, peer.tokens(theirs)),
    )
    (sender, src_tokens), (receiver, dst_tokens) = (
        (mine, other) if local.role is Role.CONTEXT else (other, mine)
    )
    if receiver is None:
        index = next(i for i, candidate in enumerate(local.views) if candidate is view)
        raise GeometryError.against(
            peer,
            "sliding_window_mismatch",
            f"{view.label()} of {local.label()} vs {peer.label()}: the context side keeps only the "
            f"last {sender} tokens of these layers (sliding_window={sender}) but the generation "
            "side attends over all of them (no sliding_window); the stale blocks never arrive",
            field=f"views[{index}].sliding_window",
            local=view.sliding_window,
            theirs=theirs.sliding_window,
        )
    tokens = receiver if sender is None else min(sender, receiver)
    return Window(tokens, sender, receiver, src_tokens, dst_tokens)
