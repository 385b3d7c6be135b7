"""Property test: a rank with context parallelism reads and writes the prompt positions it holds
(``kv_rows.held_positions``, ``read_held_rows``, ``place_held_rows``: the canary's readers).

Hypothesis draws the CP worlds of ``test_plan_ground_truth_cp`` (dealt or chunked tokens, any
interleave, MLA latents and every view class) and a prompt. tests/truth.py fills each CP rank's
local blocks with the logical KV of the positions ``tests/world.Side.prompt_position`` says it
holds (written out there, apart from kvroute's ``Spread``), and the same side without CP holds the
whole prompt in order, read by ``read_rows``. Every row a CP rank reads must be the reference's row
at the position it names, the CP ranks together must name every position of the prompt, and rows
placed through ``place_held_rows`` must read back unchanged without touching another byte.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvroute.client.integrity import pattern
from kvroute.client.kv_rows import RequestKv, RowKey, place_held_rows, read_held_rows, read_rows
from tests.truth import Truth
from tests.unit.test_kv_digest import as_bytes
from tests.unit.test_plan_ground_truth_cp import MAX_PROMPT, cp_worlds
from tests.world import Side, ViewClass, instance


def _filled(
    side: Side, classes: list[ViewClass], prompt: int, seed: int
) -> tuple[list, list[dict[int, np.ndarray]], list[list[int]]]:
    """Each rank's registration, pools (bytes of the truth's logical ids) and local block list:
    local block ``i`` at a shuffled slot, holding local positions ``[i x tpb, (i + 1) x tpb)``."""
    regs, layouts = instance(side, classes, "ctx")
    rng, truth, tokens = np.random.default_rng(seed), Truth(classes), side.tokens_per_block
    count = -(-prompt // tokens)  # a CP rank holds at most the prompt
    pools, lists = [], []
    for rank, layout in enumerate(layouts):
        blocks = [int(b) for b in rng.permutation(side.num_slots)[:count]]
        ids = truth.fill(side, layout, rank, blocks, list(range(count)))
        pools.append({pool: as_bytes(a) for pool, a in ids.items()})
        lists.append(blocks)
    return regs, pools, lists


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=cp_worlds(), prompt=st.integers(1, MAX_PROMPT), seed=st.integers(0, 2**16))
def test_cp_ranks_read_their_own_positions_and_write_them_back(
    world: tuple[list[ViewClass], Side, Side], prompt: int, seed: int
) -> None:
    classes, ctx, _ = world
    assume(ctx.cp_size > 1)
    side = replace(ctx, prompt_tokens=prompt)
    plain = replace(side, cp_size=1, cp_interleave=1, cp_layout="interleaved", prompt_tokens=0)
    tokens = range(prompt)
    reference: dict[RowKey, np.ndarray] = {}
    for reg, pools, blocks in zip(*_filled(plain, classes, prompt, seed), strict=True):
        reference.update(read_rows(RequestKv(reg, pools, blocks, tokens)))
    named: dict[RowKey, set[int]] = {}
    for reg, pools, blocks in zip(*_filled(side, classes, prompt, seed + 1), strict=True):
        kv = RequestKv(reg, pools, blocks, tokens)
        for key, positions, rows in read_held_rows(kv):
            np.testing.assert_array_equal(rows, reference[key][positions], err_msg=key.label())
            named.setdefault(key, set()).update(positions.tolist())
        before = {pool: array.copy() for pool, array in pools.items()}
        place_held_rows(kv, lambda key, positions, width: reference[key][positions][:, ::-1])
        for key, positions, rows in read_held_rows(kv):
            np.testing.assert_array_equal(rows, reference[key][positions][:, ::-1])
        place_held_rows(kv, lambda key, positions, width: reference[key][positions])
        for pool, array in pools.items():  # written back: every byte as it was
            np.testing.assert_array_equal(array, before[pool])
    assert named.keys() == reference.keys()
    for key, positions in named.items():
        assert positions == set(tokens), key.label()


def test_the_canary_pattern_takes_any_positions() -> None:
    key = RowKey("target", "key,value", 3, 1, 0)
    whole = pattern(key, range(10), 8)
    np.testing.assert_array_equal(pattern(key, np.array([7, 2, 5]), 8), whole[[7, 2, 5]])
