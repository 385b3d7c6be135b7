"""The transfer worker pool: threads that own CUDA streams, fed by a bounded queue.

The event loop never copies and never waits for a copy. ``submit`` validates the job and queues it
(or raises ``QueueFull`` at once); a worker thread runs the copy engine on its own streams (one per
CUDA device, created at the lowest priority so KV traffic yields to the engine's compute), records
an event per stream and waits on the events; the job's asyncio future is completed on its loop with
``call_soon_threadsafe``. Queued jobs can be cancelled; ``drain`` stops intake, cancels what is still
queued, waits up to a timeout for running copies, and reports what it abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvroute.transfer.engine import CopyEngine
from kvroute.transfer.errors import PoolDraining, QueueFull, TransferError, UnknownJob
from kvroute.transfer.jobs import CopyResult, JobState, JobStatus, TransferJob
from kvroute.transfer.metrics import TransferMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    job: TransferJob
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[JobStatus]
    status: JobStatus


@dataclass(frozen=True, slots=True)
class DrainReport:
    cancelled: tuple[str, ...]  # queued jobs that never started
    abandoned: tuple[str, ...]  # jobs still running when the timeout expired
    clean: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "clean", not self.abandoned)


class JobHandle:
    """A submitted job: ``await handle`` gives its final ``JobStatus`` (failures do not raise)."""

    def __init__(self, pool: WorkerPool, entry: _Entry) -> None:
        self._pool = pool
        self._entry = entry

    @property
    def job_id(self) -> str:
        return self._entry.job.job_id

    def status(self) -> JobStatus:
        return self._entry.status

    def __await__(self) -> Generator[Any, None, JobStatus]:
        return asyncio.shield(self._entry.future).__await__()


def system_clock() -> datetime:
    return datetime.now(UTC)


class WorkerPool:
    """``workers`` threads sharing one ``CopyEngine`` and a queue of at most ``queue_size`` jobs."""

    def __init__(
        self,
        workers: int = 2,
        queue_size: int = 64,
        registry: CollectorRegistry | None = None,
        *,
        engine: CopyEngine | None = None,
        history: int = 10_000,
        retry_after: float = 1.0,
        on_update: Callable[[JobStatus], None] | None = None,
        on_done: Callable[[TransferJob], None] | None = None,
        clock: Callable[[], datetime] = system_clock,
    ) -> None:
        if workers < 1 or queue_size < 1:
            raise ValueError("a worker pool needs at least one worker and one queue slot")
        self.engine = engine or CopyEngine()
        self._workers = workers
        self._queue_size = queue_size
        self._history = history
        self._retry_after = retry_after
        self._on_update = on_update
        # Called once per job as it reaches its final state (on whichever thread ends it).
        self._on_done = on_done
        # Job stamps come from the app's clock (``api.clock``), as the rows' other times do.
        self._clock = clock
        self._metrics = TransferMetrics(registry or CollectorRegistry())
        self._cond = threading.Condition()
        self._queued: OrderedDict[str, _Entry] = OrderedDict()
        self._running: dict[str, _Entry] = {}
        self._finished: OrderedDict[str, _Entry] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._accepting = False
        self._stopping = False
        self._on_idle: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def _stamp(self) -> float:
        return self._clock().timestamp()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._threads:
            raise RuntimeError("the worker pool was already started")
        for index in range(self._workers):
            thread = threading.Thread(
                target=self._work, name=f"kvroute-transfer-{index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        self._accepting = True

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive_workers(self) -> int:
        return sum(thread.is_alive() for thread in self._threads)

    @property
    def queue_depth(self) -> int:
        return len(self._queued)

    async def drain(self, grace_seconds: float) -> DrainReport:
        """Stop intake, cancel queued jobs, wait up to ``grace_seconds`` for running ones.

        Idempotent. Jobs still running at the deadline are reported as abandoned and marked
        failed; their threads are daemons and their late results are dropped.
        """
        idle = asyncio.Event()
        with self._cond:
            self._accepting = False
            self._stopping = True
            queued = list(self._queued.values())
            self._queued.clear()
            self._on_idle = (asyncio.get_running_loop(), idle)
            if not self._running:
                idle.set()
            self._cond.notify_all()
        for entry in queued:
            self._finish(entry, JobState.CANCELLED, error="cancelled: kvroute is draining")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_seconds):
                await idle.wait()
        with self._cond:
            abandoned = list(self._running.values())
        for entry in abandoned:
            log.warning("drain timed out; abandoning running transfer job %s", entry.job.job_id)
            self._finish(entry, JobState.FAILED, error="abandoned: still running at shutdown")
        report = DrainReport(
            cancelled=tuple(entry.job.job_id for entry in queued),
            abandoned=tuple(entry.job.job_id for entry in abandoned),
        )
        log.info(
            "transfer pool drained: %d cancelled, %d abandoned",
            len(report.cancelled),
            len(report.abandoned),
        )
        return report

    # -- the event-loop side -------------------------------------------------------------------

    async def submit(self, job: TransferJob) -> JobHandle:
        """Validate and queue ``job``; raises ``TransferValidationError``, ``QueueFull`` or
        ``PoolDraining`` without queueing anything."""
        loop = asyncio.get_running_loop()
        if not self._accepting:
            self._metrics.rejected.labels(reason="draining").inc()
            raise PoolDraining
        self.engine.validate(job)
        status = JobStatus(job.job_id, JobState.QUEUED, submitted_at=self._stamp())
        entry = _Entry(job, loop, loop.create_future(), status)
        with self._cond:
            if not self._accepting:
                self._metrics.rejected.labels(reason="draining").inc()
                raise PoolDraining
            if len(self._queued) >= self._queue_size:
                self._metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(self._queue_size, self._retry_after)
            self._queued[job.job_id] = entry
            self._metrics.queue_depth.set(len(self._queued))
            self._cond.notify()
        self._publish(entry)
        return JobHandle(self, entry)

    def status(self, job_id: str) -> JobStatus:
        return self._entry(job_id).status

    def handle(self, job_id: str) -> JobHandle:
        """A handle to await a job this pool knows (queued, running or recently finished)."""
        return JobHandle(self, self._entry(job_id))

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued job. False when it is already running or finished."""
        with self._cond:
            entry = self._queued.pop(job_id, None)
            self._metrics.queue_depth.set(len(self._queued))
        if entry is None:
            self._entry(job_id)  # raises UnknownJob for an id never seen
            return False
        self._finish(entry, JobState.CANCELLED, error="cancelled before it started")
        return True

    def _entry(self, job_id: str) -> _Entry:
        with self._cond:
            for table in (self._queued, self._running, self._finished):
                if job_id in table:
                    return table[job_id]
        raise UnknownJob(job_id)

    # -- the worker side -----------------------------------------------------------------------

    def _work(self) -> None:
        streams: dict[int, torch.cuda.Stream] = {}
        while (entry := self._next()) is not None:
            started = time.perf_counter()
            try:
                result = self._execute(entry.job, streams)
            except TransferError as error:
                self._finish(entry, JobState.FAILED, error=str(error))
            except Exception as error:
                log.exception("transfer job %s failed unexpectedly", entry.job.job_id)
                self._finish(entry, JobState.FAILED, error=f"{type(error).__name__}: {error}")
            else:
                self._finish(entry, JobState.SUCCEEDED, result, time.perf_counter() - started)

    def _next(self) -> _Entry | None:
        with self._cond:
            while not self._queued and not self._stopping:
                self._cond.wait()
            if not self._queued:
                return None
            _, entry = self._queued.popitem(last=False)
            entry.status = replace(entry.status, state=JobState.RUNNING, started_at=self._stamp())
            self._running[entry.job.job_id] = entry
            self._metrics.queue_depth.set(len(self._queued))
            self._metrics.running.set(len(self._running))
        self._publish(entry)
        return entry

    def _execute(self, job: TransferJob, streams: dict[int, torch.cuda.Stream]) -> CopyResult:
        # A job may have waited in the queue: its pools are checked again here, on this thread,
        # right before the copy touches them (a shrunk segment must fail the job, not SIGBUS us).
        job.verify_memory()
        cuda = sorted(
            device.index or 0 for device in self.engine.devices(job) if device.type == "cuda"
        )
        if not cuda:
            return self.engine.copy(job)
        events = []
        with contextlib.ExitStack() as stack:
            for index in cuda:
                if index not in streams:
                    # priority 0 is CUDA's lowest: KV copies yield to the serving engine's kernels
                    streams[index] = torch.cuda.Stream(device=index, priority=0)
                stream = streams[index]
                # local pools may have been written on this process's default stream
                stream.wait_stream(torch.cuda.default_stream(index))
                stack.enter_context(torch.cuda.stream(stream))
            result = self.engine.copy(job)
            for index in cuda:
                events.append(streams[index].record_event())
        for event in events:
            event.synchronize()
        return result

    def _finish(
        self,
        entry: _Entry,
        state: JobState,
        result: CopyResult | None = None,
        seconds: float | None = None,
        *,
        error: str | None = None,
    ) -> None:
        job_id = entry.job.job_id
        with self._cond:
            if entry.status.state.terminal:
                return  # abandoned by a drain that gave up on it; the late result is dropped
            self._running.pop(job_id, None)
            entry.status = replace(
                entry.status,
                state=state,
                bytes=result.bytes if result else 0,
                fragments=result.fragments if result else 0,
                seconds=seconds,
                error=error,
                finished_at=self._stamp(),
            )
            self._finished[job_id] = entry
            while len(self._finished) > self._history:
                self._finished.popitem(last=False)
            self._metrics.running.set(len(self._running))
            if self._on_idle is not None and not self._running:
                loop, idle = self._on_idle
                with contextlib.suppress(RuntimeError):  # the draining loop may be gone
                    loop.call_soon_threadsafe(idle.set)
        if self._on_done is not None:
            try:
                self._on_done(entry.job)
            except Exception:
                log.exception("releasing transfer job %s failed", job_id)
        self._metrics.jobs.labels(state=state.value).inc()
        if result is not None and seconds is not None:
            self._metrics.bytes.inc(result.bytes)
            self._metrics.fragments.inc(result.fragments)
            self._metrics.duration.observe(seconds)
        self._publish(entry, settle=True)

    def _publish(self, entry: _Entry, *, settle: bool = False) -> None:
        status = entry.status

        def deliver() -> None:
            if self._on_update is not None:
                self._on_update(status)
            if settle and not entry.future.done():
                entry.future.set_result(status)

        try:
            entry.loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            log.debug("event loop closed; job %s update not delivered", entry.job.job_id)
