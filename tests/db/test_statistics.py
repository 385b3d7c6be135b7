"""Planner statistics kept by kvroute (``store.statistics``): a table that grew is analyzed once,
then left alone until it grows again; SQLite is never touched."""

from __future__ import annotations

import asyncio
import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.store import statistics
from kvroute.store.engine import SessionMaker
from tests.db.documents import T0, register, registration

GROWN = statistics.THRESHOLD_ROWS + 10  # ranks: just past the threshold of a never-analyzed table
STATS_WAIT_S = 30.0  # PostgreSQL reports a backend's row counts some seconds after its commits


async def test_a_grown_table_is_analyzed_once(
    engine: AsyncEngine, sessionmaker: SessionMaker
) -> None:
    for index in range(GROWN):
        reg = registration("d", f"ctx{index}", 0, role="context", tp_size=1)
        await register(sessionmaker, reg, now=T0)
    if engine.dialect.name != "postgresql":
        assert await statistics.refresh(engine) == []
        return
    analyzed = await _refresh_until(engine, "ranks")
    assert {"ranks", "pools", "views", "instances"} <= set(analyzed)
    async with engine.connect() as connection:
        tuples = await connection.scalar(
            text("SELECT reltuples FROM pg_class WHERE relname = 'ranks'")
        )
    assert tuples == GROWN  # ANALYZE counted the rows
    assert "ranks" not in await statistics.refresh(engine)  # fresh now: not analyzed again


async def _refresh_until(engine: AsyncEngine, table: str) -> list[str]:
    analyzed: list[str] = []
    deadline = time.monotonic() + STATS_WAIT_S
    while table not in analyzed:
        assert time.monotonic() < deadline, f"{table} never analyzed: {analyzed}"
        await asyncio.sleep(0.5)
        analyzed += await statistics.refresh(engine)
    return analyzed
