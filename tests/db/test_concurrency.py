"""Two kvroute processes (two engines) racing incompatible registrations admit exactly one side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvroute.geometry import GeometryError, RankRegistration
from kvroute.store import registry
from kvroute.store.engine import SessionMaker, create_engine, dispose, make_sessionmaker
from tests.db.documents import T0, register, registration

ROUNDS = 20


@pytest.fixture
async def two_processes(database_url: str) -> AsyncIterator[tuple[SessionMaker, SessionMaker]]:
    engines = [create_engine(database_url), create_engine(database_url)]
    yield make_sessionmaker(engines[0]), make_sessionmaker(engines[1])
    for engine in engines:
        await dispose(engine)


async def refusal(sessionmaker: SessionMaker, reg: RankRegistration) -> GeometryError | None:
    """None when the rank was admitted, else the geometry refusal."""
    try:
        await register(sessionmaker, reg, now=T0)
    except GeometryError as error:
        return error
    return None


async def test_concurrent_incompatible_instances_admit_exactly_one(
    two_processes: tuple[SessionMaker, SessionMaker],
) -> None:
    first, second = two_processes
    for round_number in range(ROUNDS):
        deployment = f"race{round_number}"
        # Context TP4, 8 heads (2 per rank) against a generation rank with another head_dim.
        context = [
            (first if rank % 2 else second, registration(deployment, "ctx0", rank, tp_size=4))
            for rank in range(4)
        ]
        generation = registration(deployment, "gen0", 0, role="generation", head_dim=64)
        contenders = [*context, (first, generation)]

        outcomes = await asyncio.gather(*(refusal(sm, reg) for sm, reg in contenders))

        admitted = [reg for (_, reg), error in zip(contenders, outcomes, strict=True) if not error]
        winners = {reg.instance for reg in admitted}
        assert len(winners) == 1, (round_number, outcomes)
        assert {error.stage for error in outcomes if error} == {"peer"}
        detail = await registry.get_deployment(first, deployment, now=T0)
        assert [instance.name for instance in detail.instances] == sorted(winners)
        assert detail.live_ranks == len(admitted)
