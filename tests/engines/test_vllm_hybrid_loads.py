"""What a hybrid consumer rank does around a load, on host memory and a stub of its pulls: it zeroes
the slots the load's tokens land in before the reads (vLLM zeroes the attention blocks it
allocates, not a connector's load's), and reports a failed load by request id, not block ids.
A GPU rank zeroes through its staged pools (``client.pool_access.DevicePools``), here over a CPU
tensor of the same bytes."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from tests.engines import require_vllm

require_vllm()
pytestmark = pytest.mark.slow  # imports vLLM
STRIDE, SLOTS = 64, 8


class _Pulls:
    def __init__(self, errors: dict[str, set[int]]) -> None:
        self.errors = errors

    def take_errors(self) -> dict[str, set[int]]:
        errors, self.errors = self.errors, {}
        return errors


def _worker(
    groups: dict[int, set[int]], state: set[int], mem_type: str = "DRAM"
) -> tuple[Any, Any]:
    from kvroute.client.nixl_descs import PoolAddress
    from kvroute.client.pool_access import DevicePools, HostPools
    from kvroute.engines.vllm.layout import RankCache
    from kvroute.engines.vllm.worker import Worker

    memory = (ctypes.c_uint8 * (STRIDE * SLOTS))(*([0xAB] * (STRIDE * SLOTS)))
    worker = Worker.__new__(Worker)  # no engine: only the cache, pools and pulls are read
    address = PoolAddress(ctypes.addressof(memory), STRIDE, SLOTS, 0)
    worker.cache = RankCache({}, {0: address}, mem_type, groups, state)
    worker.pools = HostPools({0: address})
    if mem_type != "DRAM":
        import torch

        pool = torch.from_numpy(worker.pools.pools[0]).view(SLOTS, STRIDE)
        worker.pools = DevicePools({0: pool})
    worker.pulls = None
    return worker, memory


def _load(blocks: tuple[tuple[int, ...], ...], tokens: tuple[int, int]) -> Any:
    from kvroute.engines.vllm.params import Handover
    from kvroute.engines.vllm.pulls import Load

    return Load("r1", Handover("p", "r1", blocks, 0, tokens[1]), blocks, tokens, 16)


@pytest.mark.parametrize("mem_type", ["DRAM", "VRAM"])
def test_a_hybrid_load_zeroes_its_block_slots_but_not_state_prefix_or_null_ones(
    mem_type: str,
) -> None:
    # Group 0 attention: block 3 holds a local prefix hit (tokens 0-15), 4 and 5 are loaded.
    # Group 1 state: slot 6 is written whole by the pull. Block 0 is the null block (canary).
    worker, memory = _worker({0: {0}, 1: {1}}, {1}, mem_type)
    worker._zero_fresh(_load(((3, 4, 5, 0), (6,)), (16, 40)))
    zeroed = {s for s in range(SLOTS) if not any(memory[s * STRIDE : (s + 1) * STRIDE])}
    assert zeroed == {4, 5}


def test_one_group_keeps_vllm_s_own_handling() -> None:
    worker, memory = _worker({0: {0}}, set())
    worker._zero_fresh(_load(((3, 4),), (0, 20)))
    assert all(memory[s * STRIDE] == 0xAB for s in range(SLOTS))


@pytest.mark.parametrize(("groups", "blocks", "failed"), [
    ({0: {0}}, {4, 5}, set()),  # one group: vLLM recomputes the blocks
    ({0: {0}, 1: {1}}, set(), {"r1"}),  # several: block ids are per group, so by request
])  # fmt: skip
def test_a_failed_load_is_reported_as_vllm_takes_it(
    groups: dict[int, set[int]], blocks: set[int], failed: set[str]
) -> None:
    worker, _ = _worker(groups, set())
    worker.pulls = _Pulls({"r1": {4, 5}})
    assert worker.failed_requests() == failed
    assert worker.load_errors() == blocks
