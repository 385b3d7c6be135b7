"""Hybrid plans (recurrent state and sliding windows) executed by the copy engine on real bytes.

Worlds from ``tests/world.py`` give each rank's layout and ``tests/truth.py``, independently of the
planner, the bytes a receiver must hold: tokens inside the window, the request's state in its state
slot, nothing else, with equal block sizes (issue 12's paired lists) and between block sizes (token
ranges cut mid-block). Every strategy copies them; the job's checks refuse what cannot be copied
exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from kvroute.geometry import Pool, PromptContradiction, TokenRange, TokenWindow, build_plan
from kvroute.transfer import (
    CopyEngine,
    CopyPlan,
    LocalBackend,
    PeerCopy,
    PoolMemory,
    PoolMemoryCache,
    Strategy,
    TransferJob,
    TransferLeg,
    TransferValidationError,
    ViewCopy,
)
from tests.hybrid import HYBRID, MAMBA
from tests.transfer.copies import copy_plan, pair
from tests.transfer.pools import as_bytes
from tests.truth import Truth, window_starts
from tests.world import Layout, Side, ViewClass, instance

SLOTS = 4
REQUEST = 5  # the logical request whose state the sender holds
SIDE_STATE = ViewClass(("side",), "target", "replicated", 1, 1, 3, layers=MAMBA, per_request=True)

WORLDS = {
    # context TP4, state sharing the KV pool's slots -> generation TP2 x PP2
    "tp4-shared-to-tp2xpp2": (
        HYBRID,
        Side("context", 4, (6,), shared_state_pool=True, seed=1),
        Side("generation", 2, (3, 3), seed=2),
    ),
    # context TP2 -> generation TP4 with attention DP (2 groups of TP2), larger window
    "tp2-to-tp4-adp": (
        [*HYBRID[:3], replace(HYBRID[3], window=None)],
        Side("context", 2, (6,), windows=((3, 6),), seed=3),
        Side("generation", 4, (6,), dp_size=2, attention_dp=True, windows=((3, 9),), seed=4),
    ),
    # context TP2 x PP2 (uneven) -> generation TP1 with replicated side state
    "tp2xpp2-to-tp1-side-state": (
        [*HYBRID, SIDE_STATE],
        Side("context", 2, (4, 2), seed=5),
        Side("generation", 1, (6,), shared_state_pool=True, seed=6),
    ),
}
# Different tokens per block: the same hybrid, 2 -> 8 and 6 -> 4 tokens per block.
BLOCK_WORLDS = {
    "tp4-2-to-tp2-8": (
        HYBRID,
        Side("context", 4, (6,), tokens_per_block=2, num_slots=13, seed=7),
        Side("generation", 2, (3, 3), tokens_per_block=8, num_slots=4, seed=8),
    ),
    "tp2-6-to-tp4-4-shared": (
        [*HYBRID[:3], replace(HYBRID[3], window=5)],
        Side("context", 2, (6,), tokens_per_block=6, num_slots=4, seed=9),
        Side("generation", 4, (6,), tokens_per_block=4, num_slots=7, shared_state_pool=True,
             seed=10),
    ),
}  # fmt: skip


@dataclass
class Opened:
    cache: PoolMemoryCache
    backend: LocalBackend

    def pools(
        self, name: str, layout: Layout, arrays: dict[int, np.ndarray]
    ) -> dict[int, PoolMemory]:
        opened = {}
        for pool_id, (slot_bytes, stride, slots) in layout.pools.items():
            key = f"{name}-{pool_id}"
            self.backend.register(key, torch.from_numpy(as_bytes(arrays[pool_id])))
            pool = Pool(pool_id, slot_bytes, stride, slots)
            opened[pool_id] = self.cache.open_pool({"backend": "local", "name": key}, pool)
        return opened


def _world(name: str, opened: Opened, worlds=WORLDS, slots: int | None = SLOTS):
    """Sender slot ``s`` of every rank holds the prompt's block ``s`` (the last slot of a pool
    shared with state, or slot 1, the request's state)."""
    classes, ctx_side, gen_side = worlds[name]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx", slots)
    gen, gen_layouts = instance(gen_side, classes, "gen", slots)
    truth = Truth(classes)
    count = slots or ctx_side.num_slots
    src_slot = count - 1 if ctx_side.shared_state_pool else 1
    blocks = [b for b in range(count) if not (ctx_side.shared_state_pool and b == src_slot)]
    src_pools = {}
    for rank, layout in enumerate(ctx_layouts):
        filled = truth.fill(ctx_side, layout, rank, blocks, blocks, states={src_slot: REQUEST})
        for pool_id, memory in opened.pools(f"ctx{rank}", layout, filled).items():
            src_pools[(rank, pool_id)] = memory
    return classes, ctx_side, gen_side, ctx, gen, gen_layouts, truth, src_pools, src_slot


# (prompt tokens, source blocks, destination blocks): the whole prompt, or its last two blocks.
# With 4 tokens per block and a 6-token window the first block in the window is floor((L - 5) / 4).
REQUESTS = [(12, [0, 1, 2], [2, 0, 1]), (9, [0, 1, 2], [1, 2, 0]), (12, [1, 2], [2, 0])]


@pytest.mark.parametrize(("prompt", "src_blocks", "dst_blocks"), REQUESTS)
@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("world", list(WORLDS))
def test_hybrid_plans_copy_window_blocks_and_state_exactly(
    world, strategy, prompt, src_blocks, dst_blocks
) -> None:
    opened = Opened(PoolMemoryCache([backend := LocalBackend()]), backend)
    classes, ctx_side, gen_side, ctx, gen, layouts, truth, src_pools, src_slot = _world(
        world, opened
    )
    dst_slot = 3 if gen_side.shared_state_pool else 2
    starts = window_starts(ctx_side, gen_side, classes, prompt)
    tokens = gen_side.tokens_per_block
    placement = {d: s * tokens for s, d in zip(src_blocks, dst_blocks, strict=True)}
    for receiver, layout in zip(gen, layouts, strict=True):
        empty = {p: np.zeros(stride * n, np.int64) for p, (_, stride, n) in layout.pools.items()}
        dst_pools = opened.pools(f"gen{receiver.rank}", layout, empty)
        plan = CopyPlan.from_plan(build_plan(ctx, receiver))
        job = TransferJob([TransferLeg(plan, src_pools, dst_pools)], src_blocks, dst_blocks,
                          window=TokenWindow(prompt_tokens=prompt), src_state_slot=src_slot,
                          dst_state_slot=dst_slot)  # fmt: skip
        result = CopyEngine().copy(job, strategy=strategy)
        # A prompt-only job stops at the prompt's last token (issue 35), windowed views or not.
        want = truth.place(gen_side, layout, receiver.rank, placement, range(prompt),
                           starts=starts, states={dst_slot: REQUEST})  # fmt: skip
        _check_copied(result.bytes, plan, want, dst_pools, truth, gen_side, layout, dst_slot)
    opened.cache.close()


def _check_copied(copied, plan, want, dst_pools, truth, side, layout, dst_slot) -> None:
    """The receiver holds exactly ``want``; the job and the plan count the bytes they move."""
    rank = int(layout.doc["tp_rank"]) + int(layout.doc["pp_rank"]) * side.tp_size
    assert copied == sum(int((ids != 0).sum()) for ids in want.values())
    state = truth.place(side, layout, rank, {}, states={dst_slot: REQUEST})
    assert plan.state_bytes == sum(int((ids != 0).sum()) for ids in state.values())
    for pool_id, memory in dst_pools.items():
        np.testing.assert_array_equal(
            memory.tensor.numpy(), as_bytes(want[pool_id]), err_msg=f"rank {rank} pool {pool_id}"
        )


@pytest.mark.parametrize(("start", "end", "prompt"), [(0, 24, None), (3, 21, 23), (13, 17, None)])
@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("world", list(BLOCK_WORLDS))
def test_windows_between_block_sizes_copy_their_tokens_and_state_exactly(
    world, strategy, start, end, prompt
) -> None:
    """A token range cut mid-block on both sides; windowed layers from the window's first token
    (the later block start of either side), state once, between different block sizes."""
    opened = Opened(PoolMemoryCache([backend := LocalBackend()]), backend)
    classes, ctx_side, gen_side, ctx, gen, layouts, truth, src_pools, src_slot = _world(
        world, opened, BLOCK_WORLDS, None
    )
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    src_blocks = list(range(-(-end // ts)))  # the whole prompt from token 0, slot b = block b
    dst_blocks = list(range(gen_side.num_slots - 1))[::-1][: -(-end // td) - start // td]
    dst_slot = gen_side.num_slots - 1
    span = TokenRange(start, end)
    starts = window_starts(ctx_side, gen_side, classes, prompt or end)
    placement = {d: (start // td + i) * td for i, d in enumerate(dst_blocks)}
    for receiver, layout in zip(gen, layouts, strict=True):
        empty = {p: np.zeros(stride * n, np.int64) for p, (_, stride, n) in layout.pools.items()}
        dst_pools = opened.pools(f"gen{receiver.rank}", layout, empty)
        plan = CopyPlan.from_plan(build_plan(ctx, receiver))
        window = TokenWindow(span, src_first_token=0, prompt_tokens=prompt)
        job = TransferJob([TransferLeg(plan, src_pools, dst_pools)], src_blocks, dst_blocks,
                          window=window, src_state_slot=src_slot, dst_state_slot=dst_slot)  # fmt: skip
        result = CopyEngine().copy(job, strategy=strategy)
        want = truth.place(gen_side, layout, receiver.rank, placement, range(start, end),
                           starts=starts, states={dst_slot: REQUEST})  # fmt: skip
        _check_copied(result.bytes, plan, want, dst_pools, truth, gen_side, layout, dst_slot)
    opened.cache.close()


def _job(world: str = "tp4-shared-to-tp2xpp2", receiver: int = 3, **changes) -> TransferJob:
    """A job for one receiver rank of a world; ``changes`` override its slots, prompt or blocks."""
    opened = Opened(PoolMemoryCache([backend := LocalBackend()]), backend)
    _, _, _, ctx, gen, layouts, _, src_pools, src_slot = _world(world, opened)
    layout = layouts[receiver]
    empty = {p: np.zeros(stride * n, np.int64) for p, (_, stride, n) in layout.pools.items()}
    dst_pools = opened.pools(f"gen{receiver}", layout, empty)
    leg = TransferLeg(CopyPlan.from_plan(build_plan(ctx, gen[receiver])), src_pools, dst_pools)
    arguments = {"src_state_slot": src_slot, "dst_state_slot": 2, "prompt_tokens": 12} | changes
    blocks = arguments.pop("blocks", ([1, 2], [2, 0]))
    tokens, prompt = arguments.pop("tokens", None), arguments.pop("prompt_tokens")
    window = TokenWindow(tokens, prompt_tokens=prompt)
    return TransferJob([leg], *blocks, window=window, **arguments)


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"src_state_slot": None}, "src_state_slot", "moves recurrent state"),
        ({"dst_state_slot": None}, "dst_state_slot", "moves recurrent state"),
        ({"prompt_tokens": None}, "prompt_tokens", "sliding-window views"),
        ({"prompt_tokens": 4}, "src_blocks", "would start at token -4"),
        ({"dst_state_slot": 4}, "dst_state_slot", "state slot 4 is outside receiver pool 2"),
        ({"src_state_slot": 7}, "src_state_slot", "state slot 7 is outside sender rank"),
        ({"blocks": ([1, 2, 0], [2, 0, 9])}, "dst_blocks[2]", "block id 9 is outside"),
    ],
)
def test_jobs_that_cannot_copy_exactly_are_refused_by_name(changes, field, message) -> None:
    with pytest.raises(TransferValidationError) as refused:
        CopyEngine().validate(_job(**changes))
    assert refused.value.field == field
    assert message in str(refused.value)


def test_a_token_range_gives_the_prompt_length_and_must_not_contradict_it() -> None:
    # Without prompt_tokens the window is measured from the range's end.
    assert CopyEngine().validate(_job(prompt_tokens=None, tokens=TokenRange(4, 12))).bytes > 0
    # The window refuses it as it is built (the REST layer answers the same members, 422).
    with pytest.raises(PromptContradiction) as refused:
        _job(prompt_tokens=10, tokens=TokenRange(4, 12))
    assert (refused.value.code, refused.value.field) == (
        "prompt_tokens_contradicts_tokens",
        "prompt_tokens",
    )
    assert refused.value.extras == {"prompt_tokens": 10, "tokens": [4, 12]}
    assert "ends before tokens.end 12" in str(refused.value)


def test_a_state_slot_that_is_also_a_block_of_a_shared_pool_is_refused() -> None:
    # Generation TP1 keeps state in the KV pool's slots: slot 2 cannot be a block and the state.
    job = _job("tp2xpp2-to-tp1-side-state", receiver=0, dst_state_slot=2)
    assert job.legs[0].plan.shared_slot_pools == frozenset({0})
    with pytest.raises(TransferValidationError) as refused:
        CopyEngine().validate(job)
    assert refused.value.field == "dst_state_slot"
    assert "also dst_blocks[0]" in str(refused.value)
    # In its own state pool the same slot id is another slot: nothing to refuse.
    CopyEngine().validate(_job(dst_state_slot=2))


def test_two_senders_writing_one_state_byte_are_refused() -> None:
    def state(fragments: list[list[int]]) -> ViewCopy:
        return pair(fragments, pool=1, mapper="ssm", state=True)

    with pytest.raises(TransferValidationError, match="written twice"):
        copy_plan(
            PeerCopy(0, True, (), (state([[0, 0, 64]]),)),
            PeerCopy(1, True, (), (state([[0, 32, 64]]),)),
        )
    # A block fragment and a state fragment at the same offsets of one pool are different slots.
    block = pair([[0, 0, 64]], pool=1, mapper="ssm")
    plan = copy_plan(PeerCopy(0, True, (block,), (state([[0, 0, 64]]),)))
    assert (plan.state_bytes, plan.bytes_per_block) == (64, 64)
    assert plan.shared_slot_pools == frozenset({1})
