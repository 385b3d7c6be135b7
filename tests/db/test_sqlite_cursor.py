"""SQLite statements in one hop (``store.sqlite_cursor``): the same answers as SQLAlchemy's stock
aiosqlite adapter, statement for statement, at one trip to aiosqlite's thread each."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiosqlite
import pytest
from sqlalchemy import bindparam, insert, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from kvroute.store.engine import create_engine, dispose
from kvroute.store.models import DeploymentRow
from kvroute.store.sqlite_cursor import OneHopConnection
from tests.db.documents import T0

DEPLOYMENTS = DeploymentRow.__table__


@pytest.fixture
async def engines(sqlite_url: str) -> AsyncIterator[tuple[AsyncEngine, AsyncEngine]]:
    """kvroute's writer engine and a stock aiosqlite engine on the same migrated file."""
    ours = create_engine(sqlite_url)
    stock = create_async_engine(sqlite_url)
    yield ours, stock
    await dispose(ours)
    await stock.dispose()


async def _session(engine: AsyncEngine, name: str) -> list[Any]:
    """Every kind of statement a unit of work runs, and what SQLAlchemy read of each."""
    seen: list[Any] = []
    async with engine.begin() as connection:
        row = {"name": name, "created_at": T0, "checked_at": T0}
        inserted = await connection.execute(insert(DEPLOYMENTS), row)
        seen.append(("insert", inserted.rowcount, inserted.inserted_primary_key))
        many = await connection.execute(
            insert(DEPLOYMENTS), [{**row, "name": f"{name}-{i}"} for i in range(3)]
        )
        seen.append(("executemany", many.rowcount))
        bumped = await connection.execute(
            update(DEPLOYMENTS)
            .where(DEPLOYMENTS.c.name.like(bindparam("prefix")))
            .values(revision=DEPLOYMENTS.c.revision + 1)
            .returning(DEPLOYMENTS.c.name, DEPLOYMENTS.c.revision),
            {"prefix": f"{name}-%"},
        )
        seen.append(("returning", sorted(bumped.all())))
        read = await connection.execute(
            select(DEPLOYMENTS.c.name, DEPLOYMENTS.c.checked_at)
            .where(DEPLOYMENTS.c.name.like(f"{name}%"))
            .order_by(DEPLOYMENTS.c.name)
        )
        seen.append(("select", list(read.keys()), read.all()))
        nothing = await connection.execute(
            select(DEPLOYMENTS.c.name).where(DEPLOYMENTS.c.name == "?")
        )
        seen.append(("empty", nothing.all()))
        batch = await connection.execute(
            select(DEPLOYMENTS.c.name)
            .where(DEPLOYMENTS.c.name.like(f"{name}%"))
            .order_by(DEPLOYMENTS.c.name)
        )
        seen.append(("fetchmany", batch.fetchmany(2), batch.fetchone(), len(batch.all())))
    return seen


async def test_one_hop_statements_answer_as_the_stock_adapter(
    engines: tuple[AsyncEngine, AsyncEngine],
) -> None:
    ours, stock = engines
    async with ours.connect() as connection:
        raw = await connection.get_raw_connection()
        assert isinstance(raw.dbapi_connection, OneHopConnection)
    mine = await _session(ours, "a")
    theirs = await _session(stock, "b")
    # The same session on either engine reads the same things (names differ only by prefix).
    assert repr(mine).replace("'a", "'x") == repr(theirs).replace("'b", "'x")
    assert mine[2] == ("returning", [("a-0", 1), ("a-1", 1), ("a-2", 1)])
    assert mine[3][1] == ["name", "checked_at"]
    assert mine[3][2][0] == ("a", T0)


async def test_each_statement_is_one_trip_to_the_driver_thread(
    engines: tuple[AsyncEngine, AsyncEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, stock = engines
    trips: list[str] = []
    queued = aiosqlite.Connection._execute

    async def counted(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        trips.append(getattr(fn, "__name__", repr(fn)))
        return await queued(self, fn, *args, **kwargs)

    monkeypatch.setattr(aiosqlite.Connection, "_execute", counted)
    for engine, expected in ((ours, 1), (stock, 4)):  # stock: cursor, execute, fetchall, close
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))  # ours also runs BEGIN IMMEDIATE first
            trips.clear()
            await connection.execute(text("SELECT 2"))
            assert len(trips) == expected, trips


async def test_driver_errors_reach_sqlalchemy_as_before(
    engines: tuple[AsyncEngine, AsyncEngine],
) -> None:
    ours, _ = engines
    row = {"name": "dup", "created_at": T0, "checked_at": T0}
    async with ours.begin() as connection:
        await connection.execute(insert(DEPLOYMENTS), row)
    with pytest.raises(IntegrityError):
        async with ours.begin() as connection:
            await connection.execute(insert(DEPLOYMENTS), row)
    with pytest.raises(OperationalError, match="no such table"):
        async with ours.connect() as connection:
            await connection.execute(text("SELECT * FROM no_such_table"))
    async with ours.connect() as connection:  # the connection still serves after both
        assert await connection.scalar(select(DEPLOYMENTS.c.name)) == "dup"


async def test_fetchmany_takes_the_arraysize_a_caller_sets(
    engines: tuple[AsyncEngine, AsyncEngine],
) -> None:
    def fetched(connection: Any) -> list[int]:
        cursor = connection.connection.dbapi_connection.cursor()
        cursor.arraysize = 2
        cursor.execute("SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3")
        sizes = [len(cursor.fetchmany()), len(cursor.fetchmany()), len(cursor.fetchmany())]
        cursor.close()
        return sizes

    answers = []
    for engine in engines:
        async with engine.connect() as connection:
            answers.append(await connection.run_sync(fetched))
    assert answers == [[2, 1, 0], [2, 1, 0]]
