"""Engines and sessionmakers with the per-backend settings kvroute's correctness relies on.

SQLite (the embedded default) needs three things switched on per connection: foreign keys (off by
default, and the pool/view tables rely on ON DELETE CASCADE), WAL (readers keep reading while one
writer commits) and a bounded busy timeout (writers wait for the lock a while, then fail with
"database is locked", which the API answers as 503 ``database_busy``). Its driver's legacy
transaction handling is replaced by explicit ``BEGIN IMMEDIATE``, so every transaction that may
write takes the database write lock up front: registrations of one deployment then serialize across
processes exactly like PostgreSQL's advisory lock makes them, and no transaction ever has to
upgrade a read lock (which SQLite answers with an immediate "database is locked").

Read-only work opts into a deferred ``BEGIN`` through :func:`reading`, on a pool of its own, so
reads never queue behind writers. Writers of one process share one connection: SQLite has one
writer anyway, and waiting for that connection in the pool's queue is first come, first served,
where waiting on the file lock is polling with sleeps that grow to 100 ms (16 clients' heartbeats
then saw p99 latencies near a second). Other processes on the same file still meet the busy
timeout.

PostgreSQL gets a server-side ``statement_timeout`` and ``lock_timeout`` (the registration advisory
lock included) and, because a frozen server or a silent network enforces nothing, client-side
bounds too: asyncpg's connect timeout and per-statement ``command_timeout``, and the pool's wait for
a connection. No database call can then hang a request for longer than its timeouts.

PostgreSQL connections also plan every statement for its parameters (``plan_cache_mode =
force_custom_plan``). asyncpg prepares each statement once per connection, and after five
executions the server may switch to a generic plan that it then keeps for the connection's life.
A deployment's first statements run while its tables hold a few rows, where a scan of every rank
of the deployment through any index that starts with ``deployment`` costs as little as the right
probe; kept while the fleet grew, such a plan made each admission read the whole deployment (8,192
ranks: a registration batch 4x slower in the last quarter than in the first). Tables that grow
faster than autovacuum analyzes them (or where it is off) would not re-plan either. A custom plan
costs a fraction of a millisecond of planning per statement and follows the tables' sizes; the
statistics it needs are kept fresh by ``store.statistics``.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import event, text
from sqlalchemy.engine import Connection, CursorResult, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.sql import Executable

from kvroute.store import sqlite_cursor

# Enough connections for the concurrent requests of one process without churn: an overflow
# connection is closed on return, and opening one costs several round trips (and TLS probing).
POOL_SIZE = 24
POOL_OVERFLOW = 16
# Execution option naming a transaction that will not write (SQLite then begins it deferred).
READ_ONLY = "kvroute_read_only"
# The client gives the server this long past its own statement_timeout to report it first.
CLIENT_TIMEOUT_MARGIN_S = 1.0
# ``create_engine`` keyword: the engine's transactions write (on SQLite: one shared connection).
_SQLITE_WRITER = "kvroute_sqlite_writer"

# Each SQLite connection's page cache, taken as pages are read. SQLite's default (2 MiB) holds a
# few hundred ranks' rows: at 8,192 ranks a heartbeat cost 2.6x its CPU at 1,024 in page reads,
# and with 64 MiB the same (0.35 ms), for about 100 MiB more resident at that size
# (bench/scale_bench.py --sizes 1024,8192 --configs sqlite).
SQLITE_CACHE_KIB = 64 * 1024

SessionMaker = async_sessionmaker[AsyncSession]
Engine = AsyncEngine  # the name the layers above use, so they need not import SQLAlchemy
_AUTOCOMMIT: weakref.WeakKeyDictionary[AsyncEngine, AsyncEngine] = weakref.WeakKeyDictionary()
_READERS: weakref.WeakKeyDictionary[AsyncEngine, AsyncEngine] = weakref.WeakKeyDictionary()
# Each engine's timeouts, so its autocommit companion is bounded exactly like it.
_TIMEOUTS: weakref.WeakKeyDictionary[AsyncEngine, DatabaseTimeouts] = weakref.WeakKeyDictionary()
T = TypeVar("T")


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
    engine_kwargs.setdefault(_SQLITE_WRITER, "isolation_level" not in engine_kwargs)
    if parsed.get_backend_name() == "sqlite":
        if engine_kwargs.pop(_SQLITE_WRITER, False) and parsed.database not in (
            None,
            "",
            ":memory:",
        ):
            engine_kwargs.update(
                pool_size=1, max_overflow=0, pool_timeout=timeouts.sqlite_busy_seconds
            )
        if parsed.get_driver_name() == "aiosqlite" and sqlite_cursor.one_hop_supported():
            engine_kwargs.setdefault("module", sqlite_cursor.dbapi())
        engine = create_async_engine(parsed, **engine_kwargs)
        _configure_sqlite(
            engine,
            busy_ms=round(timeouts.sqlite_busy_seconds * 1000),
            autocommit=engine_kwargs.get("isolation_level") == "AUTOCOMMIT",
        )
        _TIMEOUTS[engine] = timeouts
        return engine
    # No pre-ping: it costs a BEGIN/ROLLBACK round trip on every checkout of the hot paths. A
    # connection a PostgreSQL restart left dead fails its first statement instead; SQLAlchemy then
    # invalidates the whole pool and ``retry_disconnect`` runs the unit of work once more.
    engine_kwargs.pop(_SQLITE_WRITER)
    engine_kwargs.setdefault("pool_size", POOL_SIZE)
    engine_kwargs.setdefault("max_overflow", POOL_OVERFLOW)
    engine_kwargs.setdefault("connect_args", _postgres_connect_args(timeouts))
    engine = create_async_engine(parsed, **engine_kwargs)
    _TIMEOUTS[engine] = timeouts
    return engine


def _postgres_connect_args(timeouts: DatabaseTimeouts) -> dict[str, Any]:
    return {
        "timeout": timeouts.connect_seconds,
        "command_timeout": timeouts.statement_seconds + CLIENT_TIMEOUT_MARGIN_S,
        "server_settings": {
            "statement_timeout": str(round(timeouts.statement_seconds * 1000)),
            "lock_timeout": str(round(timeouts.lock_seconds * 1000)),
            "plan_cache_mode": "force_custom_plan",
        },
    }


async def retry_disconnect(work: Callable[[], Awaitable[T]]) -> T:
    """Runs ``work``; once more if its connection turned out dead (the pool is refreshed then).

    Safe for every unit of work kvroute has: a transaction cut by a dead connection was rolled
    back by the server, and the ones whose COMMIT may have landed are idempotent (re-registering
    the same document renews it; renewing a lease twice extends it to the same instant).
    """
    try:
        return await work()
    except DBAPIError as error:
        if not error.connection_invalidated:
            raise
    return await work()


def make_sessionmaker(engine: AsyncEngine) -> SessionMaker:
    """Sessions whose loaded objects stay usable after commit (no implicit refresh I/O)."""
    return async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def reading(sessionmaker: SessionMaker) -> AsyncIterator[AsyncSession]:
    """A session for one read-only unit of work; on SQLite it does not take the write lock."""
    async with sessionmaker(bind=reader_engine(engine_of(sessionmaker))) as session:
        await session.connection(execution_options={READ_ONLY: True})
        yield session


async def ping(sessionmaker: SessionMaker) -> None:
    """One round trip to the database (readiness): raises whatever the driver raises."""
    async with autocommit_connection(engine_of(sessionmaker)) as connection:
        await connection.execute(text("SELECT 1"))


def engine_of(sessionmaker: SessionMaker) -> AsyncEngine:
    return cast("AsyncEngine", sessionmaker.kw["bind"])


@asynccontextmanager
async def autocommit_connection(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A Core connection in autocommit mode for single-statement reads on hot paths.

    No BEGIN, no ROLLBACK, no ORM session: one round trip per statement. Each statement sees its
    own snapshot, so a read that must be consistent across tables is one (joined) statement.
    """
    async with autocommit_engine(engine).connect() as connection:
        yield connection


def autocommit_engine(engine: AsyncEngine) -> AsyncEngine:
    """The companion engine of ``engine`` whose connections are in autocommit mode from birth.

    A pool of its own: switching a pooled connection's isolation level on every checkout (and
    back on return) costs more than the single statement it is checked out for.
    """
    companion = _AUTOCOMMIT.get(engine)
    if companion is None:
        timeouts = _TIMEOUTS.get(engine) or DatabaseTimeouts()
        extra: dict[str, Any] = {}
        if engine.dialect.name == "postgresql":
            # Its only writes are lease renewals: soft state a worker repeats every lease/3. Not
            # waiting for each one's WAL flush is what lets a fleet's heartbeats through; a
            # PostgreSQL crash can forget the last few hundred milliseconds of renewals, which
            # shortens those leases and nothing else. Registrations keep synchronous commits.
            args = _postgres_connect_args(timeouts)
            args["server_settings"]["synchronous_commit"] = "off"
            extra["connect_args"] = args
        companion = create_engine(
            engine.url.render_as_string(hide_password=False),
            timeouts,
            isolation_level="AUTOCOMMIT",
            **extra,
        )
        _AUTOCOMMIT[engine] = companion
    return companion


def reader_engine(engine: AsyncEngine) -> AsyncEngine:
    """Where read-only transactions of ``engine`` run: on SQLite a companion pool, so they never
    wait for its one writer connection; elsewhere ``engine`` itself."""
    if engine.dialect.name != "sqlite":
        return engine
    companion = _READERS.get(engine)
    if companion is None:
        url = engine.url.render_as_string(hide_password=False)
        timeouts = _TIMEOUTS.get(engine) or DatabaseTimeouts()
        companion = create_engine(url, timeouts, **{_SQLITE_WRITER: False})
        _READERS[engine] = companion
    return companion


async def dispose(engine: AsyncEngine) -> None:
    """Closes the pools of ``engine`` and of its companions."""
    for companions in (_AUTOCOMMIT, _READERS):
        companion = companions.pop(engine, None)
        if companion is not None:
            await companion.dispose()
    await engine.dispose()


async def affected_rows(session: AsyncSession, statement: Executable) -> int:
    """Executes an UPDATE or DELETE and returns how many rows it touched."""
    result = await session.execute(statement)
    return cast("CursorResult[Any]", result).rowcount


def _configure_sqlite(engine: AsyncEngine, *, busy_ms: int, autocommit: bool) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to the "begin" hook below instead of the driver.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA cache_size={-SQLITE_CACHE_KIB}")  # negative: KiB, not pages
            cursor.execute("PRAGMA journal_mode")
            if cursor.fetchone()[0] != "wal":
                # The migrations make every file WAL while nothing else is connected; a file
                # they did not make is switched here. Switching needs the file to itself, so it is
                # never asked for where the file is WAL already.
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()

    if autocommit:
        # Each statement is its own transaction: a BEGIN here would turn every autocommit read
        # into a write-lock holder until the connection goes back to the pool.
        return

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Connection) -> None:
        read_only = connection.get_execution_options().get(READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")
