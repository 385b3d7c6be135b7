"""The worker pool: async submission, states, cancellation, back-pressure, drain and metrics."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable
from datetime import UTC, datetime

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from kvroute.transfer import (
    CopyEngine,
    JobState,
    JobStatus,
    LocalBackend,
    PoolDraining,
    PoolMemoryCache,
    QueueFull,
    TransferJob,
    TransferLeg,
    TransferValidationError,
    UnknownJob,
    WorkerPool,
)
from kvroute.transfer.jobs import CopyResult
from tests.transfer.conftest import SCENARIOS, Owners, Staged
from tests.transfer.pools import Scenario
from tests.world import Side, ViewClass

WAIT_S = 10.0


class GatedEngine(CopyEngine):
    """The real engine, held at a gate so a test decides when a running job may proceed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def copy(self, job: TransferJob, **kwargs: object) -> CopyResult:
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("test gate never opened")
        return super().copy(job)


@pytest.fixture
def leg() -> TransferLeg:
    """Generation TP2 rank 1 taking heads 2..3 of context TP1's 4, 8 slots a side, on CPU."""
    kv = ViewClass(("key", "value"), "target", "hnd", total_heads=4, buffers=2, unit=16)
    scenario = Scenario(
        "pool",
        [kv],
        Side("context", 1, (2,), tokens_per_block=8, num_slots=8, seed=1),
        Side("generation", 2, (2,), tokens_per_block=8, num_slots=8, seed=2),
        receiver=1,
    )
    src, dst = scenario.src_pool(0), scenario.dst_pool
    backend = LocalBackend()
    filler = torch.arange(src.size_bytes, dtype=torch.int64).to(torch.uint8).numpy()
    backend.register("src", torch.from_numpy(scenario.sender_bytes(0, filler)))
    backend.register("dst", torch.zeros(dst.size_bytes, dtype=torch.uint8))
    cache = PoolMemoryCache([backend])
    src_memory = cache.open_pool({"backend": "local", "name": "src"}, src)
    dst_memory = cache.open_pool({"backend": "local", "name": "dst"}, dst)
    return TransferLeg(scenario.plan(), {(0, 0): src_memory}, {0: dst_memory})


async def wait_for(predicate: Callable[[], bool], polls: int = 2000) -> None:
    """Poll state that worker threads change; bounded at ``polls`` x 5 ms."""
    for _ in range(polls):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_submitted_job_succeeds_and_is_counted(leg: TransferLeg) -> None:
    registry = CollectorRegistry()
    updates: list[JobStatus] = []
    pool = WorkerPool(workers=2, queue_size=4, registry=registry, on_update=updates.append)
    await pool.start()
    assert pool.alive_workers == 2

    handle = await pool.submit(TransferJob([leg], [1, 2, 3], [0, 5, 7]))
    status = await handle

    assert status.state is JobState.SUCCEEDED
    assert status.bytes == 3 * leg.plan.bytes_per_block
    assert status.fragments == 3 * leg.plan.fragments_per_block
    assert pool.status(handle.job_id) == status
    await wait_for(lambda: len(updates) == 3)
    assert [u.state for u in updates] == [JobState.QUEUED, JobState.RUNNING, JobState.SUCCEEDED]
    assert sample(registry, "kvroute_transfer_jobs_total", state="succeeded") == 1
    assert sample(registry, "kvroute_transfer_bytes_total") == status.bytes
    assert sample(registry, "kvroute_transfer_duration_seconds_count") == 1
    assert (await pool.drain(1.0)).clean


async def test_job_stamps_come_from_the_pools_clock(leg: TransferLeg) -> None:
    # The app's clock (``api.clock``): a test that moves time sees it in the job rows too.
    at = datetime(2030, 1, 1, tzinfo=UTC)
    pool = WorkerPool(workers=1, queue_size=1, clock=lambda: at)
    await pool.start()
    status = await (await pool.submit(TransferJob([leg], [1], [0])))
    assert status.state is JobState.SUCCEEDED
    assert status.submitted_at == status.started_at == status.finished_at == at.timestamp()
    assert (await pool.drain(1.0)).clean


async def test_shm_job_through_the_pool_reaches_the_owner_process(
    stage: Callable[..., Staged], owners: Owners
) -> None:
    staged = stage(SCENARIOS["target-and-draft"], seed=21)
    blocks = (np.array([4, 0, 9, 17]), np.array([2, 3, 19, 8]))
    pool = WorkerPool(workers=1, queue_size=2)
    await pool.start()

    status = await (await pool.submit(TransferJob([staged.leg], *blocks)))

    assert status.state is JobState.SUCCEEDED, status.error
    expected = staged.scenario.expected(staged.receiver_before, blocks)
    digest = owners.digest("gen0", staged.receiver_segment)
    assert digest == hashlib.sha256(expected.tobytes()).hexdigest()
    await pool.drain(1.0)


async def test_queued_job_can_be_cancelled_running_one_cannot(leg: TransferLeg) -> None:
    engine = GatedEngine()
    pool = WorkerPool(workers=1, queue_size=4, engine=engine)
    await pool.start()
    first = await pool.submit(TransferJob([leg], [0], [0]))
    await wait_for(lambda: first.status().state is JobState.RUNNING)
    second = await pool.submit(TransferJob([leg], [1], [1]))

    assert pool.cancel(second.job_id) is True
    assert pool.cancel(first.job_id) is False
    engine.gate.set()

    assert (await second).state is JobState.CANCELLED
    assert (await first).state is JobState.SUCCEEDED
    dst = leg.dst_pools[0]
    slot = dst.pool.slot_stride
    assert not dst.tensor[slot : 2 * slot].any()  # the cancelled job wrote nothing
    assert pool.cancel(second.job_id) is False
    with pytest.raises(UnknownJob):
        pool.cancel("no-such-job")
    with pytest.raises(UnknownJob):
        pool.status("no-such-job")
    await pool.drain(1.0)


async def test_full_queue_refuses_with_retry_after(leg: TransferLeg) -> None:
    registry = CollectorRegistry()
    engine = GatedEngine()
    pool = WorkerPool(workers=1, queue_size=1, registry=registry, engine=engine, retry_after=2.5)
    await pool.start()
    running = await pool.submit(TransferJob([leg], [0], [0]))
    await wait_for(lambda: running.status().state is JobState.RUNNING)
    await pool.submit(TransferJob([leg], [1], [1]))

    with pytest.raises(QueueFull) as refused:
        await pool.submit(TransferJob([leg], [2], [2]))

    assert refused.value.retry_after == 2.5
    assert pool.queue_depth == 1
    assert sample(registry, "kvroute_transfer_rejected_total", reason="queue_full") == 1
    assert sample(registry, "kvroute_transfer_queue_depth") == 1
    engine.gate.set()
    assert (await pool.drain(WAIT_S)).clean


async def test_invalid_job_is_refused_at_submission(leg: TransferLeg) -> None:
    pool = WorkerPool(workers=1, queue_size=1)
    await pool.start()
    with pytest.raises(TransferValidationError, match="block id 8 is outside"):
        await pool.submit(TransferJob([leg], [8], [0]))
    assert pool.queue_depth == 0
    await pool.drain(1.0)


async def test_job_whose_memory_vanished_fails_with_the_reason(leg: TransferLeg) -> None:
    pool = WorkerPool(workers=1, queue_size=1, engine=GatedEngine())
    await pool.start()
    handle = await pool.submit(TransferJob([leg], [0], [0]))
    leg.dst_pools[0].close()  # e.g. the receiver deregistered while the job waited
    pool.engine.gate.set()  # type: ignore[attr-defined]

    status = await handle

    assert status.state is JobState.FAILED
    assert "memory was closed" in (status.error or "")
    await pool.drain(1.0)


async def test_drain_cancels_queued_and_reports_abandoned_running(leg: TransferLeg) -> None:
    engine = GatedEngine()
    pool = WorkerPool(workers=1, queue_size=4, engine=engine)
    await pool.start()
    running = await pool.submit(TransferJob([leg], [0], [0]))
    await wait_for(lambda: running.status().state is JobState.RUNNING)
    queued = await pool.submit(TransferJob([leg], [1], [1]))

    report = await pool.drain(0.05)

    assert report.cancelled == (queued.job_id,)
    assert report.abandoned == (running.job_id,)
    assert (await running).state is JobState.FAILED
    assert (await queued).state is JobState.CANCELLED
    assert not pool.accepting
    with pytest.raises(PoolDraining):
        await pool.submit(TransferJob([leg], [2], [2]))
    engine.gate.set()  # the abandoned copy finishes later; its result is dropped
    await wait_for(lambda: pool.alive_workers == 0)
    assert pool.status(running.job_id).state is JobState.FAILED


async def test_drain_waits_for_running_jobs(leg: TransferLeg) -> None:
    engine = GatedEngine()
    pool = WorkerPool(workers=2, queue_size=4, engine=engine)
    await pool.start()
    running = await pool.submit(TransferJob([leg], [0], [0]))
    await wait_for(lambda: running.status().state is JobState.RUNNING)
    asyncio.get_running_loop().call_later(0.05, engine.gate.set)

    report = await pool.drain(WAIT_S)

    assert report.clean
    assert report.cancelled == ()
    assert pool.status(running.job_id).state is JobState.SUCCEEDED
    assert (await pool.drain(WAIT_S)).clean  # idempotent
