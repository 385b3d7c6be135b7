"""Staged pools (``client.pool_access.DevicePools``): what a GPU rank's digests and canary read.

The digests of a request read through a stage of its blocks must equal those read in place from
the same bytes, on every layout the digest property test draws (tests/unit/test_kv_digest.py,
whose pools are filled from the logical tensor of tests/truth.py): a stage holds the request's
slots only, in its own positions, so a wrong position or a read past the stage would change a
digest or raise. On a CUDA device (``-m cuda``, bench/gpu_check.sh) the stage is read from and
written back to device memory through its registered addresses.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.client.kv_digest import kv_digest
from kvroute.client.kv_rows import RequestKv
from kvroute.client.nixl_descs import PoolAddress
from kvroute.client.pool_access import DevicePools, HostPools
from tests.unit.test_kv_digest import Filled, token_ranges
from tests.unit.test_plan_ground_truth import worlds
from tests.unit.test_plan_ground_truth_interior import tiled_worlds
from tests.world import Side, ViewClass

torch = pytest.importorskip("torch")


def _tensors(pools: dict[int, np.ndarray], side: Side) -> dict[int, torch.Tensor]:
    return {p: torch.from_numpy(a).view(side.num_slots, -1) for p, a in pools.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=st.one_of(worlds(), tiled_worlds()), data=st.data())
def test_a_staged_request_digests_as_the_pools_in_place(
    world: tuple[list[ViewClass], Side, Side], data: st.DataObject
) -> None:
    classes, ctx, _ = world
    tokens = data.draw(token_ranges(), label="tokens")
    side = Filled(ctx, classes, "ctx", 1)
    for rank, reg in enumerate(side.regs):
        pools, blocks = side.pools[rank], side.blocks[rank]
        staged = DevicePools(_tensors(pools, ctx)).stage(blocks)
        assert staged.at is not None
        assert len(staged.at) == len(set(blocks))
        in_place = kv_digest(RequestKv(reg, pools, blocks, tokens), 3)
        through = kv_digest(RequestKv(reg, staged.pools, staged.blocks(blocks), tokens), 3)
        assert through == in_place


def test_a_stage_written_back_changes_its_slots_only() -> None:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 12 * 64, dtype=np.uint8)
    before = data.copy()
    pools = DevicePools({0: torch.from_numpy(data).view(12, 64)})
    staged = pools.stage([9, 2, 2, 5])
    assert staged.at == {2: 0, 5: 1, 9: 2}
    assert np.array_equal(staged.pools[0].reshape(3, 64), before.reshape(12, 64)[[2, 5, 9]])
    staged.pools[0][64:128] = 0xAB  # slot 5
    pools.write_back(staged)
    expected = before.reshape(12, 64).copy()
    expected[5] = 0xAB
    assert np.array_equal(data.reshape(12, 64), expected)
    pools.zero([11, 0])  # a hybrid load's fresh slots
    expected[[0, 11]] = 0
    assert np.array_equal(data.reshape(12, 64), expected)


def test_host_pools_are_the_registered_memory_itself() -> None:
    data = np.zeros(4 * 32, dtype=np.uint8)
    host = HostPools({0: PoolAddress(data.ctypes.data, 32, 4)})
    staged = host.stage([3])
    staged.pools[0][3 * 32] = 1
    host.write_back(staged)
    assert data[96] == 1
    assert staged.blocks([3, 1]) == [3, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_memory_is_staged_through_its_registered_address() -> None:
    """A pool of device memory viewed through its address (as the vLLM connector registers a GPU
    rank's cache): the stage holds its slots' bytes, and a written-back stage or a zeroing changes
    them on the device and nothing else."""
    device = torch.device("cuda", 0)
    rng = np.random.default_rng(11)
    host = rng.integers(0, 256, (16, 256), dtype=np.uint8)
    pool = torch.from_numpy(host).to(device)
    address = PoolAddress(pool.data_ptr(), 256, 16, 0)
    pools = DevicePools.at({0: address})
    staged = pools.stage([0, 7, 3])
    assert np.array_equal(staged.pools[0].reshape(3, 256), host[[0, 3, 7]])
    staged.pools[0][:256] = 0  # slot 0, as a canary round's zeroing
    pools.write_back(staged)
    host[0] = 0
    assert np.array_equal(pool.cpu().numpy(), host)
    pools.zero([15])
    host[15] = 0
    assert np.array_equal(pool.cpu().numpy(), host)
