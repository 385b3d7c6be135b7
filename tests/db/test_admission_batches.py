"""A batch of admissions answers exactly what admitting the same registrations one by one does.

Random sequences of registrations (two geometry families that refuse each other, an instance
whose ranks disagree, identical renewals, changed documents of the same class and of another
class, which ends a batch early) go once through ``admit_batch`` until every one is answered and
once, in a second deployment, through production's registration path (``control.Registry``) one
at a time. Each registration must get the same
outcome (generation and creation, or the same refusal naming the same peer) and the two
deployments must end with the same rows.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.control.admissions import AdmissionMetrics
from kvroute.control.registry import Registry
from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.checks.classes import VerdictMemo
from kvroute.geometry.checks.instance import InstanceMemo
from kvroute.store import events
from kvroute.store.admission import admit_batch, prepare
from kvroute.store.engine import SessionMaker
from kvroute.store.models import InstanceRow, PoolRow, RankRow, ViewRow
from kvroute.store.registrations import RegistrationCache
from kvroute.store.rejections import DEFAULT_LOG_SIZE
from tests.db.documents import T0, registration


@dataclass(frozen=True)
class Caches:
    """Admission's caches without a ``Registry``."""

    registrations: RegistrationCache
    verdicts: VerdictMemo
    agreements: InstanceMemo


SCENARIOS = 12
LENGTH = 14
INSTANCES = ("ctx0", "ctx1", "gen0", "gen1")


def _candidate(rng: random.Random, deployment: str) -> RankRegistration:
    instance = rng.choice(INSTANCES)
    role = "context" if instance.startswith("ctx") else "generation"
    return registration(
        deployment,
        instance,
        rng.randrange(2),
        role=role,
        tp_size=2,
        head_dim=rng.choice([128, 128, 128, 64]),  # another family now and then
        lease_seconds=rng.choice([30, 30, 31]),  # 31: a changed document of the same class
    )


def _outcome(outcome: object) -> tuple[Any, ...]:
    if isinstance(outcome, GeometryError):
        return ("refused", outcome.code, outcome.field, outcome.peer_instance, outcome.peer_rank)
    return ("admitted", outcome.generation, outcome.created)  # type: ignore[attr-defined]


async def _one_by_one(sessionmaker: SessionMaker, regs: list[RankRegistration]) -> list[tuple]:
    registry, outcomes = Registry(sessionmaker, rejection_log_size=DEFAULT_LOG_SIZE), []
    for reg in regs:
        try:
            outcomes.append(_outcome(await registry.register(reg, now=T0)))
        except GeometryError as error:
            outcomes.append(_outcome(error))
    return outcomes


async def _batched(
    sessionmaker: SessionMaker, regs: list[RankRegistration]
) -> tuple[list[tuple], int]:
    """Outcomes, and how many batches ended early (a rank changed its class)."""
    cache, memo, outcomes, pending = RegistrationCache(sessionmaker), {}, [], list(regs)
    agreed: InstanceMemo = {}
    for reg in regs:
        await prepare(reg)
    ended_early = 0
    while pending:
        batch = _distinct(pending)
        result = await admit_batch(sessionmaker, batch, Caches(cache, memo, agreed), now=T0)
        outcomes += [_outcome(outcome) for outcome in result.outcomes]
        ended_early += bool(result.deferred)
        pending = result.deferred + pending[len(batch) :]
    return outcomes, ended_early


def _distinct(pending: list[RankRegistration]) -> list[RankRegistration]:
    """The longest prefix naming each rank once (what the service's queue hands a batch)."""
    seen: set[tuple[str, int]] = set()
    for index, reg in enumerate(pending):
        if reg.key in seen:
            return pending[:index]
        seen.add(reg.key)
    return pending


async def _rows(sessionmaker: SessionMaker, deployment: str) -> dict[str, list[tuple]]:
    tables = {
        "ranks": select(
            RankRow.instance,
            RankRow.rank,
            RankRow.generation,
            RankRow.canonical_sha256,
            RankRow.geometry_class,
        ).where(RankRow.deployment == deployment),
        "instances": select(InstanceRow.name, InstanceRow.role, InstanceRow.tp_size).where(
            InstanceRow.deployment == deployment
        ),
        "pools": select(PoolRow.instance, PoolRow.rank, PoolRow.pool_id).where(
            PoolRow.deployment == deployment
        ),
        "views": select(ViewRow.instance, ViewRow.rank, ViewRow.view_id).where(
            ViewRow.deployment == deployment
        ),
    }
    async with sessionmaker() as session:
        return {name: sorted((await session.execute(q)).all()) for name, q in tables.items()}


async def test_a_batch_answers_what_one_by_one_admission_answers(
    sessionmaker: SessionMaker,
) -> None:
    rng = random.Random(13)
    ended_early, kinds = 0, set()
    for scenario in range(SCENARIOS):
        seeds = [rng.randrange(10**6) for _ in range(LENGTH)]
        one = [_candidate(random.Random(seed), f"one{scenario}") for seed in seeds]
        many = [_candidate(random.Random(seed), f"many{scenario}") for seed in seeds]
        # Half the sequence first, one by one in both deployments: the batch then meets old rows.
        half = LENGTH // 2
        assert await _one_by_one(sessionmaker, one[:half]) == await _one_by_one(
            sessionmaker, many[:half]
        )
        expected = await _one_by_one(sessionmaker, one[half:])
        got, early = await _batched(sessionmaker, many[half:])
        assert got == expected, scenario
        assert await _rows(sessionmaker, f"many{scenario}") == await _rows(
            sessionmaker, f"one{scenario}"
        )
        ended_early += early
        kinds |= {outcome[0] if outcome[0] == "admitted" else outcome[1] for outcome in got}
    # The scenarios met every path: admissions, refusals of both stages, batches ended early.
    assert {"admitted", "head_dim_mismatch", "instance_layout_mismatch"} <= kinds, kinds
    assert ended_early > 0


async def test_a_batch_costs_the_statements_of_one_admission(
    engine: AsyncEngine, sessionmaker: SessionMaker
) -> None:
    """Admitting sixteen new ranks over eight instances sends as many statements as admitting one
    (one per kind of read and write; on PostgreSQL those are the round trips a batch waits for
    under the deployment lock)."""
    cache, memo, agreed = RegistrationCache(sessionmaker), {}, {}
    peer = [registration("fixed", "gen0", rank, role="generation", tp_size=2) for rank in (0, 1)]

    async def statements(batch: list[RankRegistration]) -> int:
        for reg in batch:
            await prepare(reg)
        sent: list[str] = []

        def note(connection: Any, cursor: Any, statement: str, *_: Any) -> None:
            sent.append(statement)

        event.listen(engine.sync_engine, "before_cursor_execute", note)
        try:
            result = await admit_batch(sessionmaker, batch, Caches(cache, memo, agreed), now=T0)
        finally:
            event.remove(engine.sync_engine, "before_cursor_execute", note)
        assert [type(outcome).__name__ for outcome in result.outcomes] == ["RegisterOutcome"] * len(
            batch
        )
        return len(sent)

    await statements(peer)
    one = await statements([registration("fixed", "ctx0", 0, tp_size=2)])
    many = [
        registration("fixed", f"ctx{i}", rank, tp_size=2) for i in range(1, 9) for rank in (0, 1)
    ]
    assert await statements(many) == one
    if engine.dialect.name == "postgresql":
        # the lock, the judgement with its fences, the peers, the rows with their events
        assert one == 4


async def test_a_batch_logs_what_readers_see_with_the_generations_it_counted(
    sessionmaker: SessionMaker,
) -> None:
    """The batch's events (on PostgreSQL written by the storing statement itself): a new rank and
    a changed document with the generation the batch counted, a rank live again with its own, a
    renewal of a live rank nothing; then one ``plans_invalidated`` per instance, in order."""
    cache, memo, agreed = RegistrationCache(sessionmaker), {}, {}

    def reg(instance: str, rank: int, lease: int) -> RankRegistration:
        role = "context" if instance.startswith("ctx") else "generation"
        return registration("logged", instance, rank, role=role, tp_size=2, lease_seconds=lease)

    async def admit(batch: list[RankRegistration], now: datetime) -> list[tuple]:
        for candidate in batch:
            await prepare(candidate)
        result = await admit_batch(sessionmaker, batch, Caches(cache, memo, agreed), now=now)
        assert not result.deferred
        return [_outcome(outcome) for outcome in result.outcomes]

    first = [reg("ctx0", 0, 300), reg("ctx0", 1, 300), reg("gen0", 0, 30)]
    assert await admit(first, T0) == [("admitted", 1, True)] * 3
    later = T0 + timedelta(seconds=60)  # gen0's rank 0 has expired, ctx0's ranks are live
    second = [reg("ctx0", 0, 300), reg("ctx0", 1, 31), reg("gen0", 0, 30), reg("gen0", 1, 30)]
    assert await admit(second, later) == [
        ("admitted", 1, False),  # renewed: no event
        ("admitted", 2, False),  # a changed document: a new generation
        ("admitted", 1, False),  # live again
        ("admitted", 1, True),
    ]
    logged = [
        (event.revision, event.kind, event.instance, event.rank, event.generation, event.data)
        for event in await events.read_after(sessionmaker, "logged", 0, 100)
    ]
    invalidated = {"reason": "rank_registered"}
    assert logged == [
        (1, "rank_registered", "ctx0", 0, 1, None),
        (2, "rank_registered", "ctx0", 1, 1, None),
        (3, "rank_registered", "gen0", 0, 1, None),
        (4, "plans_invalidated", "ctx0", None, None, invalidated),
        (5, "plans_invalidated", "gen0", None, None, invalidated),
        (6, "rank_registered", "ctx0", 1, 2, None),
        (7, "rank_registered", "gen0", 0, 1, None),
        (8, "rank_registered", "gen0", 1, 1, None),
        (9, "plans_invalidated", "ctx0", None, None, invalidated),
        (10, "plans_invalidated", "gen0", None, None, invalidated),
    ]
    assert await events.current_revision(sessionmaker, "logged") == 10


async def test_the_metrics_count_each_batch_and_every_registration_it_answered(
    sessionmaker: SessionMaker,
) -> None:
    """``kvroute_admission_batch_ranks`` sums to the registrations answered, refusals included,
    and holds a sample per batch; ``kvroute_admission_batch_seconds`` a duration per batch."""
    collected = CollectorRegistry()
    metrics = AdmissionMetrics.create(collected)
    registry = Registry(
        sessionmaker, rejection_log_size=DEFAULT_LOG_SIZE, admission_metrics=metrics
    )
    ranks = [registration("llama", "ctx0", rank, tp_size=8) for rank in range(8)]
    refused = registration("llama", "gen0", 0, role="generation", head_dim=64)
    outcomes = await asyncio.gather(
        *(registry.register(reg, now=T0) for reg in [*ranks, refused]), return_exceptions=True
    )
    assert [type(outcome) for outcome in outcomes[-1:]] == [GeometryError]
    later = registration("llama", "ctx1", 0)
    await registry.register(later, now=T0)  # alone: a batch of one

    def sample(name: str) -> float | None:
        return collected.get_sample_value(name, {"deployment": "llama"})

    batches = sample("kvroute_admission_batch_ranks_count")
    assert sample("kvroute_admission_batch_ranks_sum") == 10
    assert batches is not None
    assert 2 <= batches <= 10
    assert sample("kvroute_admission_batch_seconds_count") == batches
    assert (sample("kvroute_admission_batch_seconds_sum") or 0) > 0
