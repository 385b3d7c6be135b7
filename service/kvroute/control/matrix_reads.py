"""What a whole-deployment answer (the matrix, the pairs answer) reads before its first cell,
parsing as few documents as it can.

A replica that holds no parsed registration (just started, or its cache holds part of the fleet)
used to read and parse every live rank's document: at 512 instances, 8,192 documents parsed and
digested, most of its first matrix. A cell needs far less. Its outcome is a function of the two
instances' signatures, each live rank's class, which admission wrote to the rank's row; the
verdicts are functions of class pairs, judged once per class on one parsed registration of it; and
only a refused pair re-runs a check on registrations, of the ranks ``refusal_ranks`` names. The
pairs answer, and a matrix under a pairing policy, also read each rank's topology, which the
database extracts from the document.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from kvroute.control.compatibility import InstanceRanks, refusal_ranks
from kvroute.geometry import RankRegistration
from kvroute.geometry.checks.classes import VerdictMemo, memoized_verdict
from kvroute.store.registrations import RankSketch, RegistrationCache
from kvroute.store.snapshots import InstanceState

RankKey = tuple[str, int]  # instance, rank


async def matrix_inputs(
    registrations: RegistrationCache,
    deployment: str,
    states: Sequence[InstanceState],
    verdicts: VerdictMemo,
    *,
    topology: bool,
) -> tuple[list[InstanceRanks], VerdictMemo]:
    """The instances with their live ranks at the generations ``states`` saw, and the verdict of
    every pair of their classes (a dict of the answer's own: ``verdicts`` may evict meanwhile).

    A rank is parsed when this process already holds it, is the first of its class, or is named by
    a refusal; otherwise it is its class (with ``topology``, and its topology). Raises
    ``RegistrationMoved`` when a rank has moved on since ``states``.
    """
    generations = {(s.instance, rank): gen for s in states for rank, gen in s.live.items()}
    wanted = [(instance, rank, gen) for (instance, rank), gen in generations.items()]
    sketches = iter(await registrations.classes_at(deployment, wanted, topology=topology))
    # ``wanted`` lists each instance's ranks together, in rank order: cut the answer the same way.
    instances = [
        InstanceRanks(
            state.instance,
            state.role,
            state.expected_ranks,
            tuple(next(sketches) for _ in state.live),
        )
        for state in states
    ]
    memo = await _class_verdicts(registrations, deployment, instances, verdicts, generations)
    named = await _parse(registrations, deployment, refusal_ranks(instances, memo), generations)
    return [_with_parsed(item, named) for item in instances], memo


async def _class_verdicts(
    registrations: RegistrationCache,
    deployment: str,
    instances: Sequence[InstanceRanks],
    verdicts: VerdictMemo,
    generations: Mapping[RankKey, int],
) -> VerdictMemo:
    """The verdict of every (generation class, context class) pair, judged on one registration of
    each class: one already parsed, else the class's first rank in (instance, rank) order."""
    first: dict[str, RankSketch] = {}
    roles: dict[str, set[str]] = {"context": set(), "generation": set()}
    for item in instances:  # by name, each in rank order
        for rank in item.live:
            roles[item.role].add(rank.class_digest)
            known = first.get(rank.class_digest)
            if known is None or (isinstance(rank, RankRegistration) and not _is_parsed(known)):
                first[rank.class_digest] = rank
    unparsed = [(rank.instance, rank.rank) for rank in first.values() if not _is_parsed(rank)]
    parsed = await _parse(registrations, deployment, unparsed, generations)
    samples = {
        digest: rank if isinstance(rank, RankRegistration) else parsed[rank.instance, rank.rank]
        for digest, rank in first.items()
    }
    return {
        (mine, theirs): memoized_verdict(verdicts, samples[mine], samples[theirs])
        for mine in roles["generation"]
        for theirs in roles["context"]
    }


def _is_parsed(rank: RankSketch) -> bool:
    return isinstance(rank, RankRegistration)


async def _parse(
    registrations: RegistrationCache,
    deployment: str,
    keys: Iterable[RankKey],
    generations: Mapping[RankKey, int],
) -> dict[RankKey, RankRegistration]:
    wanted = [(instance, rank, generations[instance, rank]) for instance, rank in sorted(keys)]
    return {reg.key: reg for reg in await registrations.at(deployment, wanted)}


def _with_parsed(item: InstanceRanks, parsed: Mapping[RankKey, RankRegistration]) -> InstanceRanks:
    if not any((item.name, rank.rank) in parsed for rank in item.live):
        return item
    return replace(item, live=tuple(parsed.get((item.name, r.rank), r) for r in item.live))
