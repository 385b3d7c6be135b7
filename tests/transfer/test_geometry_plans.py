"""Plans built by ``kvroute.geometry.build_plan`` execute exactly on the copy engine.

The synthetic world of ``tests/world.py`` lays out every rank from first principles and knows the
receiver's expected bytes independently of the planner; here the engine, not a numpy loop, runs the
plans (each logical id as one byte, ``tests.transfer.pools.as_bytes``, so misplaced bytes show up
as mismatches).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvroute.geometry import Pool, build_plan
from kvroute.transfer import (
    CopyEngine,
    CopyPlan,
    LocalBackend,
    PoolMemoryCache,
    Strategy,
    TransferJob,
    TransferLeg,
)
from tests.transfer.pools import as_bytes
from tests.truth import Truth
from tests.world import Side, ViewClass, instance

TARGET = ViewClass(("key", "value"), "target", "hnd", total_heads=4, buffers=2, unit=4)
TARGET_NHD = ViewClass(("key", "value"), "target", "nhd", total_heads=4, buffers=2, unit=4)
DRAFT = ViewClass(("key", "value"), "draft", "hnd", total_heads=1, buffers=2, unit=4)

WORLDS = {
    "tp2-to-tp1-target-and-draft": (
        [TARGET, DRAFT],
        Side("context", 2, (2,), num_draft_layers=1),
        Side("generation", 1, (2,), num_draft_layers=1),
    ),
    "pp2-to-tp2-nhd": (
        [TARGET_NHD],
        Side("context", 1, (1, 1)),
        Side("generation", 2, (2,)),
    ),
}


@pytest.mark.parametrize("strategy", [Strategy.BLOCKWISE, Strategy.INDEXED])
@pytest.mark.parametrize("world", list(WORLDS))
def test_geometry_plans_copy_the_right_bytes(world: str, strategy: Strategy) -> None:
    classes, ctx_side, gen_side = WORLDS[world]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx")
    gen, gen_layouts = instance(gen_side, classes, "gen")
    truth = Truth(classes)
    backend = LocalBackend()
    cache = PoolMemoryCache([backend])

    def open_pools(side: Side, layout, rank: int, arrays: dict[int, np.ndarray]) -> dict:
        pools = {}
        for pool_id, (slot_bytes, stride, slots) in layout.pools.items():
            name = f"{side.role}-{rank}-{pool_id}"
            backend.register(name, torch.from_numpy(as_bytes(arrays[pool_id])))
            pool = Pool(pool_id, slot_bytes, stride, slots)
            pools[pool_id] = cache.open_pool({"backend": "local", "name": name}, pool)
        return pools

    src_pools = {}
    for rank, layout in enumerate(ctx_layouts):
        filled = truth.fill(ctx_side, layout, rank, [0, 1, 2], [0, 1, 2])
        for pool_id, memory in open_pools(ctx_side, layout, rank, filled).items():
            src_pools[(rank, pool_id)] = memory
    src_blocks, dst_blocks = [2, 0], [1, 2]
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        empty = {
            pool: np.zeros(stride * n, np.int64) for pool, (_, stride, n) in layout.pools.items()
        }
        dst_pools = open_pools(gen_side, layout, receiver.rank, empty)
        plan = CopyPlan.from_plan(build_plan(ctx, receiver))
        CopyEngine().copy(
            TransferJob([TransferLeg(plan, src_pools, dst_pools)], src_blocks, dst_blocks),
            strategy=strategy,
        )
        want = truth.fill(gen_side, layout, receiver.rank, dst_blocks, src_blocks)
        for pool_id, memory in dst_pools.items():
            expected = as_bytes(want[pool_id])
            assert (want[pool_id] != 0).any()
            np.testing.assert_array_equal(
                memory.tensor.numpy(), expected, err_msg=f"pool {pool_id}"
            )
    cache.close()
