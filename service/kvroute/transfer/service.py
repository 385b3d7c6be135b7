"""Transfer jobs as the REST layer sees them: checked requests in, durable job records out.

Between HTTP and the worker pool sit three concerns the pool knows nothing about: plans come from
the registry (``PlanService``, so a job never runs a plan of a rank that re-registered), pool memory
is opened from the descriptors stored at the plan's generations, and every job is a row of
``transfer_jobs`` so any replica can answer ``GET``. A request is refused before anything is
queued or stored; the pool's state changes then reach the database through one writer task, in
the order the pool reported them.

The pool names jobs by its own ids and the database by its own; a job is submitted first and
stored second, so a refused submission (queue full, draining) leaves no row behind. The writer
waits for the row of a job whose first report overtakes its ``create_job``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from prometheus_client import CollectorRegistry

from kvroute.geometry import Pool, RankRegistration
from kvroute.plans import PlanKey, PlanService, PlanUnavailable, ServedPlan
from kvroute.store import jobs
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import Conflict, InvalidTransition
from kvroute.store.models import JobState as StoredState
from kvroute.store.records import TransferJobRecord
from kvroute.store.snapshots import rank_documents
from kvroute.transfer.engine import CopyEngine
from kvroute.transfer.errors import PoolMemoryError, TransferValidationError
from kvroute.transfer.jobs import JobState, JobStatus, TransferJob, TransferLeg
from kvroute.transfer.memory import PoolMemory, PoolMemoryCache
from kvroute.transfer.plan import CopyPlan
from kvroute.transfer.workers import DrainReport, WorkerPool

log = logging.getLogger(__name__)

RankKey = tuple[str, int, int]  # instance, rank, generation
_BlockTarget = tuple[str, tuple[int, ...], str, int, Pool]  # list name, ids, instance, rank, pool
K = TypeVar("K")
V = TypeVar("V")
COPY_PLAN_CACHE_SIZE = 1024  # compiled plans are immutable, keyed by fingerprint
POOL_CACHE_SIZE = 4096  # rank documents at one generation never change
CANCELLED = "cancelled before it started"


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """One ``POST /v1/deployments/{d}/transfers`` body, after schema validation."""

    deployment: str
    sender: str
    receiver: str
    receiver_ranks: tuple[int, ...]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    sender_dp_rank: int = 0


class RankPoolMemoryError(PoolMemoryError):
    """A pool of a named rank cannot be opened by this process."""

    def __init__(self, error: PoolMemoryError, instance: str, rank: int) -> None:
        super().__init__(error.pool_id, error.backend, error.reason)
        self.instance = instance
        self.rank = rank

    def __str__(self) -> str:
        return (
            f"pool {self.pool_id} of {self.instance} rank {self.rank} ({self.backend} memory): "
            f"{self.reason}"
        )


class ForeignJob(Conflict):
    """The job is queued or running in another kvroute process; only that one can cancel it."""


@dataclass(frozen=True, slots=True)
class _Leg:
    """One receiver rank's plan with the pools of its rank documents (memory not yet opened)."""

    copy_plan: CopyPlan
    receiver_rank: int
    sender_pools: dict[tuple[int, int], Pool]  # (sender rank, pool id)
    receiver_pools: dict[int, Pool]


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
    ) -> None:
        self._sessionmaker = sessionmaker
        self._replica = replica
        self._plans = plans
        self.workers = workers
        self.pool = WorkerPool(
            workers, queue_size, registry, engine=engine, on_update=self._on_update
        )
        self._memories = memories if memories is not None else PoolMemoryCache()
        self._copy_plans: OrderedDict[str, CopyPlan] = OrderedDict()
        self._rank_pools: OrderedDict[tuple[str, str, int, int], tuple[Pool, ...]] = OrderedDict()
        self._updates: asyncio.Queue[JobStatus] = asyncio.Queue()
        self._row_ids: dict[str, asyncio.Future[str]] = {}  # pool job id -> row id, once stored
        self._pool_ids: dict[str, str] = {}  # row id -> pool job id, while the job is not final
        self._writer: asyncio.Task[None] | None = None
        # Rows left queued/running by a previous process are failed once, before the first job.
        self._recovery = asyncio.Lock()
        self._recovered = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, *, now: datetime) -> None:
        """Start the workers and fail the jobs a previous process left in flight.

        An unreachable database must not stop the app from starting (readiness reports it);
        recovery is then retried before the first submission, which needs the database anyway.
        """
        await self.pool.start()
        self._writer = asyncio.create_task(self._write_updates(), name="kvroute-transfer-writer")
        try:
            await self._recover(now)
        except Exception:
            log.warning("could not fail interrupted transfer jobs yet; retrying on submit")

    async def _recover(self, now: datetime) -> None:
        async with self._recovery:
            if self._recovered:
                return
            interrupted = await jobs.mark_interrupted(
                self._sessionmaker, now=now, replica=self._replica
            )
            self._recovered = True
        if interrupted:
            log.warning("marked %d transfer jobs of a previous process failed", interrupted)

    async def close(self, grace_seconds: float) -> DrainReport:
        """Drain the pool, store the final states it reported, then release the pool memory."""
        report = await self.pool.drain(grace_seconds)
        await asyncio.sleep(0)  # the drain's reports are scheduled on this loop; let them queue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_seconds):
                await self._updates.join()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        self._memories.close()
        return report

    def readiness(self) -> str:
        """``ok``, or why this process cannot take transfer jobs now."""
        if not self.pool.accepting:
            return "the transfer worker pool is not accepting jobs"
        alive = self.pool.alive_workers
        if alive < self.workers:
            return f"{alive} of {self.workers} transfer workers alive"
        return "ok"

    # -- requests ------------------------------------------------------------------------------

    async def submit(self, request: TransferRequest, *, now: datetime) -> TransferJobRecord:
        """Check, queue and store one job; raises before queueing anything when it cannot run."""
        if len(request.src_blocks) != len(request.dst_blocks):
            raise TransferValidationError(
                "dst_blocks",
                f"has {len(request.dst_blocks)} block ids but src_blocks has "
                f"{len(request.src_blocks)}; they pair up one to one",
            )
        await self._recover(now)
        legs = [await self._leg(request, rank, now) for rank in request.receiver_ranks]
        for leg in legs:
            _check_blocks(request, leg)
        opened = await asyncio.to_thread(self._open_legs, request, legs)
        job = TransferJob(opened, request.src_blocks, request.dst_blocks)
        handle = await self.pool.submit(job)
        # No await between submit and this line: the pool's first report cannot overtake it.
        row_id: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._row_ids[handle.job_id] = row_id
        try:
            record = await jobs.create_job(
                self._sessionmaker,
                deployment=request.deployment,
                sender=request.sender,
                receiver=request.receiver,
                receiver_ranks=request.receiver_ranks,
                src_blocks=request.src_blocks,
                dst_blocks=request.dst_blocks,
                plan_fingerprint=",".join(leg.copy_plan.fingerprint for leg in legs),
                bytes_total=job.num_blocks * sum(leg.copy_plan.bytes_per_block for leg in legs),
                fragments=job.num_blocks * sum(leg.copy_plan.fragments_per_block for leg in legs),
                now=now,
                replica=self._replica,
            )
        except BaseException:
            # Unrecorded, the job must not run: nobody could ever learn its outcome.
            self.pool.cancel(handle.job_id)
            row_id.cancel()
            self._row_ids.pop(handle.job_id, None)
            raise
        self._pool_ids[record.id] = handle.job_id
        row_id.set_result(record.id)
        return record

    async def cancel(self, job_id: str, *, now: datetime) -> TransferJobRecord:
        """Cancel a job queued in this process; ``Conflict`` once it runs, ended or lives elsewhere."""
        record = await jobs.get_job(self._sessionmaker, job_id)
        if StoredState(record.state).terminal:
            raise InvalidTransition(f"transfer job {job_id} already {record.state}")
        pool_id = self._pool_ids.get(job_id)
        if pool_id is None:
            raise ForeignJob(
                f"transfer job {job_id} is {record.state} in another kvroute process; "
                "only the process that accepted it can cancel it"
            )
        if not self.pool.cancel(pool_id):
            raise InvalidTransition(f"transfer job {job_id} is already running; it cannot stop")
        try:
            return await jobs.set_state(
                self._sessionmaker, job_id, StoredState.CANCELLED, now=now, error=CANCELLED
            )
        except InvalidTransition:
            # The writer stored the pool's own report of this cancellation first.
            return await jobs.get_job(self._sessionmaker, job_id)

    # -- plans and pools -----------------------------------------------------------------------

    async def _leg(self, request: TransferRequest, receiver_rank: int, now: datetime) -> _Leg:
        key = PlanKey(
            request.deployment,
            request.sender,
            request.receiver,
            receiver_rank,
            request.sender_dp_rank,
        )
        served = await self._plans.get(key, now=now)
        copy_plan = self._copy_plan(served)
        senders = {rank for rank, _ in _sending_pools(copy_plan)}
        wanted = [(request.sender, rank, served.sender_generations[rank]) for rank in senders]
        wanted.append((request.receiver, receiver_rank, served.receiver_generation))
        pools = await self._pools(request.deployment, wanted)
        return _Leg(
            copy_plan,
            receiver_rank,
            {
                (rank, pool.pool_id): pool
                for rank in senders
                for pool in pools[request.sender, rank]
            },
            {pool.pool_id: pool for pool in pools[request.receiver, receiver_rank]},
        )

    def _copy_plan(self, served: ServedPlan) -> CopyPlan:
        fingerprint = served.plan.fingerprint
        copy_plan = self._copy_plans.get(fingerprint)
        if copy_plan is None:
            copy_plan = CopyPlan.from_plan(served.plan)
            _remember(self._copy_plans, fingerprint, copy_plan, COPY_PLAN_CACHE_SIZE)
        return copy_plan

    async def _pools(
        self, deployment: str, wanted: Sequence[RankKey]
    ) -> dict[tuple[str, int], tuple[Pool, ...]]:
        """Each rank's pools at the generation its plan was built from."""
        found: dict[tuple[str, int], tuple[Pool, ...] | None] = {
            (instance, rank): self._rank_pools.get((deployment, instance, rank, generation))
            for instance, rank, generation in wanted
        }
        missing = [key for key in wanted if found[key[0], key[1]] is None]
        documents = await rank_documents(self._sessionmaker, deployment, missing)
        for instance, rank, generation in missing:
            document = documents.get((instance, rank))
            if document is None:
                raise PlanUnavailable(
                    f"{instance} rank {rank} re-registered or left while the job was checked; retry"
                )
            registration = RankRegistration.from_json(
                document, deployment=deployment, instance=instance, rank=rank
            )
            found[instance, rank] = registration.pools
            key = (deployment, instance, rank, generation)
            _remember(self._rank_pools, key, registration.pools, POOL_CACHE_SIZE)
        return {key: pools for key, pools in found.items() if pools is not None}

    def _open_legs(self, request: TransferRequest, legs: Iterable[_Leg]) -> list[TransferLeg]:
        """Maps every pool a job touches (blocking: a backend may map memory or a device)."""
        opened = []
        for leg in legs:
            src = {
                (rank, pool_id): self._open(leg.sender_pools[rank, pool_id], request.sender, rank)
                for rank, pool_id in _sending_pools(leg.copy_plan)
            }
            dst = {
                pool_id: self._open(
                    leg.receiver_pools[pool_id], request.receiver, leg.receiver_rank
                )
                for pool_id in _receiving_pools(leg.copy_plan)
            }
            opened.append(TransferLeg(leg.copy_plan, src, dst))
        return opened

    def _open(self, pool: Pool, instance: str, rank: int) -> PoolMemory:
        try:
            return self._memories.open_pool(pool.memory, pool)
        except PoolMemoryError as error:
            raise RankPoolMemoryError(error, instance, rank) from error

    # -- the pool's reports -> the job rows ----------------------------------------------------

    def _on_update(self, status: JobStatus) -> None:
        self._updates.put_nowait(status)

    async def _write_updates(self) -> None:
        while True:
            status = await self._updates.get()
            try:
                await self._store(status)
            except Exception:
                # A lost update leaves the row behind the pool; the next start fails it.
                log.warning("could not store transfer job %s update", status.job_id, exc_info=True)
            finally:
                self._updates.task_done()

    async def _store(self, status: JobStatus) -> None:
        if status.state is JobState.QUEUED:
            return  # the row is created queued
        row_id_future = self._row_ids.get(status.job_id)
        if row_id_future is None:
            return
        try:
            row_id = await asyncio.shield(row_id_future)
        except asyncio.CancelledError:
            if row_id_future.cancelled():
                return  # never stored: its submission failed
            raise
        state = StoredState(status.state.value)
        at = status.started_at if state is StoredState.RUNNING else status.finished_at
        try:
            await jobs.set_state(
                self._sessionmaker, row_id, state, now=_utc(at), error=status.error
            )
        except InvalidTransition:
            log.debug("transfer job %s is already final; %s not stored", row_id, state)
        finally:
            if state.terminal:  # the pool forgets the job too; even a failed write ends it here
                self._row_ids.pop(status.job_id, None)
                self._pool_ids.pop(row_id, None)


def _sending_pools(plan: CopyPlan) -> list[tuple[int, int]]:
    return sorted({(peer.rank, view.src_pool) for peer in plan.senders for view in peer.views})


def _receiving_pools(plan: CopyPlan) -> list[int]:
    return sorted({view.dst_pool for peer in plan.senders for view in peer.views})


def _block_targets(request: TransferRequest, leg: _Leg) -> Iterator[_BlockTarget]:
    for rank, pool_id in _sending_pools(leg.copy_plan):
        pool = leg.sender_pools[rank, pool_id]
        yield "src_blocks", request.src_blocks, request.sender, rank, pool
    for pool_id in _receiving_pools(leg.copy_plan):
        pool = leg.receiver_pools[pool_id]
        yield "dst_blocks", request.dst_blocks, request.receiver, leg.receiver_rank, pool


def _check_blocks(request: TransferRequest, leg: _Leg) -> None:
    """Every block id within every pool it addresses; names the id, the pool and its rank."""
    for name, blocks, instance, rank, pool in _block_targets(request, leg):
        if min(blocks) >= 0 and max(blocks) < pool.num_slots:
            continue
        index = next(i for i, block in enumerate(blocks) if not 0 <= block < pool.num_slots)
        raise TransferValidationError(
            f"{name}[{index}]",
            f"block id {blocks[index]} is outside pool {pool.pool_id} of {instance} rank {rank} "
            f"(num_slots {pool.num_slots})",
        )


def _remember(cache: OrderedDict[K, V], key: K, value: V, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def _utc(stamp: float | None) -> datetime:
    return datetime.fromtimestamp(stamp, UTC) if stamp is not None else datetime.now(UTC)
