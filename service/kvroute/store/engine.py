"""Engines and sessionmakers with the per-backend settings kvroute's correctness relies on.

SQLite (the embedded default) needs three things switched on per connection: foreign keys (off by
default, and the pool/view tables rely on ON DELETE CASCADE), WAL (readers keep reading while one
writer commits) and a bounded busy timeout (writers wait for the lock a while, then fail with
"database is locked", which the API answers as 503 ``database_busy``). Its driver's legacy
transaction handling is replaced by explicit ``BEGIN IMMEDIATE``, so every transaction that may
write takes the database write lock up front: registrations of one deployment then serialize across
processes exactly like PostgreSQL's advisory lock makes them, and no transaction ever has to
upgrade a read lock (which SQLite answers with an immediate "database is locked").

Read-only work opts into a deferred ``BEGIN`` through :func:`reading`, so reads never queue behind
writers.

PostgreSQL gets a server-side ``statement_timeout`` and ``lock_timeout`` (the registration advisory
lock included) and, because a frozen server or a silent network enforces nothing, client-side
bounds too: asyncpg's connect timeout and per-statement ``command_timeout``, and the pool's wait for
a connection. No database call can then hang a request for longer than its timeouts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import event
from sqlalchemy.engine import Connection, CursorResult, make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.sql import Executable

# Execution option naming a transaction that will not write (SQLite then begins it deferred).
READ_ONLY = "kvroute_read_only"
# The client gives the server this long past its own statement_timeout to report it first.
CLIENT_TIMEOUT_MARGIN_S = 1.0

SessionMaker = async_sessionmaker[AsyncSession]


@dataclass(frozen=True, slots=True)
class DatabaseTimeouts:
    """How long one database call may take; ``Settings`` carries the configured values."""

    statement_seconds: float = 5.0
    lock_seconds: float = 3.0
    connect_seconds: float = 5.0
    sqlite_busy_seconds: float = 5.0


def create_engine(
    url: str, timeouts: DatabaseTimeouts | None = None, **engine_kwargs: Any
) -> AsyncEngine:
    """An async engine for a ``sqlite+aiosqlite`` or ``postgresql+asyncpg`` URL."""
    timeouts = timeouts or DatabaseTimeouts()
    parsed = make_url(url)
    engine_kwargs.setdefault("pool_timeout", timeouts.connect_seconds)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(parsed, **engine_kwargs)
        _configure_sqlite(engine, busy_ms=round(timeouts.sqlite_busy_seconds * 1000))
        return engine
    # pre_ping: a PostgreSQL restart must cost one retry, not a burst of 500s.
    engine_kwargs.setdefault("pool_pre_ping", True)
    engine_kwargs.setdefault("connect_args", _postgres_connect_args(timeouts))
    return create_async_engine(parsed, **engine_kwargs)


def _postgres_connect_args(timeouts: DatabaseTimeouts) -> dict[str, Any]:
    return {
        "timeout": timeouts.connect_seconds,
        "command_timeout": timeouts.statement_seconds + CLIENT_TIMEOUT_MARGIN_S,
        "server_settings": {
            "statement_timeout": str(round(timeouts.statement_seconds * 1000)),
            "lock_timeout": str(round(timeouts.lock_seconds * 1000)),
        },
    }


def make_sessionmaker(engine: AsyncEngine) -> SessionMaker:
    """Sessions whose loaded objects stay usable after commit (no implicit refresh I/O)."""
    return async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def reading(sessionmaker: SessionMaker) -> AsyncIterator[AsyncSession]:
    """A session for one read-only unit of work; on SQLite it does not take the write lock."""
    async with sessionmaker() as session:
        await session.connection(execution_options={READ_ONLY: True})
        yield session


async def affected_rows(session: AsyncSession, statement: Executable) -> int:
    """Executes an UPDATE or DELETE and returns how many rows it touched."""
    result = await session.execute(statement)
    return cast("CursorResult[Any]", result).rowcount


def _configure_sqlite(engine: AsyncEngine, *, busy_ms: int) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to the "begin" hook below instead of the driver.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        finally:
            cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Connection) -> None:
        read_only = connection.get_execution_options().get(READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
