"""Read answers computed from a deployment's whole live state (the compatibility matrix, the pairs
answer), rendered once and kept until that state changes.

At fleet scale such an answer is tens of thousands of cells (256 instances: 16,384 pairs, 1.5 MB of
JSON), so each call first reads what the answer is a function of and reuses the last rendering when
that is unchanged. The key is the answer's whole input, not a revision number that every writer
would have to remember to move: each instance's role and expected ranks, the generation of each
live rank (a generation is never reused, not even after a delete, so it names one immutable
document) and the pairing policy. Leases are judged as the answer itself judges them, so a rank
whose lease ends leaves the key at the next call, whether or not the reaper has noted it yet;
renewals change nothing an answer shows and keep the key. Verdicts, the other input, are pure
functions of class pairs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from cachetools import LRUCache

from kvroute import wire
from kvroute.control.compatibility import MATRIX_READS, InstanceRanks, compatibility_matrix
from kvroute.control.matrix_reads import matrix_inputs
from kvroute.geometry.checks.classes import VerdictMemo
from kvroute.geometry.registration.domains import PairingPolicy
from kvroute.store.engine import SessionMaker
from kvroute.store.pairing import pairing_policy
from kvroute.store.registrations import RegistrationCache, RegistrationMoved
from kvroute.store.snapshots import InstanceState, deployment_states

ANSWERS = 64  # (kind, deployment, filter) entries: a few deployments' matrices and pairs answers


@dataclass(frozen=True, slots=True)
class Rendered:
    """An answer as the JSON body that serves it. Only the bytes are kept: a matrix's document is
    some 100,000 objects that every full pass of the cyclic collector would walk while cached."""

    body: bytes

    def document(self) -> dict[str, Any]:
        """The answer parsed again, for the rare reader of its members (the matrix picture)."""
        return dict(json.loads(self.body))


class AnswerCache:
    """The latest rendering of each answer, with the key of the state it was computed from."""

    def __init__(self, size: int = ANSWERS) -> None:
        self._latest: LRUCache[tuple[str, ...], tuple[Hashable, Rendered]] = LRUCache(size)

    def get(self, name: tuple[str, ...], key: Hashable) -> Rendered | None:
        found = self._latest.get(name)
        return found[1] if found is not None and found[0] == key else None

    def put(self, name: tuple[str, ...], key: Hashable, rendered: Rendered) -> None:
        self._latest[name] = (key, rendered)


def state_key(states: Sequence[InstanceState], policy: PairingPolicy) -> Hashable:
    """Everything a whole-deployment answer is computed from, besides the pure verdicts."""
    instances = tuple((s.instance, s.role, s.expected_ranks, tuple(s.live.items())) for s in states)
    return instances, policy


# (instances, the verdicts of their class pairs, policy) -> a wire model
Compute = Callable[[list[InstanceRanks], VerdictMemo, PairingPolicy], Any]


class AnswerSources(Protocol):
    """What a whole-deployment answer reads: the database and the process's caches (the
    ``Registry`` holds them all)."""

    sessionmaker: SessionMaker
    registrations: RegistrationCache
    verdicts: VerdictMemo
    answers: AnswerCache


async def cached_answer(
    sources: AnswerSources,
    name: tuple[str, ...],
    compute: Compute,
    *,
    deployment: str,
    now: datetime,
    domains: bool,
    extra: Hashable = (),
) -> Rendered:
    """``compute``'s answer over the deployment's live instances, rendered; the cached rendering
    while the state it depends on (and ``extra``, any further input of ``compute``) is unchanged.
    ``NotFound`` for an unknown deployment. With ``domains`` the instances' domains are read even
    without a pairing policy."""
    sessionmaker, cache = sources.sessionmaker, sources.answers
    for attempt in range(1, MATRIX_READS + 1):
        states = await deployment_states(sessionmaker, deployment, now=now)
        policy = PairingPolicy.from_json(await pairing_policy(sessionmaker, deployment))
        key = (state_key(states, policy), extra)
        if (hit := cache.get(name, key)) is not None:
            return hit
        try:
            topology = domains or not policy.empty
            instances, memo = await matrix_inputs(
                sources.registrations, deployment, states, sources.verdicts, topology=topology
            )
        except RegistrationMoved:
            # A rank re-registered between the two reads: a read-only view just reads again.
            if attempt == MATRIX_READS:
                raise
            continue
        # On the event loop: verdicts are memoized per pair of geometry classes (shared with
        # admission, which runs here too), so only a class pair never seen before costs a check.
        answer = compute(instances, memo, policy)
        rendered = Rendered(json.dumps(wire.to_json(answer)).encode())
        cache.put(name, key, rendered)
        return rendered
    raise AssertionError("unreachable")


async def deployment_matrix(sources: AnswerSources, deployment: str, *, now: datetime) -> Rendered:
    """The matrix of the deployment's live registrations; ``NotFound`` for an unknown one."""

    def compute(
        instances: list[InstanceRanks], memo: VerdictMemo, policy: PairingPolicy
    ) -> wire.Compatibility:
        return compatibility_matrix(deployment, instances, memo, policy)

    return await cached_answer(
        sources,
        ("compatibility", deployment),
        compute,
        deployment=deployment,
        now=now,
        domains=False,
    )
