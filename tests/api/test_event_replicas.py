"""A watcher on one replica sees every change made through another, and one that reconnects (its
replica restarted while changes went on elsewhere) misses none: every revision once, in order.
Both databases: PostgreSQL through LISTEN/NOTIFY, SQLite (two processes on one file) through the
hub's reads of the log."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvroute import wire
from kvroute.client import AsyncKvrouteClient, RetryPolicy
from kvroute.client.watch import EventWatcher
from kvroute.live import LiveServer
from tests.api.documents import rank_document

# Reconnects for as long as a restart takes on the loaded machine.
PATIENT = RetryPolicy(attempts=400, base_delay=0.05, max_delay=0.5)
WAIT_SECONDS = 120.0


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[LiveServer]]:
    url = (
        f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
        if request.param == "sqlite"
        else str(request.getfixturevalue("postgres_test_url"))
    )
    first = LiveServer(tmp_path, database_url=url).start()
    second = LiveServer(tmp_path, database_url=url)
    try:
        second.start()
        yield [first, second]
    finally:
        second.stop()
        first.stop()


async def _take(stream: AsyncIterator[wire.Event], count: int) -> list[wire.Event]:
    async with asyncio.timeout(WAIT_SECONDS):
        return [await anext(stream) for _ in range(count)]


async def test_a_reconnecting_watcher_misses_no_event(replicas: list[LiveServer]) -> None:
    writer_server, watched = replicas
    async with (
        AsyncKvrouteClient(writer_server.url) as writer,
        AsyncKvrouteClient(watched.url, retry=PATIENT) as reader,
    ):
        watcher = EventWatcher(reader, "fleet", since=0)
        stream = aiter(watcher)
        try:
            for index in range(3):
                await writer.register("fleet", f"ctx{index}", 0, rank_document(lease_seconds=600))
            seen = await _take(stream, 6)
            await asyncio.to_thread(watched.stop)
            # Changes while the watched replica is down: the watcher must catch up on them.
            for index in range(3, 5):
                await writer.register("fleet", f"ctx{index}", 0, rank_document(lease_seconds=600))
            await writer.deregister("fleet", "ctx0", 0)
            await asyncio.to_thread(watched.start)
            seen += await _take(stream, 6)
            await writer.register(
                "fleet", "gen0", 0, rank_document(role="generation", lease_seconds=600)
            )
            seen += await _take(stream, 2)  # live again after the catch-up
        finally:
            await stream.aclose()
    assert [event.revision for event in seen] == list(range(1, 15))
    registered = [event.instance for event in seen if event.kind == "rank_registered"]
    assert registered == ["ctx0", "ctx1", "ctx2", "ctx3", "ctx4", "gen0"]
    assert [(e.kind, e.instance) for e in seen if e.kind == "rank_deleted"] == [
        ("rank_deleted", "ctx0")
    ]
    assert watcher.reconnects >= 1
