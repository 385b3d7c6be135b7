"""Heartbeats race admissions without the deployment lock, and an expired rank still never returns.

Two engines stand for two kvroute processes on one PostgreSQL. A third connection holds the row
lock of an expiring context rank, so the race is scheduled exactly: a heartbeat (its clock a little
behind, as another replica's may be) starts first and blocks on the row; an admission of an
incompatible generation rank, judging the context rank expired, starts second. Whatever order the
database then runs them in, the two must never both be live: either the heartbeat renews the rank
and the admission sees it and refuses, or the admission fences it and the heartbeat fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import text

from kvroute.geometry import GeometryError
from kvroute.store import registry
from kvroute.store.engine import SessionMaker, create_engine, dispose, make_sessionmaker
from kvroute.store.errors import LeaseExpired
from tests.db.documents import T0, register, registration

pytestmark = pytest.mark.postgres
LEASE = 10
BLOCKED_SECONDS = 0.5  # long enough for both contenders to queue on the row lock


@pytest.fixture
async def processes(postgres_test_url: str) -> AsyncIterator[tuple[SessionMaker, SessionMaker]]:
    engines = [create_engine(postgres_test_url), create_engine(postgres_test_url)]
    yield make_sessionmaker(engines[0]), make_sessionmaker(engines[1])
    for engine in engines:
        await dispose(engine)


async def _outcome(work: asyncio.Future[object]) -> object:
    try:
        return await work
    except (GeometryError, LeaseExpired) as error:
        return error


async def test_a_heartbeat_queued_behind_an_admission_never_revives_what_it_skipped(
    processes: tuple[SessionMaker, SessionMaker], postgres_test_url: str
) -> None:
    first, second = processes
    context = registration("fence", "ctx0", 0, tp_size=1, lease_seconds=LEASE)
    await register(first, context, now=T0)
    rival = registration("fence", "gen0", 0, role="generation", tp_size=1, head_dim=64)

    holder = create_engine(postgres_test_url)
    try:
        async with holder.connect() as lock:
            await lock.execute(
                text("SELECT 1 FROM ranks WHERE instance = 'ctx0' AND rank = 0 FOR UPDATE")
            )
            # The heartbeat's clock reads 1 s before the lease ends; the admission's 1 s after.
            beat = asyncio.ensure_future(
                registry.heartbeat(first, "fence", "ctx0", 0, now=T0 + timedelta(seconds=LEASE - 1))
            )
            await asyncio.sleep(BLOCKED_SECONDS)
            admission = asyncio.ensure_future(
                register(second, rival, now=T0 + timedelta(seconds=LEASE + 1))
            )
            await asyncio.sleep(BLOCKED_SECONDS)
            assert not beat.done()
            assert not admission.done()
            await lock.rollback()
        renewed, admitted = await _outcome(beat), await _outcome(admission)
    finally:
        await dispose(holder)

    later = T0 + timedelta(seconds=LEASE + 2)
    deployment = await registry.get_deployment(first, "fence", now=later)
    live = {item.name for item in deployment.instances if item.live_ranks}
    assert live in ({"ctx0"}, {"gen0"}), (renewed, admitted)
    if isinstance(admitted, GeometryError):  # the renewal landed first and was checked
        assert admitted.code == "head_dim_mismatch"
        assert admitted.peer_instance == "ctx0"
        assert not isinstance(renewed, LeaseExpired)
    else:  # the admission fenced the rank; no heartbeat can bring it back, late clocks included
        assert isinstance(renewed, LeaseExpired)
        with pytest.raises(LeaseExpired):
            await registry.heartbeat(first, "fence", "ctx0", 0, now=T0)


async def test_an_admission_fences_only_what_it_judged_expired(
    processes: tuple[SessionMaker, SessionMaker],
) -> None:
    first, second = processes
    short = registration("fence", "ctx0", 0, tp_size=2, lease_seconds=5)
    long = registration("fence", "ctx0", 1, tp_size=2, lease_seconds=60)
    await register(first, short, now=T0)
    await register(first, long, now=T0)
    compatible = registration("fence", "gen0", 0, role="generation", tp_size=1)
    await register(second, compatible, now=T0 + timedelta(seconds=6))

    with pytest.raises(LeaseExpired):
        await registry.heartbeat(first, "fence", "ctx0", 0, now=T0 + timedelta(seconds=4))
    renewed = await registry.heartbeat(first, "fence", "ctx0", 1, now=T0 + timedelta(seconds=7))
    assert renewed == T0 + timedelta(seconds=67)
    # Registering again lifts the fence: the rank is checked anew and renewable again.
    await register(first, short, now=T0 + timedelta(seconds=8))
    again = await registry.heartbeat(first, "fence", "ctx0", 0, now=T0 + timedelta(seconds=9))
    assert again == T0 + timedelta(seconds=14)
