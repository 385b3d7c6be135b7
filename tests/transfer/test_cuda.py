"""The data plane on a GPU: strategies on CUDA pools, the worker's streams, CUDA IPC pools."""

from __future__ import annotations

import multiprocessing
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from kvroute.geometry import Pool
from kvroute.transfer import (
    CopyEngine,
    CudaIpcBackend,
    JobState,
    LocalBackend,
    PoolMemoryCache,
    PoolMemoryError,
    Strategy,
    TransferJob,
    TransferLeg,
    WorkerPool,
)
from tests.transfer import cuda_owner
from tests.transfer.conftest import SCENARIOS
from tests.transfer.pools import Scenario
from tests.transfer.shm_owner import seeded_bytes

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_leg(scenario: Scenario, device: str = "cuda:0") -> tuple[TransferLeg, np.ndarray]:
    """Sender pools holding the truth's bytes over seeded filler, a seeded receiver, on ``device``."""
    backend = LocalBackend()
    cache = PoolMemoryCache([backend])
    src = {}
    for rank in scenario.sender_ranks:
        pool = scenario.src_pool(rank)
        content = scenario.sender_bytes(rank, seeded_bytes(rank, pool.size_bytes))
        backend.register(f"src{rank}", torch.from_numpy(content).to(device))
        src[(rank, 0)] = cache.open_pool({"backend": "local", "name": f"src{rank}"}, pool)
    before = seeded_bytes(100, scenario.dst_pool.size_bytes)
    backend.register("dst", torch.from_numpy(before).to(device))
    dst = {0: cache.open_pool({"backend": "local", "name": "dst"}, scenario.dst_pool)}
    return TransferLeg(scenario.plan(), src, dst), before


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_cuda_copies_match_ground_truth(name: str, strategy: Strategy) -> None:
    scenario = SCENARIOS[name]
    leg, before = cuda_leg(scenario)
    rng = np.random.default_rng(1)
    blocks = (
        rng.choice(scenario.src_slots, 10, replace=False),
        rng.choice(scenario.dst_slots, 10, replace=False),
    )

    CopyEngine().copy(TransferJob([leg], *blocks), strategy=strategy)
    torch.cuda.synchronize()

    actual = leg.dst_pools[0].tensor.cpu().numpy()
    np.testing.assert_array_equal(actual, scenario.expected(before, blocks))


async def test_worker_pool_completes_cuda_jobs_on_its_streams() -> None:
    scenario = SCENARIOS["target-and-draft"]
    leg, before = cuda_leg(scenario)
    blocks = (np.array([1, 5, 7]), np.array([0, 3, 2]))
    pool = WorkerPool(workers=2, queue_size=4)
    await pool.start()

    status = await (await pool.submit(TransferJob([leg], *blocks)))

    assert status.state is JobState.SUCCEEDED, status.error
    actual = leg.dst_pools[0].tensor.cpu().numpy()
    np.testing.assert_array_equal(actual, scenario.expected(before, blocks))
    assert (await pool.drain(5.0)).clean


@pytest.mark.skipif(find_spec("cupy") is None, reason="CUDA IPC handles are opened with CuPy")
def test_cuda_ipc_pool_from_another_process() -> None:
    pool = Pool(0, 4096, 4096, 16)
    context = multiprocessing.get_context("spawn")
    replies, done = context.Queue(), context.Queue()
    owner = context.Process(target=cuda_owner.serve, args=(pool.size_bytes, 5, replies, done))
    owner.start()
    try:
        descriptor = replies.get(timeout=60)
        with PoolMemoryCache([CudaIpcBackend()]) as cache:
            memory = cache.open_pool(descriptor, pool)
            assert memory.device.type == "cuda"
            actual = memory.tensor.cpu().numpy()
            np.testing.assert_array_equal(actual, seeded_bytes(5, pool.size_bytes))
            too_big = Pool(0, 4096, 4096, 4096)
            with pytest.raises(PoolMemoryError, match="needs"):
                cache.open_pool(descriptor, too_big)
    finally:
        done.put("done")
        owner.join(timeout=60)
