"""Engines and sessionmakers with the per-backend settings kvroute's correctness relies on.

SQLite (the embedded default) needs three things switched on per connection: foreign keys (off by
default, and the pool/view tables rely on ON DELETE CASCADE), WAL (readers keep reading while one
writer commits) and a busy timeout (writers wait instead of failing). Its driver's legacy
transaction handling is replaced by explicit ``BEGIN IMMEDIATE``, so every transaction that may
write takes the database write lock up front: registrations of one deployment then serialize across
processes exactly like PostgreSQL's advisory lock makes them, and no transaction ever has to
upgrade a read lock (which SQLite answers with an immediate "database is locked").

Read-only work opts into a deferred ``BEGIN`` through :func:`reading`, so reads never queue behind
writers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

from sqlalchemy import event
from sqlalchemy.engine import Connection, CursorResult, make_url
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.sql import Executable

SQLITE_BUSY_TIMEOUT_MS = 30_000
# Execution option naming a transaction that will not write (SQLite then begins it deferred).
READ_ONLY = "kvroute_read_only"

SessionMaker = async_sessionmaker[AsyncSession]


def create_engine(url: str, **engine_kwargs: Any) -> AsyncEngine:
    """An async engine for a ``sqlite+aiosqlite`` or ``postgresql+asyncpg`` URL."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(parsed, **engine_kwargs)
        _configure_sqlite(engine)
        return engine
    # pre_ping: a PostgreSQL restart must cost one retry, not a burst of 500s.
    engine_kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(parsed, **engine_kwargs)


def make_sessionmaker(engine: AsyncEngine) -> SessionMaker:
    """Sessions whose loaded objects stay usable after commit (no implicit refresh I/O)."""
    return async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def reading(sessionmaker: SessionMaker) -> AsyncIterator[AsyncSession]:
    """A session for one read-only unit of work; on SQLite it does not take the write lock."""
    async with sessionmaker() as session:
        await session.connection(execution_options={READ_ONLY: True})
        yield session


def engine_of(sessionmaker: SessionMaker) -> AsyncEngine:
    return cast("AsyncEngine", sessionmaker.kw["bind"])


@asynccontextmanager
async def read_connection(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A Core connection in autocommit mode for single-statement reads on hot paths.

    No BEGIN, no ROLLBACK, no ORM session: one round trip per statement. Each statement sees its
    own snapshot, so a read that must be consistent across tables is one (joined) statement.
    """
    async with engine.connect() as connection:
        yield await connection.execution_options(isolation_level="AUTOCOMMIT")


async def affected_rows(session: AsyncSession, statement: Executable) -> int:
    """Executes an UPDATE or DELETE and returns how many rows it touched."""
    result = await session.execute(statement)
    return cast("CursorResult[Any]", result).rowcount


def _configure_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to the "begin" hook below instead of the driver.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        finally:
            cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Connection) -> None:
        read_only = connection.get_execution_options().get(READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
