"""View pairs whose bytes are not whole token rows (4-bit block scales: half a byte per token-head)
beside ordinary KV views, at equal block sizes (issue 35).

Such a pair cannot be cut at a token: its plan states ``token_rows: false`` and keeps its block form
even in a ``fragments=period`` plan, the ordinary pairs beside it take their period form; a
prompt-only job moves the lists' common suffix of its blocks whole while every other pair stops at
the prompt's last token; a token range is refused naming the pair (block pairs still move it).
The expected bytes come from the HND layout written out here ([buffer][head][token][bytes] per
layer), never from the planner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from jsonschema import Draft202012Validator

from kvroute.client.nixl_descs import PoolAddress, plan_descriptors
from kvroute.geometry import (
    GeometryError,
    Plan,
    Pool,
    RequestBlocks,
    TokenRange,
    TokenWindow,
    build_plan,
    check_registration,
)
from kvroute.render import plan_text
from kvroute.transfer import (
    CopyEngine,
    CopyPlan,
    LocalBackend,
    PoolMemoryCache,
    Strategy,
    TransferJob,
    TransferLeg,
    TransferValidationError,
)
from tests.unit.docs import rank, view

SPEC = Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml"
TOKENS, HEADS, HEAD_BYTES = 16, 2, 8  # tokens per block, KV heads, bytes per token-head of K or V
KV_LAYER = 2 * HEADS * TOKENS * HEAD_BYTES  # 512: K and V buffers of [head][token][bytes]
SCALES_LAYER = 2 * HEADS * TOKENS // 2  # 32: half a byte per token-head
SCALES_AT = 2 * KV_LAYER  # the scales of layers 0 and 1 follow the KV layers in the slot
SLOT, SLOTS = SCALES_AT + 2 * SCALES_LAYER, 8
VIEWS = [
    view(0, [0, 1], KV_LAYER),
    view(
        1,
        [0, 1],
        SCALES_LAYER,
        offsets=[SCALES_AT, SCALES_AT + SCALES_LAYER],
        roles=("key_block_scale", "value_block_scale"),
        dtype="float4_e2m1",
    ),
]


def _plan() -> Plan:
    ctx, gen = [rank("context", tp=1, views=VIEWS)], rank("generation", tp=1, views=VIEWS)
    check_registration(gen, [], ctx)
    return build_plan(ctx, gen)


def _expected(
    src: np.ndarray,
    before: np.ndarray,
    pairs: list[tuple[int, int, int]],
    positions: range,
) -> np.ndarray:
    """The receiver pool after a job: for each (block, src slot, dst slot) the KV bytes of the
    block's tokens in ``positions`` and the scales of the whole block."""
    want = before.copy()
    for block, s, d in pairs:
        for t in range(TOKENS):
            if block * TOKENS + t not in positions:
                continue
            for layer in range(2):
                for buffer in range(2):
                    for head in range(HEADS):
                        at = layer * KV_LAYER + (buffer * HEADS + head) * TOKENS * HEAD_BYTES
                        at += t * HEAD_BYTES
                        want[d * SLOT + at : d * SLOT + at + HEAD_BYTES] = src[
                            s * SLOT + at : s * SLOT + at + HEAD_BYTES
                        ]
        scales = slice(SCALES_AT, SLOT)
        want[d * SLOT :][scales] = src[s * SLOT :][scales]
    return want


def _pools() -> tuple[np.ndarray, np.ndarray]:
    """Sender bytes and the receiver's before the job, of disjoint values: a written byte shows."""
    rng = np.random.default_rng(35)
    return (
        rng.integers(1, 128, SLOT * SLOTS, dtype=np.uint8),
        rng.integers(128, 256, SLOT * SLOTS, dtype=np.uint8),
    )


# (src blocks, dst blocks, prompt, the moved (block, src slot, dst slot), the KV tokens moved)
PROMPT_ONLY = {
    "the whole prompt": ([3, 5], [6, 2], 20, [(0, 3, 6), (1, 5, 2)], range(0, 20)),
    "a cached block on the receiver": ([3, 5], [4], 20, [(1, 5, 4)], range(16, 20)),
    "a block-aligned prompt": ([3, 5], [6, 2], 32, [(0, 3, 6), (1, 5, 2)], range(0, 32)),
}


def test_the_period_form_keeps_such_a_pair_in_block_form_and_says_so() -> None:
    plan = _plan()
    spec = yaml.safe_load(SPEC.read_text())
    schema = {"$ref": "#/components/schemas/Plan", "components": spec["components"]}
    for period in (False, True):
        document = plan.to_json(sender_generations={0: 1}, receiver_generation=1, period=period)
        Draft202012Validator(schema).validate(document)
        kv, scales = document["peers"][0]["views"]
        assert scales["token_rows"] is False
        assert "fragments" in scales
        assert "period_fragments" not in scales
        assert "token_rows" not in kv
        assert ("period_fragments" in kv) is period
        read = Plan.from_json(document)
        assert [v.token_rows for v in read.peers[0].views] == [True, False]
        assert read.to_json(period=period) == document
    assert "whole blocks 1->1: bytes per layer are not whole token rows" in plan_text(plan)
    assert "whole blocks 0->0" not in plan_text(plan)
    contradiction = plan.to_json(period=True)
    contradiction["peers"][0]["views"][0]["token_rows"] = False
    with pytest.raises(GeometryError, match="token_rows: is false, but the pair states a period"):
        Plan.from_json(contradiction)


def _job(plan: CopyPlan, src: np.ndarray, dst: np.ndarray, cache, backend, **members: Any):
    pools = []
    for name, array in (("src", src), ("dst", dst)):
        key = f"{name}-{id(array)}"
        backend.register(key, torch.from_numpy(array))
        pools.append(
            {0: cache.open_pool({"backend": "local", "name": key}, Pool(0, SLOT, SLOT, SLOTS))}
        )
    blocks = members.pop("blocks")
    return TransferJob(
        [TransferLeg(plan, {(0, 0): pools[0][0]}, pools[1])], *blocks, window=TokenWindow(**members)
    )


COMPILED = {
    "the planner's plan": lambda: CopyPlan.from_plan(_plan()),
    "the served period answer": lambda: CopyPlan.from_plan(
        Plan.from_json(_plan().to_json(period=True))
    ),
}


@pytest.mark.parametrize("compiled", list(COMPILED))
@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("name", list(PROMPT_ONLY))
def test_a_prompt_only_job_moves_whole_blocks_of_it_and_stops_the_others_at_the_prompt(
    name: str, strategy: Strategy, compiled: str
) -> None:
    src_blocks, dst_blocks, prompt, pairs, positions = PROMPT_ONLY[name]
    src, before = _pools()
    dst = before.copy()
    cache = PoolMemoryCache([backend := LocalBackend()])
    plan = COMPILED[compiled]()
    job = _job(plan, src, dst, cache, backend, blocks=(src_blocks, dst_blocks),
               prompt_tokens=prompt)  # fmt: skip
    result = CopyEngine().copy(job, strategy=strategy)
    want = _expected(src, before, pairs, positions)
    np.testing.assert_array_equal(dst, want)
    assert result.bytes == int((want != before).sum())
    cache.close()


def test_a_token_range_is_refused_naming_the_pair() -> None:
    src, dst = _pools()
    cache = PoolMemoryCache([backend := LocalBackend()])
    plan = CopyPlan.from_plan(_plan())
    for end in (20, 32):  # the plan does not know the pair's block size: no range is cut
        job = _job(plan, src, dst, cache, backend, blocks=([3, 5], [6, 2]),
                   tokens=TokenRange(0, end))  # fmt: skip
        with pytest.raises(TransferValidationError, match="not whole token rows") as refused:
            CopyEngine().validate(job)
        assert refused.value.field == "legs[0].sender rank 0.views[1]"
    pairs = _job(plan, src, dst, cache, backend, blocks=([3, 5], [6, 2]))
    assert CopyEngine().validate(pairs).bytes == 2 * (2 * KV_LAYER + 2 * SCALES_LAYER)
    cache.close()


@pytest.mark.parametrize("name", list(PROMPT_ONLY))
def test_nixl_descriptors_from_the_served_period_form_agree(name: str) -> None:
    """A worker reads the mixed ``fragments=period`` answer back and pulls the same bytes."""
    src_blocks, dst_blocks, prompt, pairs, positions = PROMPT_ONLY[name]
    src, before = _pools()
    served = Plan.from_json(_plan().to_json(period=True))
    base = 1 << 32
    result = plan_descriptors(
        served,
        receiver_pools={0: PoolAddress(0, SLOT, SLOTS)},
        sender_pools={0: {0: PoolAddress(base, SLOT, SLOTS)}},
        blocks=RequestBlocks(src_blocks, dst_blocks, TokenWindow(prompt_tokens=prompt)),
    )
    got = before.copy()
    for descs in result.peers:
        for (at, length, _), (source, _, _) in zip(descs.local, descs.remote, strict=True):
            got[at : at + length] = src[source - base : source - base + length]
    want = _expected(src, before, pairs, positions)
    np.testing.assert_array_equal(got, want)
    assert result.bytes == int((want != before).sum())
    with pytest.raises(ValueError, match=r"view pair 1->1 .*token_rows: false"):
        plan_descriptors(
            served,
            receiver_pools={0: PoolAddress(0, SLOT, SLOTS)},
            sender_pools={0: {0: PoolAddress(base, SLOT, SLOTS)}},
            blocks=RequestBlocks(
                src_blocks, dst_blocks, TokenWindow(TokenRange(positions.start, prompt))
            ),
        )
