"""View matching between a rank and a peer rank.

A view matches a peer view with the same role set (set equality), the same owner, the same slot axis
(per-token blocks or per-request state: a hybrid model may list one global layer id in both, so
matching stays within one axis) and overlapping layers. Where the peer is responsible for some of a
view's layers, exactly one peer view must carry them all; anything else would leave destination
bytes unwritten or written twice, so it is refused: missing, ambiguous ("overlaps several peer
views"), misplaced, or of another mapper kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.parts import View

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


def match_view(view: View, owner_rank: RankRegistration, peer: RankRegistration) -> View | None:
    """The peer view that carries ``view``'s layers, or None when the peer holds none of them."""
    needed = view.layer_ids & peer.held_layers(view.owner)
    if not needed:
        return None
    candidates = _candidates(view, peer)
    field = _field(owner_rank, view)
    if not candidates:
        what = f"{view.owner} {'state ' if view.is_state else ''}view"
        raise _match_error(
            "view_missing",
            f"{peer.label()} holds layers {_span(needed)} of {view.label()} but has no {what} "
            f"with roles {sorted(view.roles)} for them",
            field,
            view,
            None,
            peer,
        )
    if len(candidates) > 1:
        names = [theirs.view_id for theirs in candidates]
        raise _match_error(
            "view_ambiguous",
            f"{view.label()} overlaps several peer views {names} of {peer.label()}; "
            "one view must carry all the layers it shares with a peer rank",
            field,
            view,
            names,
            peer,
        )
    theirs = candidates[0]
    if theirs.kind is not view.kind:
        raise _match_error(
            "mapper_kind_mismatch",
            f"incompatible mapper kinds for roles {sorted(view.roles)}: local {view.label()} is "
            f"{view.kind}, peer view {theirs.view_id} of {peer.label()} is {theirs.kind}",
            f"{field}.kind",
            view,
            theirs.kind.value,
            peer,
            local=view.kind.value,
        )
    _check_placed(view, theirs, needed, field, peer)
    return theirs


def _candidates(view: View, peer: RankRegistration) -> list[View]:
    """Peer views of the same owner, slot axis and roles that share a layer with ``view``."""
    return [
        theirs
        for theirs in peer.views
        if theirs.owner is view.owner
        and theirs.axis is view.axis
        and theirs.roles == view.roles
        and theirs.layer_ids & view.layer_ids
    ]


def _check_placed(
    view: View, theirs: View, needed: frozenset[int], field: str, peer: RankRegistration
) -> None:
    """Every layer of ``view`` the peer holds is in its matching view."""
    stray = needed - theirs.layer_ids
    if stray:
        raise _match_error(
            "view_misplaced",
            f"{peer.label()} holds layers {_span(stray)} of {view.label()} outside its matching view "
            f"{theirs.view_id}, which carries layers {_span(theirs.layer_ids)}",
            f"{field}.layers",
            view,
            sorted(theirs.layer_ids),
            peer,
            local=sorted(stray),
        )


def _field(owner_rank: RankRegistration, view: View) -> str:
    index = next(i for i, candidate in enumerate(owner_rank.views) if candidate is view)
    return f"views[{index}]"


def _match_error(
    code: str,
    detail: str,
    field: str,
    view: View,
    peer_value: object,
    peer: RankRegistration,
    *,
    local: object = None,
) -> GeometryError:
    mine = local if local is not None else view.view_id
    return GeometryError.against(peer, code, detail, field=field, local=mine, theirs=peer_value)


def _span(layers: frozenset[int] | set[int]) -> str:
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"[{ordered[0]}..{ordered[-1]}]"
    return str(ordered)
