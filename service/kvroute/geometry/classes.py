"""Geometry classes: admission against peer classes instead of every peer rank.

Ranks of one PP stage of an instance register documents that differ only in their TP position
(``tp_rank``, ``dp_rank``), their rank number, their memory and endpoints. None of these reaches a
peer check: the checks read head counts, byte sizes, layouts and the layers a rank holds (its PP
stage), never which TP slot it sits in. So such ranks form one *class* (``class_digest``) and get
the same verdict against any rank of another class: a verdict is a pure function of the pair of
class digests and can be memoized forever.

``check_peers_by_class`` gives exactly ``check_peers``' answer (the same error, naming the same
first failing peer instance and rank) from one representative per peer class: the first rank of
the class in (instance, rank) order. ``check_peers`` raises at the first peer, in that order,
failing the earliest stage any peer fails; that peer is the first representative among the classes
whose verdict is that stage, and re-running the check on it alone yields the identical error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, MutableMapping, Sequence

from kvroute.geometry.compat import PEER_STAGES, check_peers
from kvroute.geometry.document import render_registration
from kvroute.geometry.errors import GeometryError
from kvroute.geometry.model import RankRegistration

# Position within the instance: kept out of the class. pp_rank stays in, since it decides which
# target layers a rank holds (view matching reads them even for a rank that registers no views).
_POSITION = ("tp_rank", "dp_rank")

Verdict = int | None  # index of the first peer stage the pair fails, None when compatible
VerdictMemo = MutableMapping[tuple[str, str], Verdict]


def class_digest(reg: RankRegistration) -> str:
    """sha256 of the geometry a peer check can see: the document less position, memory, lease."""
    doc = render_registration(reg, geometry_only=True)
    for name in _POSITION:
        doc.pop(name)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def peer_verdict(reg: RankRegistration, peer: RankRegistration) -> Verdict:
    """The first peer stage at which ``reg`` refuses ``peer``; None when the pair is compatible."""
    for index, stage in enumerate(PEER_STAGES):
        try:
            stage(reg, peer)
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


def representatives(peers: Sequence[RankRegistration]) -> list[RankRegistration]:
    """The first peer of each class in (instance, rank) order: what the store reads for admission."""
    first: dict[str, RankRegistration] = {}
    for peer in sorted(peers, key=lambda p: (p.instance, p.rank)):
        first.setdefault(peer.class_digest, peer)
    return list(first.values())
