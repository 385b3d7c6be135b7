"""The job journal keeps a report the database could not take, and writes it once it can.

A replica frozen mid-write (SIGSTOP, a long GC pause, a saturated host) wakes to a statement that
timed out; before, the journal logged the report and dropped it, and the job read ``running``
from every replica until this one restarted. Here the database is made to refuse for real: another
connection holds the job's row (PostgreSQL) or the write lock (SQLite) past the journal's lock
timeout, then lets go.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from sqlalchemy.engine import make_url

from kvroute.control.transfers.journal import JobJournal
from kvroute.job_state import JobState
from kvroute.store import jobs
from kvroute.store.engine import DatabaseTimeouts, create_engine, dispose, make_sessionmaker
from kvroute.transfer.jobs import JobStatus
from tests.db.test_jobs import new_job

# Short enough that every held lock below costs the journal several failed attempts.
FAST_TIMEOUTS = DatabaseTimeouts(lock_seconds=0.1, sqlite_busy_seconds=0.1)
HELD_S = 1.0
STORED_WITHIN_S = 10.0


@asynccontextmanager
async def _held(database_url: str, job_id: str) -> AsyncIterator[None]:
    """Blocks writes to ``job_id``'s row from another connection for as long as the block runs."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        connection = sqlite3.connect(url.database or "", isolation_level=None)
        connection.execute("BEGIN IMMEDIATE")  # the write lock, for the whole block
        try:
            yield
        finally:
            connection.execute("ROLLBACK")
            connection.close()
        return
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute("SELECT 1 FROM transfer_jobs WHERE id = $1 FOR UPDATE", job_id)
            yield
    finally:
        await connection.close()


async def test_a_report_refused_by_the_database_is_stored_once_it_can_be(database_url) -> None:
    engine = create_engine(database_url, FAST_TIMEOUTS)
    sessionmaker = make_sessionmaker(engine)
    journal = JobJournal(sessionmaker, replica="r")
    journal.start()
    try:
        job = await new_job(sessionmaker, replica="r")
        running = JobStatus(job.id, JobState.RUNNING, started_at=1.0e9)

        async with _held(database_url, job.id):
            journal.on_update(running)
            await asyncio.sleep(HELD_S)  # several attempts, each refused by the lock
            assert (await jobs.get_job(sessionmaker, job.id)).state == "queued"

        async with asyncio.timeout(STORED_WITHIN_S):
            await journal.flush()
        stored = await jobs.get_job(sessionmaker, job.id)
        assert stored.state == "running"
        assert stored.started_at is not None
        assert stored.started_at.timestamp() == 1.0e9
    finally:
        await journal.close(grace_seconds=1.0)
        await dispose(engine)
