"""Plan reads share database reads, but never one that began before they arrived.

The first read of a wave is held after it has read the registry; a rank re-registers; a second
request arrives. It must wait for the next read and see the new generation, while the first
request gets what its own read saw.
"""

from __future__ import annotations

import asyncio

import pytest

from kvroute.control import state_reads
from kvroute.store import registry
from kvroute.store.engine import SessionMaker
from tests.db.documents import T0, registration

WAIT_S = 10.0


async def test_a_request_never_joins_a_read_that_began_before_it(
    sessionmaker: SessionMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    await registry.register_rank(sessionmaker, registration("llama", "ctx0", 0, tp_size=1), now=T0)
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
        await registry.register_rank(sessionmaker, changed, now=T0)
        second = asyncio.ensure_future(reads.states("llama", ["ctx0"], now=T0))
        await asyncio.sleep(0.05)
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
        await registry.register_rank(
            sessionmaker, registration("llama", name, 0, tp_size=1, role=role), now=T0
        )
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
