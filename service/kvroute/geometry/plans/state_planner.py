"""Planning one receiver state view: which sender rank writes which bytes of the request's slot.

The sender ranks heard from are those the receiver overlaps in TP position (the mamba-TP pairing,
see ``state``). For every layer, ranks holding identical state bytes form a group and exactly one of
them, elected as for KV views, writes it (docs/geometry.md rule 3): a sharded SSM or conv section has one
holder per layer in the sender's DP group, replicated state has one per TP rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.geometry.checks.matching import match_view
from kvroute.geometry.checks.pairs import duplication
from kvroute.geometry.checks.state import StateGeometry, shard, state_fragments, state_geometry
from kvroute.geometry.plans.mappers import coalesce
from kvroute.geometry.plans.plan import StateTransfer
from kvroute.geometry.plans.topology import elect
from kvroute.geometry.registration.model import RankRegistration, View


@dataclass
class _StateSource:
    sender: RankRegistration
    view: View
    geometry: StateGeometry
    assigned: list[int] = field(default_factory=list)

    @property
    def key(self) -> int:
        """Ranks with equal keys hold identical bytes: all of them for replicated state."""
        return 0 if self.geometry.mapper == "replicated" else self.sender.state_rank


def plan_state_view(
    view: View, candidates: Sequence[RankRegistration], receiver: RankRegistration
) -> tuple[list[int], list[tuple[int, StateTransfer]]]:
    """(ranks heard from, (sender rank, transfer) for every rank that writes) for one state view."""
    sources = []
    for sender in candidates:
        theirs = match_view(view, receiver, sender)
        if theirs is not None:
            geometry = state_geometry(sender, theirs, receiver, view)
            sources.append(_StateSource(sender, theirs, geometry))
    for layer in sorted(view.layer_ids):
        groups: dict[int, list[_StateSource]] = defaultdict(list)
        for source in sources:
            if layer in source.view.layer_ids:
                groups[source.key].append(source)
        for group in groups.values():
            winner = elect([source.sender for source in group], receiver)
            next(s for s in group if s.sender is winner).assigned.append(layer)
    heard = [source.sender.rank for source in sources]
    transfers = [
        (source.sender.rank, _transfer(source, view, receiver))
        for source in sources
        if source.assigned
    ]
    return heard, transfers


def _transfer(source: _StateSource, view: View, receiver: RankRegistration) -> StateTransfer:
    sender, theirs, geometry = source.sender, source.view, source.geometry
    fragments = state_fragments(sender, theirs, receiver, view, geometry, source.assigned)
    tps = ((sender.state_tp, sender.state_rank), (receiver.state_tp, receiver.state_rank))
    if geometry.mapper == "replicated":
        dup = duplication(1, sender.state_tp, 1, receiver.state_tp)
        unit, total, src, dst = "whole", 1, (0, 1), (0, 1)
    else:
        # Sharded state adds up to the same model on both sides (checked), so nothing is duplicated.
        dup = (1, 1)
        unit = "head" if geometry.mapper == "ssm" else "part"
        total = geometry.total_units(sender.state_tp, receiver.state_tp)
        src, mine = shard(sender, total), shard(receiver, total)
        dst = (max(src[0], mine[0]), min(src[1], mine[1]))
    return StateTransfer(
        **StateTransfer.members_between(
            theirs, view, geometry.mapper, dup, coalesce(fragments), source.assigned
        ),
        mamba_tp=tps,
        shard_unit=unit,
        shard_total=total,
        src_shard=src,
        dst_shard=dst,
    )
