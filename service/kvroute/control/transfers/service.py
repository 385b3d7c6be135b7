"""Transfer jobs as the REST layer sees them: checked requests in, durable job records out.

The facade over three parts the worker pool knows nothing about: leg resolution (``legs``: plans
from the registry, pool memory opened at the plans' generations, block ids checked), the journal
(``journal``: one row per job, written before the job is queued) and the worker pool itself. A
request that cannot run is refused before anything is stored or queued; one the pool refuses
(queue full, draining) loses its row again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from datetime import datetime

from prometheus_client import CollectorRegistry

from kvroute import wire
from kvroute.control.plans import PlanService
from kvroute.control.transfers.journal import JobJournal
from kvroute.control.transfers.legs import Leg, LegResolver, job_memories
from kvroute.control.transfers.pool_sweep import PoolSweep
from kvroute.geometry import TokenRange, TokenRangeError, TokenWindow
from kvroute.job_state import JobState
from kvroute.store import jobs
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import Conflict, InvalidTransition
from kvroute.transfer.engine import CopyEngine
from kvroute.transfer.errors import TransferValidationError, UnknownJob
from kvroute.transfer.jobs import CopyResult, TransferJob, validation_error
from kvroute.transfer.metrics import pool_gauges
from kvroute.transfer.opened import PoolMemoryCache
from kvroute.transfer.workers import DrainReport, WorkerPool, system_clock

log = logging.getLogger(__name__)

CANCELLED = "cancelled before it started"


class ForeignJob(Conflict):
    """The job is queued or running in another kvroute process; only that one can cancel it."""


class TransferService:
    """Owns the worker pool, the opened pool memory and the job rows of this process."""

    def __init__(
        self,
        sessionmaker: SessionMaker,
        plans: PlanService,
        *,
        workers: int,
        queue_size: int,
        registry: CollectorRegistry,
        engine: CopyEngine | None = None,
        memories: PoolMemoryCache | None = None,
        replica: str = "",
        clock: Callable[[], datetime] = system_clock,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.workers = workers
        self._memories = memories if memories is not None else PoolMemoryCache()
        self._legs = LegResolver(plans, self._memories)
        self._journal = JobJournal(sessionmaker, replica=replica)
        self.pool = WorkerPool(
            workers,
            queue_size,
            registry,
            engine=engine,
            on_update=self._journal.on_update,
            on_done=self._release,
            clock=clock,
        )
        self.pools = PoolSweep(sessionmaker, self._memories)
        pool_gauges(registry, self._memories)

    async def start(self, *, now: datetime) -> None:
        """Start the workers and fail the jobs a previous process left in flight.

        An unreachable database must not stop the app from starting (readiness reports it);
        recovery is then retried before the first submission, which needs the database anyway.
        """
        await self.pool.start()
        self._journal.start()
        try:
            await self._journal.recover(now)
        except Exception:
            log.warning("could not fail interrupted transfer jobs yet; retrying on submit")

    async def close(self, grace_seconds: float) -> DrainReport:
        """Drain the pool, store the final states it reported, then release the pool memory."""
        report = await self.pool.drain(grace_seconds)
        await self._journal.close(grace_seconds)
        self._memories.close()
        return report

    async def settled(self, job_id: str) -> None:
        """Waits until this process's pool finished ``job_id`` and its final report is stored."""
        await self.pool.handle(job_id)
        await self._journal.flush()

    def readiness(self) -> str:
        """``ok``, or why this process cannot take transfer jobs now."""
        if not self.pool.accepting:
            return "the transfer worker pool is not accepting jobs"
        alive = self.pool.alive_workers
        if alive < self.workers:
            return f"{alive} of {self.workers} transfer workers alive"
        return "ok"

    async def submit(
        self, deployment: str, request: wire.TransferRequest, *, now: datetime
    ) -> wire.TransferJob:
        """Check, store and queue one job; raises before storing anything when it cannot run."""
        window = _window(request)
        await self._journal.recover(now)
        legs = await self._legs.legs(deployment, request, now=now)
        if window.pairs_blocks:
            _check_pairs(request, legs)
        opened = await asyncio.to_thread(self._legs.open, deployment, request, legs)
        queued = False
        try:
            job = TransferJob(
                opened,
                request.src_blocks,
                request.dst_blocks,
                str(uuid.uuid4()),
                window=window,
                src_state_slot=request.src_state_slot,
                dst_state_slot=request.dst_state_slot,
            )
            # Splits the job into its copies (refusing a gap) and counts what they move.
            totals = self.pool.engine.totals(job)
            row = _row(deployment, request, legs, totals)
            record = await self._journal.create(job.job_id, row, now=now)
            try:
                await self.pool.submit(job)
                queued = True  # from here the pool releases the job's pools as it ends
            except BaseException:
                await self._journal.discard(job.job_id)
                raise
        finally:
            if not queued:
                self._memories.release(job_memories(opened))
        return record

    def _release(self, job: TransferJob) -> None:
        self._memories.release(job_memories(job.legs))

    async def cancel(self, job_id: str, *, now: datetime) -> wire.TransferJob:
        """Cancel a job queued in this process; ``Conflict`` once it runs, ended or lives elsewhere."""
        record = await jobs.get_job(self._sessionmaker, job_id)
        if JobState(record.state).terminal:
            raise InvalidTransition(f"transfer job {job_id} already {record.state}")
        try:
            cancelled = self.pool.cancel(job_id)
        except UnknownJob:
            raise ForeignJob(
                f"transfer job {job_id} is {record.state} in another kvroute process; "
                "only the process that accepted it can cancel it"
            ) from None
        if not cancelled:
            raise InvalidTransition(f"transfer job {job_id} is already running; it cannot stop")
        try:
            return await jobs.set_state(
                self._sessionmaker, job_id, JobState.CANCELLED, now=now, error=CANCELLED
            )
        except InvalidTransition:
            # The writer stored the pool's own report of this cancellation first.
            return await jobs.get_job(self._sessionmaker, job_id)


def _row(
    deployment: str, request: wire.TransferRequest, legs: list[Leg], totals: CopyResult
) -> jobs.NewJob:
    """The job's row: the request as given, the plans it ran on and what its copies move."""
    fingerprint = ",".join(leg.copy_plan.fingerprint for leg in legs)
    return jobs.NewJob(deployment, request, fingerprint, totals.bytes, totals.fragments)


def _check_pairs(request: wire.TransferRequest, legs: list[Leg]) -> None:
    """Lists without token members pair up one to one where both sides' blocks are one size
    (view pairs planned by period then hold the tokens both lists cover, checked per job)."""
    periodic = any(view.periodic for leg in legs for p in leg.copy_plan.senders for view in p.views)
    if not periodic and len(request.src_blocks) != len(request.dst_blocks):
        raise TransferValidationError(
            "dst_blocks",
            f"has {len(request.dst_blocks)} block ids but src_blocks has "
            f"{len(request.src_blocks)}; they pair up one to one",
        )


def _window(request: wire.TransferRequest) -> TokenWindow:
    """The request's token members as the one type the data plane takes, checked there."""
    given = request.tokens
    try:
        return TokenWindow(
            None if given is None else TokenRange(given.start, given.end),
            request.src_first_token,
            request.dst_first_token,
            request.prompt_tokens,
        )
    except TokenRangeError as error:
        raise validation_error(error) from error
