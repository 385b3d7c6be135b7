"""The context x generation compatibility matrix of a deployment, for operators.

Registration already refuses a rank incompatible with the live peers it meets, but a deployment
can still hold pairs that would refuse each other: rows admitted before a rule existed (an older
kvroute), or ranks checked against peers that were expired at the time. The matrix re-runs the
boundary's peer check on the live registrations, every rank of a generation instance against all
ranks of a context instance, and names the first refusal. It reads the verdicts admission memoized
per pair of geometry classes (``geometry.classes``), so a fleet of identical instances costs a few
dictionary lookups per pair. An instance with
missing or expired ranks is reported as incomplete: its pairs are not guessed at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvroute import wire
from kvroute.geometry import GeometryError, RankRegistration, check_peers
from kvroute.geometry.classes import VerdictMemo, check_peers_by_class, representatives
from kvroute.store.engine import SessionMaker
from kvroute.store.registrations import RegistrationCache, RegistrationMoved
from kvroute.store.snapshots import deployment_states

# Reads of the generations and documents before a matrix gives up on a deployment in churn.
MATRIX_READS = 5


@dataclass(frozen=True, slots=True)
class InstanceRanks:
    name: str
    role: str
    expected_ranks: int
    live: tuple[RankRegistration, ...]  # ordered by rank

    @property
    def missing(self) -> list[int]:
        return sorted(set(range(self.expected_ranks)) - {reg.rank for reg in self.live})

    def summary(self) -> wire.CompatibilityInstance:
        return wire.CompatibilityInstance(
            instance=self.name,
            expected_ranks=self.expected_ranks,
            live_ranks=tuple(reg.rank for reg in self.live),
            missing_ranks=tuple(self.missing),
            complete=not self.missing,
        )


def _refusal(
    error: GeometryError, receiver: RankRegistration, senders: Sequence[RankRegistration]
) -> dict[str, Any]:
    context_rank = error.peer_rank
    if context_rank is None:
        # The stage that refused did not name its peer: find the first rank it refuses alone.
        for sender in senders:
            try:
                check_peers(receiver, [sender])
            except GeometryError as alone:
                if alone.code == error.code:
                    context_rank = sender.rank
                    break
    return {
        "code": error.code,
        "field": error.field,
        "detail": error.detail,
        "local": error.local,
        "peer": error.peer,
        "generation_rank": receiver.rank,
        "context_rank": context_rank,
    }


def pair_verdict(
    context: InstanceRanks,
    generation: InstanceRanks,
    senders: Sequence[RankRegistration],
    memo: VerdictMemo,
) -> wire.CompatibilityPair:
    """One cell of the matrix; ``local`` is the generation rank's value, ``peer`` the context's.

    ``senders`` are the context instance's class representatives; a receiver whose class already
    passed needs no second look.
    """
    names = {"context": context.name, "generation": generation.name}
    incomplete = {side.name: side.missing for side in (context, generation) if side.missing}
    if incomplete:
        return wire.CompatibilityPair(
            **names, status="incomplete", compatible=None, missing_ranks=incomplete
        )
    passed: set[str] = set()
    for receiver in generation.live:
        if receiver.class_digest in passed:
            continue
        try:
            check_peers_by_class(receiver, senders, memo)
        except GeometryError as error:
            refusal = _refusal(error, receiver, context.live)
            return wire.CompatibilityPair(
                **names, status="incompatible", compatible=False, refusal=refusal
            )
        passed.add(receiver.class_digest)
    return wire.CompatibilityPair(**names, status="compatible", compatible=True)


def compatibility_matrix(
    deployment: str, instances: Sequence[InstanceRanks], memo: VerdictMemo
) -> wire.Compatibility:
    contexts = [item for item in instances if item.role == "context"]
    generations = [item for item in instances if item.role == "generation"]
    pairs = []
    for context in contexts:
        senders = representatives(context.live)
        pairs += [pair_verdict(context, g, senders, memo) for g in generations]
    return wire.Compatibility(
        deployment=deployment,
        context=tuple(item.summary() for item in contexts),
        generation=tuple(item.summary() for item in generations),
        pairs=tuple(pairs),
    )


async def deployment_matrix(
    sessionmaker: SessionMaker,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
    deployment: str,
    *,
    now: datetime,
) -> wire.Compatibility:
    """The matrix of the deployment's live registrations; ``NotFound`` for an unknown one."""
    for attempt in range(1, MATRIX_READS + 1):
        states = await deployment_states(sessionmaker, deployment, now=now)
        wanted = [(s.instance, rank, gen) for s in states for rank, gen in s.live.items()]
        try:
            live = await registrations.at(deployment, wanted)
            break
        except RegistrationMoved:
            # A rank re-registered between the two reads: a read-only view just reads again.
            if attempt == MATRIX_READS:
                raise
    instances = [
        InstanceRanks(
            state.instance,
            state.role,
            state.expected_ranks,
            tuple(reg for reg in live if reg.instance == state.instance),
        )
        for state in states
    ]
    # On the event loop: verdicts are memoized per pair of geometry classes (shared with
    # admission, which runs here too), so only a class pair never seen before costs a check.
    return compatibility_matrix(deployment, instances, verdicts)
