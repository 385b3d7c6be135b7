"""Per-backend engine settings the registry's correctness depends on."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import event, func, make_url, select, text
from sqlalchemy.exc import InvalidRequestError, StatementError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import selectinload

from kvroute.store.engine import (
    READ_ONLY,
    DatabaseTimeouts,
    SessionMaker,
    autocommit_connection,
    create_engine,
    dispose,
    make_sessionmaker,
    reading,
)
from kvroute.store.faults import database_fault
from kvroute.store.models import DeploymentRow, RankRow
from tests.db.documents import T0, register, registration


async def test_sqlite_connections_enforce_foreign_keys_and_use_wal(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url, DatabaseTimeouts(sqlite_busy_seconds=1.5))
    try:
        async with engine.connect() as connection:
            pragmas = [
                await connection.scalar(text(f"PRAGMA {name}"))
                for name in ("foreign_keys", "journal_mode", "busy_timeout")
            ]
    finally:
        await engine.dispose()
    assert pragmas == [1, "wal", 1500]


def test_the_migrations_leave_a_sqlite_file_in_wal_mode(sqlite_url: str) -> None:
    path = make_url(sqlite_url).database
    assert path is not None
    with contextlib.closing(sqlite3.connect(path)) as plain:
        assert plain.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_a_sqlite_connection_opens_beside_a_reader(sqlite_url: str) -> None:
    """A connection that switched the file into WAL needed it to itself: beside a reader it
    failed with "database is locked" once its busy timeout ran out (CI, once). The file is WAL
    from its migrations on, so a connection opening beside a reader only reads the mode."""
    path = make_url(sqlite_url).database
    assert path is not None
    engine = create_engine(sqlite_url, DatabaseTimeouts(sqlite_busy_seconds=0.5))
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as reader:
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM ranks").fetchone()  # holds its read lock
        try:
            async with engine.connect() as connection:
                assert await connection.scalar(text("PRAGMA journal_mode")) == "wal"
        finally:
            reader.execute("COMMIT")
            await engine.dispose()


@pytest.mark.postgres
async def test_postgres_connections_carry_timeouts_and_plan_each_statement(
    postgres_test_url: str,
) -> None:
    """Timeouts, and custom plans: a generic plan cached while the deployment was small would
    be kept as it grows (see ``store.engine``)."""
    engine = create_engine(
        postgres_test_url, DatabaseTimeouts(statement_seconds=4.0, lock_seconds=1.5)
    )
    try:
        async with engine.connect() as connection:
            settings = [
                await connection.scalar(text(f"SHOW {name}"))
                for name in ("statement_timeout", "lock_timeout", "plan_cache_mode")
            ]
    finally:
        await engine.dispose()
    assert settings == ["4s", "1500ms", "force_custom_plan"]


async def test_sqlite_writers_serialize_and_readers_do_not_wait(sqlite_url: str) -> None:
    first, second = create_engine(sqlite_url), create_engine(sqlite_url)
    try:
        async with first.begin() as writer:
            await writer.execute(text("SELECT 1"))  # BEGIN IMMEDIATE: the write lock is now held
            async with second.connect() as reader:
                reader = await reader.execution_options(**{READ_ONLY: True})
                assert await reader.scalar(text("SELECT count(*) FROM deployments")) == 0
            beginning = asyncio.Event()
            event.listen(second.sync_engine, "before_cursor_execute", _noting_begin(beginning))
            blocked = asyncio.create_task(_begin_and_count(second))
            async with asyncio.timeout(10):
                await beginning.wait()  # the second writer asks for the lock the first holds
            assert not blocked.done()  # waits on the busy timeout instead of failing
        assert await asyncio.wait_for(blocked, timeout=10) == 0
    finally:
        await first.dispose()
        await second.dispose()


async def test_sqlite_autocommit_reads_take_no_write_lock(sqlite_url: str) -> None:
    """Plan reads and snapshots go through the autocommit companion: a BEGIN IMMEDIATE there made
    every one of them queue behind (and block) the writers."""
    engine = create_engine(sqlite_url, DatabaseTimeouts(sqlite_busy_seconds=0.2))
    other = create_engine(sqlite_url, DatabaseTimeouts(sqlite_busy_seconds=0.2))
    try:
        async with autocommit_connection(engine) as reader:
            assert await reader.scalar(text("SELECT count(*) FROM deployments")) == 0
            # The reader's connection is still checked out: a writer elsewhere must get the lock.
            assert await _begin_and_count(other) == 0
        async with other.begin() as writer:
            await writer.execute(text("SELECT 1"))
            async with autocommit_connection(engine) as reader:
                assert await reader.scalar(text("SELECT count(*) FROM deployments")) == 0
    finally:
        await dispose(engine)
        await other.dispose()


async def test_sqlite_writers_of_one_process_queue_for_one_connection(sqlite_url: str) -> None:
    """Writers wait in the pool's queue (first come, first served) rather than polling the file
    lock, for at most the busy timeout, which is then a busy database (503 database_busy); reads
    run beside a writer on their own pool."""
    engine = create_engine(sqlite_url, DatabaseTimeouts(sqlite_busy_seconds=0.3))
    sessionmaker = make_sessionmaker(engine)
    try:
        async with engine.begin() as writer:
            await writer.execute(text("SELECT 1"))
            async with reading(sessionmaker) as session:
                assert await session.scalar(select(func.count()).select_from(DeploymentRow)) == 0
            with pytest.raises(PoolTimeoutError) as waited:
                await _begin_and_count(engine)
        fault = database_fault(waited.value)
        assert fault is not None
        assert fault.busy
        assert await _begin_and_count(engine) == 0
    finally:
        await dispose(engine)


def _noting_begin(beginning: asyncio.Event) -> Callable[..., None]:
    """A ``before_cursor_execute`` hook setting ``beginning`` as the engine sends its BEGIN
    IMMEDIATE (on the loop's thread: SQLAlchemy's async engines run their hooks there)."""

    def hook(_connection: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement == "BEGIN IMMEDIATE":
            beginning.set()

    return hook


async def _begin_and_count(engine: AsyncEngine) -> int:
    async with engine.begin() as connection:
        return int(await connection.scalar(text("SELECT count(*) FROM deployments")) or 0)


async def test_timestamps_come_back_as_aware_utc(
    sessionmaker: SessionMaker, engine: AsyncEngine
) -> None:
    plus_two = datetime(2026, 1, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    async with sessionmaker.begin() as session:
        session.add(DeploymentRow(name="d", created_at=plus_two, checked_at=plus_two))

    async with reading(sessionmaker) as session:
        stored = await session.get(DeploymentRow, "d")
    assert stored is not None
    assert stored.created_at == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert stored.created_at.utcoffset() == timedelta(0)


async def test_naive_timestamps_are_refused(sessionmaker: SessionMaker) -> None:
    naive = datetime(2026, 1, 1, 12, 0)
    with pytest.raises(StatementError, match="naive datetime"):
        async with sessionmaker.begin() as session:
            session.add(DeploymentRow(name="d", created_at=naive, checked_at=naive))


async def test_relationships_never_load_implicitly(sessionmaker: SessionMaker) -> None:
    await register(
        sessionmaker,
        registration("llama", "ctx0", 0, memory={"backend": "local", "name": "p"}),
        now=T0,
    )
    key = ("llama", "ctx0", 0)
    async with reading(sessionmaker) as session:
        rank = await session.get(RankRow, key)
        assert rank is not None
        with pytest.raises(InvalidRequestError, match="lazy='raise'"):
            _ = rank.pools  # would be hidden I/O under asyncio
        loaded = await session.get(
            RankRow,
            key,
            options=[selectinload(RankRow.pools), selectinload(RankRow.views)],
            populate_existing=True,
        )
    assert loaded is not None
    assert [(pool.pool_id, pool.memory) for pool in loaded.pools] == [
        (0, {"backend": "local", "name": "p"})
    ]
    assert [view.num_layers for view in loaded.views] == [4]
