"""The context x generation compatibility matrix of a deployment, for operators.

Registration already refuses a rank incompatible with the live peers it meets, but a deployment
can still hold pairs that would refuse each other: rows admitted before a rule existed (an older
kvroute), or ranks checked against peers that were expired at the time. The matrix re-runs the
boundary's peer check on the live registrations, every rank of a generation instance against all
ranks of a context instance, and names the first refusal. It reads the verdicts admission memoized
per pair of geometry classes (``geometry.classes``), and a cell's outcome is a function of the two
instances' *signatures* (each live rank's number and class), so it is computed once per pair of
signatures: a fleet of 256 identical instances checks one pair and fills 16,384 cells from it
(``kvroute.control.answers`` then keeps the rendering until the deployment's state changes). An
instance with missing or expired ranks is reported as incomplete: its pairs are not guessed at.

The instances' ranks need not be parsed registrations: a rank may be its class alone
(``store.registrations.RankClass``), given verdicts for its class pairs. Only a refused pair
re-runs a check on registrations, those of the ranks ``refusal_ranks`` names
(``control.matrix_reads`` reads exactly those).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute import wire
from kvroute.geometry import GeometryError, RankRegistration, check_peers, missing_ranks
from kvroute.geometry.checks.classes import (
    VerdictMemo,
    check_peers_by_class,
    memoized_verdict,
    representatives,
)
from kvroute.geometry.registration.domains import (
    DomainValue,
    PairingPolicy,
    instance_domains,
    required_exclusion,
    shared_domains,
)
from kvroute.store.registrations import RankSketch

NO_POLICY = PairingPolicy()
# Reads of the generations and documents before a matrix gives up on a deployment in churn.
MATRIX_READS = 5


Signature = tuple[tuple[int, str], ...]  # (rank, class digest) of each live rank, by rank


@dataclass(frozen=True, slots=True)
class InstanceRanks:
    name: str
    role: str
    expected_ranks: int
    live: tuple[RankSketch, ...]  # ordered by rank
    # Derived once: every cell of the instance's row or column reads them.
    missing_tuple: tuple[int, ...] = field(init=False, repr=False, compare=False)
    signature: Signature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        missing = missing_ranks(self.expected_ranks, (reg.rank for reg in self.live))
        object.__setattr__(self, "missing_tuple", tuple(missing))
        signature = tuple((reg.rank, reg.class_digest) for reg in self.live)
        object.__setattr__(self, "signature", signature)

    @property
    def missing(self) -> list[int]:
        return list(self.missing_tuple)

    @property
    def domains(self) -> dict[str, DomainValue]:
        topologies = [reg.topology for reg in self.live]
        if any(topology is None for topology in topologies):
            raise AssertionError(f"{self.name}: domains asked of ranks read without topology")
        return instance_domains(topology for topology in topologies if topology is not None)

    def summary(self) -> wire.CompatibilityInstance:
        return wire.CompatibilityInstance(
            instance=self.name,
            expected_ranks=self.expected_ranks,
            live_ranks=tuple(reg.rank for reg in self.live),
            missing_ranks=self.missing_tuple,
            complete=not self.missing_tuple,
        )


def _refusal(
    error: GeometryError,
    receiver: RankRegistration,
    context: InstanceRanks,
    senders: Sequence[RankRegistration],
) -> dict[str, Any]:
    context_rank = error.peer_rank
    if context_rank is None:
        # The stage that refused did not name its peer: find the first rank it refuses alone. A
        # check against one peer is judged on its face, so each rank is checked as the first rank
        # of its class (``senders``, parsed) rather than parsed itself.
        by_class = {sender.class_digest: sender for sender in senders}
        for sender in context.live:
            try:
                check_peers(receiver, [by_class[sender.class_digest]])
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


# A cell's outcome: the position in the generation instance's ``live`` of the first rank that
# refuses the context instance, None when none does. It is a function of the two instances'
# signatures (the verdicts are functions of class pairs; the representatives and the first
# failing receiver follow rank order), so a matrix computes it once per pair of signatures.
Outcome = int | None


def first_refusing(
    generation: InstanceRanks, senders: Sequence[RankSketch], memo: VerdictMemo
) -> Outcome:
    """Where ``check_peers_by_class`` would first raise for the generation's ranks in rank order."""
    passed: set[str] = set()
    for index, receiver in enumerate(generation.live):
        if receiver.class_digest in passed:
            continue
        if any(_verdict(memo, receiver, peer) is not None for peer in senders):
            return index
        passed.add(receiver.class_digest)
    return None


def _verdict(memo: VerdictMemo, receiver: RankSketch, peer: RankSketch) -> int | None:
    key = (receiver.class_digest, peer.class_digest)
    if key in memo:
        return memo[key]
    return memoized_verdict(memo, _parsed(receiver), _parsed(peer))


def _parsed(rank: RankSketch) -> RankRegistration:
    if not isinstance(rank, RankRegistration):
        raise AssertionError(f"{rank.instance} rank {rank.rank} was needed parsed but was not")
    return rank


def refusal_ranks(instances: Sequence[InstanceRanks], memo: VerdictMemo) -> set[tuple[str, int]]:
    """The (instance, rank) of every rank a refusal of the matrix re-runs its check on: the
    refusing generation rank and the context's class representatives, for every refused pair.

    ``memo`` must hold the verdict of every pair of classes of the two roles. Computed once per
    pair of instance signatures, as the matrix does.
    """
    contexts = _by_signature(item for item in instances if item.role == "context")
    generations = _by_signature(item for item in instances if item.role == "generation")
    named: set[tuple[str, int]] = set()
    for group in contexts:
        senders = representatives(group[0].live)
        for peers in generations:
            index = first_refusing(peers[0], senders, memo)
            if index is not None:
                # Instances of one signature have the same ranks of the same classes.
                named.update((g.name, g.live[index].rank) for g in peers)
                named.update((c.name, sender.rank) for c in group for sender in senders)
    return named


def _by_signature(instances: Iterable[InstanceRanks]) -> list[list[InstanceRanks]]:
    """The complete instances grouped by signature (incomplete ones have no verdict)."""
    groups: dict[Signature, list[InstanceRanks]] = {}
    for item in instances:
        if not item.missing_tuple:
            groups.setdefault(item.signature, []).append(item)
    return list(groups.values())


def pair_verdict(
    context: InstanceRanks,
    generation: InstanceRanks,
    senders: Sequence[RankSketch],
    memo: VerdictMemo,
    outcome: Outcome | Callable[[InstanceRanks, Sequence[RankSketch], VerdictMemo], Outcome] = (
        first_refusing
    ),
) -> wire.CompatibilityPair:
    """One cell of the matrix; ``local`` is the generation rank's value, ``peer`` the context's.

    ``senders`` are the context instance's class representatives; ``outcome`` the cell's outcome
    when known (a callable computes it, only for a complete pair).
    """
    names: dict[str, Any] = {"context": context.name, "generation": generation.name}
    if context.missing_tuple or generation.missing_tuple:
        incomplete = {
            side.name: side.missing for side in (context, generation) if side.missing_tuple
        }
        return wire.CompatibilityPair(
            **names, status="incomplete", compatible=None, missing_ranks=incomplete
        )
    index = outcome(generation, senders, memo) if callable(outcome) else outcome
    if index is None:
        return wire.CompatibilityPair(**names, status="compatible", compatible=True)
    receiver = _parsed(generation.live[index])
    parsed = [_parsed(sender) for sender in senders]
    try:
        check_peers_by_class(receiver, parsed, memo)  # the exact error, naming these instances
    except GeometryError as error:
        refusal = _refusal(error, receiver, context, parsed)
        return wire.CompatibilityPair(
            **names, status="incompatible", compatible=False, refusal=refusal
        )
    raise AssertionError(f"verdict memo disagrees with check_peers for {receiver.label()}")


def with_pairing(
    cell: wire.CompatibilityPair,
    policy: PairingPolicy,
    domains: tuple[dict[str, DomainValue], dict[str, DomainValue]],
) -> wire.CompatibilityPair:
    """The cell with its pairing under ``policy`` (none without one): allowed when compatible and
    within every required domain, the domains both share, and the topology exclusion if any."""
    if policy.empty:
        return cell
    mine, theirs = domains
    exclusion = required_exclusion(policy, (cell.generation, mine), (cell.context, theirs))
    pairing: dict[str, Any] = {
        "allowed": bool(cell.compatible) and exclusion is None,
        "shared_domains": shared_domains(mine, theirs),
    }
    if exclusion is not None:
        pairing["exclusion"] = exclusion
    return replace(cell, pairing=pairing)


def compatibility_matrix(
    deployment: str,
    instances: Sequence[InstanceRanks],
    memo: VerdictMemo,
    policy: PairingPolicy = NO_POLICY,
    *,
    only: str | None = None,
) -> wire.Compatibility:
    """The matrix, or with ``only`` the column of that one generation instance.

    Cells cost per pair of instance signatures, not per pair of ranks: a fleet of identical
    instances checks one pair of instances and copies the answer into every cell.
    """
    contexts = [item for item in instances if item.role == "context"]
    generations = [
        item for item in instances if item.role == "generation" and only in (None, item.name)
    ]
    domains = {item.name: item.domains for item in instances} if not policy.empty else {}
    # Signatures as small numbers: a cell then hashes two ints, not two tuples of 32 pairs.
    numbers: dict[Signature, int] = {}
    number = {item.name: numbers.setdefault(item.signature, len(numbers)) for item in instances}
    outcomes: dict[tuple[int, int], Outcome] = {}
    pairs = []
    for context in contexts:
        senders = representatives(context.live)
        for g in generations:
            key = (number[context.name], number[g.name])
            if key not in outcomes and not (context.missing_tuple or g.missing_tuple):
                outcomes[key] = first_refusing(g, senders, memo)
            cell = pair_verdict(context, g, senders, memo, outcomes.get(key))
            pairs.append(
                with_pairing(cell, policy, (domains.get(g.name, {}), domains.get(context.name, {})))
            )
    return wire.Compatibility(
        deployment=deployment,
        context=tuple(item.summary() for item in contexts),
        generation=tuple(item.summary() for item in generations),
        pairs=tuple(pairs),
    )
