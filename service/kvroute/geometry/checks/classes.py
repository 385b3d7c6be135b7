"""Geometry classes: admission against peer classes instead of every peer rank.

A rank's *class* (``faces.class_digest``) is the digest of its face (``faces``): what peer checks can
read of it. Ranks of one PP stage of an instance share it, and so do ranks of any instance with the
same geometry laid out differently inside their slots (offsets, gaps, padded strides, view and pool
ids), as fleets of mixed engine versions and allocators register. Verdicts are computed on faces,
so a verdict is a pure function of the pair of class digests and can be memoized forever. Plans do
depend on the layout: nothing that builds plans or fragments is keyed by class
(``RankRegistration.geometry_digest`` keys plan fingerprints).

``check_peers_by_class`` gives exactly ``check_peers``' answer (the same error, naming the same
first failing peer instance and rank) from one representative per peer class: the first rank of
the class in (instance, rank) order. ``check_peers`` raises at the first peer, in that order,
failing the earliest stage any peer fails; that peer is the first representative among the classes
whose verdict is that stage, and re-running the check on it alone yields the identical error.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvroute.geometry.checks.compat import PEER_STAGES, check_peers
from kvroute.geometry.leaves.errors import GeometryError, Ranked
from kvroute.geometry.registration.faces import rank_face

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration


Verdict = int | None  # index of the first peer stage the pair fails, None when compatible
VerdictMemo = MutableMapping[tuple[str, str], Verdict]


def peer_verdict(reg: RankRegistration, peer: RankRegistration) -> Verdict:
    """The first peer stage at which ``reg`` refuses ``peer``; None when the pair is compatible.

    Judged on the two faces, so the verdict is a function of the two class digests by construction.
    """
    mine, theirs = rank_face(reg), rank_face(peer)
    for index, stage in enumerate(PEER_STAGES):
        try:
            stage(mine, theirs)  # type: ignore[arg-type]  # a face is the checks' duck type
        except GeometryError:
            return index
    return None


def memoized_verdict(memo: VerdictMemo, reg: RankRegistration, peer: RankRegistration) -> Verdict:
    key = (reg.class_digest, peer.class_digest)
    if key not in memo:
        memo[key] = peer_verdict(reg, peer)
    return memo[key]


def check_peers_by_class(
    reg: RankRegistration,
    representatives: Sequence[RankRegistration],
    memo: VerdictMemo,
    *,
    verdict: Callable[[VerdictMemo, RankRegistration, RankRegistration], Verdict] = (
        memoized_verdict
    ),
) -> None:
    """``check_peers(reg, all peers)`` from the first peer of each class present among them."""
    failing = [
        (stage, (peer.instance, peer.rank), peer)
        for peer in representatives
        if (stage := verdict(memo, reg, peer)) is not None
    ]
    if failing:
        _, _, first = min(failing, key=lambda item: (item[0], item[1]))
        check_peers(reg, [first])  # raises the exact error check_peers would have raised
        raise AssertionError(f"verdict memo disagrees with check_peers for {first.label()}")


class Classed(Ranked, Protocol):
    """A rank as far as its class goes: a registration, or the class its row records."""

    @property
    def class_digest(self) -> str: ...


AnyRank = TypeVar("AnyRank", bound=Classed)


def representatives(peers: Sequence[AnyRank]) -> list[AnyRank]:
    """The first peer of each class in (instance, rank) order: what the store reads for admission."""
    first: dict[str, AnyRank] = {}
    for peer in sorted(peers, key=lambda p: (p.instance, p.rank)):
        first.setdefault(peer.class_digest, peer)
    return list(first.values())
