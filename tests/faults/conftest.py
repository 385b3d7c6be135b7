"""The fault suite: real ``kvroute serve`` processes (``kvroute.live``) put through what goes wrong.

Servers are killed with SIGKILL, frozen with SIGSTOP (our own processes only), cut off from
PostgreSQL by a proxy (``proxy.py``; the shared server is never touched), handed shrinking segments
by separate worker processes and hostile bodies by clients. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from kvroute.live import LiveServer
from kvroute.store.engine import create_engine
from tests.api.conftest import ADMIN_TOKEN, WORKER_TOKEN
from tests.transfer.conftest import Owners

WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
KILL_WAIT_S = 15.0


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """Starts live servers on tokens; every one still running at the end is stopped (or killed)."""
    started: list[LiveServer] = []

    def start(database_url: str, *, name: str = "a", **env: str) -> LiveServer:
        directory = tmp_path / name
        directory.mkdir(exist_ok=True)
        server = LiveServer(
            directory,
            database_url=database_url,
            tokens=(WORKER_TOKEN, ADMIN_TOKEN),
            env={"KVROUTE_REPLICA_ID": name, **env},
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        if server.process is not None:
            server.process.send_signal(signal.SIGCONT)  # a test may have left it stopped
            server.stop()


def kill(server: LiveServer) -> None:
    """SIGKILL: no drain, no cleanup, whatever was in flight is cut."""
    assert server.process is not None
    server.process.kill()
    server.process.wait(timeout=KILL_WAIT_S)
    server.process = None


@pytest.fixture(scope="module")
def owners() -> Iterator[Owners]:
    """A worker process that owns shared-memory segments (kvroute only attaches)."""
    started = Owners(("workers",))
    yield started
    started.stop()


def query(database_url: str, sql: str, **parameters: Any) -> list[tuple[Any, ...]]:
    """Rows of one read, on a short-lived engine of its own."""

    async def read() -> list[tuple[Any, ...]]:
        engine = create_engine(database_url)
        try:
            async with engine.connect() as connection:
                result = await connection.execute(text(sql), parameters)
                return [tuple(row) for row in result]
        finally:
            await engine.dispose()

    return asyncio.run(read())
