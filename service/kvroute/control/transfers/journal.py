"""The job journal: every transfer job is a row of ``transfer_jobs`` before it can run.

A job's row is written first and the job is queued second, under the row's id: a process that dies
with a job queued or running leaves a row that its next start marks interrupted, so no job ever ran
unrecorded and any replica can answer ``GET`` for it. The worker pool's state changes reach the
rows through one writer task, in the order the pool reported them. A report the database could
not take (a timeout, a lock wait, a broken connection) is written again until it lands: a report
dropped there left its job ``running`` in every replica's answer until this replica restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from datetime import UTC, datetime

from kvroute import wire
from kvroute.job_state import JobState
from kvroute.store import jobs
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import InvalidTransition
from kvroute.store.faults import database_fault
from kvroute.transfer.jobs import JobStatus

log = logging.getLogger(__name__)

# Backoff between attempts at one report while the database is in trouble: short at first (a
# statement cut by a stalled process succeeds at once), then once a second, without end (close()
# cancels the writer; the next start fails whatever is still in flight).
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


class JobJournal:
    """This replica's job rows: created before queueing, moved by the pool's reports."""

    def __init__(self, sessionmaker: SessionMaker, *, replica: str) -> None:
        self._sessionmaker = sessionmaker
        self._replica = replica
        self._updates: asyncio.Queue[JobStatus] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        # Rows left queued/running by a previous process are failed once, before the first job.
        self._recovery = asyncio.Lock()
        self._recovered = False

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_updates(), name="kvroute-transfer-writer")

    async def recover(self, now: datetime) -> None:
        """Fails the jobs this replica's previous process left in flight (once per process)."""
        async with self._recovery:
            if self._recovered:
                return
            interrupted = await jobs.mark_interrupted(
                self._sessionmaker, now=now, replica=self._replica
            )
            self._recovered = True
        if interrupted:
            log.warning("marked %d transfer jobs of a previous process failed", interrupted)

    async def create(self, job_id: str, new: jobs.NewJob, *, now: datetime) -> wire.TransferJob:
        return await jobs.create_job(
            self._sessionmaker, new, now=now, replica=self._replica, job_id=job_id
        )

    async def discard(self, job_id: str) -> None:
        """Forgets the row of a job the pool refused to queue; it never ran."""
        try:
            await jobs.discard_job(self._sessionmaker, job_id)
        except Exception:
            # The row stays queued; this replica's next start marks it interrupted.
            log.warning("could not discard refused transfer job %s", job_id, exc_info=True)

    def on_update(self, status: JobStatus) -> None:
        """The pool's report callback (runs on the event loop)."""
        self._updates.put_nowait(status)

    async def flush(self) -> None:
        """Waits until every report the pool made so far is stored (or failed to store)."""
        await asyncio.sleep(0)  # reports published from worker threads are scheduled on this loop
        await self._updates.join()

    async def close(self, grace_seconds: float) -> None:
        """Stores the reports already queued (bounded by ``grace_seconds``), then stops writing."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_seconds):
                await self.flush()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer

    async def _write_updates(self) -> None:
        while True:
            status = await self._updates.get()
            try:
                await self._store_until_stored(status)
            except Exception:
                # Not a database fault but a bug: the row stays behind; the next start fails it.
                log.exception("could not store transfer job %s update", status.job_id)
            finally:
                self._updates.task_done()

    async def _store_until_stored(self, status: JobStatus) -> None:
        pause = RETRY_FIRST_S
        for attempt in itertools.count(1):
            try:
                await self._store(status)
                return
            except Exception as error:
                fault = database_fault(error)
                if fault is None:
                    raise
                log.warning(
                    "transfer job %s: %s not stored (attempt %d, %s); retrying in %.2f s",
                    status.job_id,
                    status.state,
                    attempt,
                    fault.cause,
                    pause,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_S)

    async def _store(self, status: JobStatus) -> None:
        if status.state is JobState.QUEUED:
            return  # the row was created queued
        at = status.started_at if status.state is JobState.RUNNING else status.finished_at
        try:
            await jobs.set_state(
                self._sessionmaker, status.job_id, status.state, now=_utc(at), error=status.error
            )
        except InvalidTransition:
            log.debug(
                "transfer job %s is already final; %s not stored", status.job_id, status.state
            )


def _utc(stamp: float | None) -> datetime:
    return datetime.fromtimestamp(stamp, UTC) if stamp is not None else datetime.now(UTC)
