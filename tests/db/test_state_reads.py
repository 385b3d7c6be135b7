"""Plan reads share database reads, but never one that began before they arrived.

The first read of a wave is held after it has read the registry; a rank re-registers; a second
request arrives. It must wait for the next read and see the new generation, while the first
request gets what its own read saw.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from kvroute.control import state_reads
from kvroute.store import snapshots
from kvroute.store.engine import SessionMaker, autocommit_connection, engine_of
from tests.db.documents import T0, register, registration

WAIT_S = 10.0


async def test_a_request_never_joins_a_read_that_began_before_it(
    sessionmaker: SessionMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    await register(sessionmaker, registration("llama", "ctx0", 0, tp_size=1), now=T0)
    read_done, release = asyncio.Event(), asyncio.Event()
    real = state_reads.instance_states

    async def held(*args: object, **kwargs: object) -> object:
        states = await real(*args, **kwargs)  # type: ignore[arg-type]
        read_done.set()
        await release.wait()
        return states

    monkeypatch.setattr(state_reads, "instance_states", held)
    reads = state_reads.StateReads(sessionmaker)
    async with asyncio.timeout(WAIT_S):
        first = asyncio.ensure_future(reads.states("llama", ["ctx0"], now=T0))
        await read_done.wait()  # the first wave has read generation 1 and is held
        changed = registration("llama", "ctx0", 0, tp_size=1, lease_seconds=31)
        await register(sessionmaker, changed, now=T0)
        second = asyncio.ensure_future(reads.states("llama", ["ctx0"], now=T0))
        # One turn of the loop runs the request up to its answer (``states`` and
        # ``Waves.submit`` await nothing before it): it is queued, the first wave still held.
        await asyncio.sleep(0)
        assert not second.done()  # it waits for a read of its own
        read_done.clear()
        release.set()
        assert (await first)["ctx0"].live == {0: 1}
        assert (await second)["ctx0"].live == {0: 2}


async def test_one_read_answers_every_request_that_waited_for_it(
    sessionmaker: SessionMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ctx0", "gen0"):
        role = "context" if name == "ctx0" else "generation"
        await register(sessionmaker, registration("llama", name, 0, tp_size=1, role=role), now=T0)
    calls: list[list[str]] = []
    real = state_reads.instance_states

    async def counted(sessionmaker_: SessionMaker, deployment: str, names: list[str], **kw):  # type: ignore[no-untyped-def]
        calls.append(list(names))
        return await real(sessionmaker_, deployment, names, **kw)

    monkeypatch.setattr(state_reads, "instance_states", counted)
    reads = state_reads.StateReads(sessionmaker)
    asked = [["ctx0"], ["gen0"], ["ctx0", "gen0"], ["ctx0"]]
    answers = await asyncio.gather(*(reads.states("llama", names, now=T0) for names in asked))
    assert [sorted(answer) for answer in answers] == [sorted(names) for names in asked]
    # All four arrived before any read began: one read of the union answers them all.
    assert calls == [["ctx0", "gen0"]]


async def test_states_judged_by_the_database_equal_those_judged_row_by_row(
    sessionmaker: SessionMaker,
) -> None:
    """PostgreSQL judges leases and aggregates ranks in its query; the judgement must be the
    row-by-row one (``_judged``) at every clock reading, before and after the latest admission,
    for instances with live, expired and no ranks (on SQLite both sides are the row reading)."""
    for rank in range(4):  # leases ending at T0 + 5, 10, 15 and 20
        reg = registration("llama", "ctx0", rank, tp_size=4, lease_seconds=5 * (rank + 1))
        await register(sessionmaker, reg, now=T0)
    gen = registration("llama", "gen0", 0, tp_size=2, role="generation", lease_seconds=30)
    await register(sessionmaker, gen, now=T0 + timedelta(seconds=12))  # the latest admission
    engine = engine_of(sessionmaker)
    judged = {}
    for offset in (0, 7, 12, 14, 16, 25, 50):
        now = T0 + timedelta(seconds=offset)
        async with autocommit_connection(engine) as connection:
            every_rank = snapshots._ROWS["deployment"]
            rows = (await connection.execute(every_rank, {"deployment": "llama"})).all()
        judged[offset] = expected = snapshots._judged("llama", rows, now)
        states = await snapshots.instance_states(sessionmaker, "llama", ["ctx0", "gen0"], now=now)
        assert states == expected
        listed = await snapshots.deployment_states(sessionmaker, "llama", now=now)
        assert listed == [expected["ctx0"], expected["gen0"]]
    # At T0 + 7 leases are judged at the admission (T0 + 12): ranks 0 and 1 have expired then.
    assert judged[7]["ctx0"].expired == (0, 1)
    assert judged[7]["ctx0"].live == {2: 1, 3: 1}
    assert judged[50]["gen0"].expired == (0,)
