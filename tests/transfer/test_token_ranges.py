"""Token ranges on the copy engine: different block sizes both ways and mid-block starts and ends.

Plans come from ``kvroute.geometry.build_plan`` over the worlds of ``tests/world.py``; every pool is a
real CPU byte buffer. The expected receiver bytes are the world's first-principles ones for the
tokens of the range, laid over the receiver's previous contents, which must survive everywhere else
(the cached prefix in a cut block included).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.geometry import Plan, Pool, TokenRange, TokenWindow, build_plan
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
from tests.executor import Request, execute
from tests.transfer.pools import as_bytes
from tests.truth import Truth, background
from tests.world import Side, ViewClass, instance

KV = ViewClass(("key", "value"), "target", "hnd", total_heads=4, buffers=2, unit=3)
KV_NHD = ViewClass(("key", "value"), "target", "nhd", total_heads=4, buffers=2, unit=2)
INDEX = ViewClass(("index_key",), "target", "replicated", total_heads=1, buffers=1, unit=5)
SCALES = ViewClass(
    ("key_block_scale", "value_block_scale"), "target", "hnd", 4, 2, 1, "float8_e4m3fn"
)
SLOTS = 12
NAMES = itertools.count()  # every receiver buffer is registered under a name of its own


def _sides(ctx_tokens: int, gen_tokens: int, ctx_tp: int, gen_tp: int) -> tuple[Side, Side]:
    ctx = Side("context", ctx_tp, (2,), tokens_per_block=ctx_tokens, num_slots=SLOTS, seed=1)
    gen = Side("generation", gen_tp, (2,), tokens_per_block=gen_tokens, num_slots=SLOTS, seed=2)
    return ctx, gen


WORLDS = {
    "hnd 2 -> 8, TP2 -> TP1, indexer": ([KV, INDEX], *_sides(2, 8, 2, 1)),
    "hnd 8 -> 2, TP1 -> TP2, scales": ([KV, SCALES], *_sides(8, 2, 1, 2)),
    "nhd 3 -> 4, heads halved": ([KV_NHD], *_sides(3, 4, 1, 2)),
    "nhd 4 -> 4 (equal), TP2 -> TP1": ([KV_NHD, INDEX], *_sides(4, 4, 2, 1)),
    "hnd 4 -> 4 (equal), TP1 -> TP2": ([KV], *_sides(4, 4, 1, 2)),
    # Sizes that do not divide one another: a receiver block holds one piece or two, so its
    # fragments differ from block to block (the exactly-once check once took that for a clash).
    "hnd 6 -> 4, TP2 -> TP4, indexer": ([KV, INDEX], *_sides(6, 4, 2, 4)),
    "hnd 4 -> 6, TP1 -> TP1": ([KV], *_sides(4, 6, 1, 1)),
}


@dataclass
class Bench:
    """A world's pools on CPU byte buffers: senders hold prompt positions 0.. in a shuffled order."""

    name: str
    ctx: list
    truth: Truth
    ctx_side: Side
    gen_side: Side
    src_pools: dict
    gen: list
    gen_layouts: list
    ctx_layouts: list
    sender_arrays: dict
    sender_order: list[int]
    backend: LocalBackend
    cache: PoolMemoryCache
    device: str = "cpu"


def _open(b: Bench, cache, name: str, layout, arrays: dict[int, np.ndarray]) -> dict:
    """Registers ``arrays`` (low byte of each id) as pools on the bench's device; opens them."""
    pools = {}
    for pool_id, (slot_bytes, stride, slots) in layout.pools.items():
        tensor = torch.from_numpy(as_bytes(arrays[pool_id])).to(b.device)
        b.backend.register(f"{name}-{pool_id}", tensor)
        descriptor = {"backend": "local", "name": f"{name}-{pool_id}"}
        pools[pool_id] = cache.open_pool(descriptor, Pool(pool_id, slot_bytes, stride, slots))
    return pools


def _bench(name: str, device: str) -> Bench:
    classes, ctx_side, gen_side = WORLDS[name]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx")
    gen, gen_layouts = instance(gen_side, classes, "gen")
    truth = Truth(classes)
    order = list(np.random.default_rng(5).permutation(SLOTS))
    placement = {slot: i * ctx_side.tokens_per_block for i, slot in enumerate(order)}
    backend = LocalBackend()
    cache = PoolMemoryCache([backend])
    b = Bench(
        name, ctx, truth, ctx_side, gen_side, {}, gen, gen_layouts, ctx_layouts, {},
        order, backend, cache, device,
    )  # fmt: skip
    for rank, layout in enumerate(ctx_layouts):
        b.sender_arrays[rank] = truth.place(ctx_side, layout, rank, placement)
        for pool_id, memory in _open(b, cache, f"ctx{rank}", layout, b.sender_arrays[rank]).items():
            b.src_pools[(rank, pool_id)] = memory
    return b


BENCHES: dict[tuple[str, str], Bench] = {}


def bench(name: str, device: str = "cpu") -> Bench:
    if (name, device) not in BENCHES:
        BENCHES[name, device] = _bench(name, device)
    return BENCHES[name, device]


def run_range(
    b: Bench, span: TokenRange, dst_first: int, strategy: Strategy, named_src: bool
) -> None:
    """Moves ``span`` into receiver lists starting at ``dst_first``; checks every receiver byte."""
    ts, td = b.ctx_side.tokens_per_block, b.gen_side.tokens_per_block
    # a named sender list holds the whole prompt from token 0; a suffix list starts at the block
    # holding the range's first token, as upstream's rule derives it
    src_blocks = b.sender_order[0 if named_src else span.start // ts : -(-span.end // ts)]
    dst_blocks = list(range(SLOTS))[::-1][: -(-span.end // td) - dst_first // td]
    window = TokenWindow(span, 0 if named_src else None, dst_first)
    request = Request(src_blocks, dst_blocks, span, (window.src_first_token, dst_first))
    run_job(b, window, request, dst_first, range(span.start, span.end), strategy)


def run_job(
    b: Bench,
    window: TokenWindow,
    request: Request,
    dst_first: int,
    positions: range,
    strategy: Strategy,
) -> None:
    """Runs the request on every receiver rank: exactly ``positions`` arrive, nothing else moves."""
    td = b.gen_side.tokens_per_block
    src_blocks, dst_blocks = request.src_blocks, request.dst_blocks
    for receiver, layout in zip(b.gen, b.gen_layouts, strict=True):
        before = background(layout)
        dst_pools = _open(b, b.cache, f"gen{receiver.rank}-{next(NAMES)}", layout, before)
        plan = build_plan(b.ctx, receiver)
        leg = TransferLeg(CopyPlan.from_plan(plan), b.src_pools, dst_pools)
        job = TransferJob([leg], src_blocks, dst_blocks, window=window)
        result = CopyEngine().copy(job, strategy=strategy)
        if b.device != "cpu":
            torch.cuda.synchronize()
        placement = {block: (dst_first // td + i) * td for i, block in enumerate(dst_blocks)}
        want = b.truth.place(b.gen_side, layout, receiver.rank, placement, positions, before)
        moved = sum(int((want[p] != before[p]).sum()) for p in want)
        assert result.bytes == moved
        for pool_id, memory in dst_pools.items():
            np.testing.assert_array_equal(
                memory.tensor.cpu().numpy(),
                as_bytes(want[pool_id]),
                err_msg=f"pool {pool_id}",
            )
        # the world's own executor of the period form agrees on the int64 ids, byte for byte
        out, writes = execute(
            plan.to_json(period=True), b.sender_arrays, dict(enumerate(b.ctx_layouts)), layout,
            request, into=before,
        )  # fmt: skip
        for pool_id in want:
            np.testing.assert_array_equal(out[pool_id], want[pool_id])
            assert writes[pool_id].max(initial=0) <= 1


@pytest.mark.parametrize("strategy", [Strategy.BLOCKWISE, Strategy.GATHER, Strategy.INDEXED])
@pytest.mark.parametrize("name", list(WORLDS))
def test_a_receiver_with_a_cached_prefix_gets_the_suffix(name: str, strategy: Strategy) -> None:
    b = bench(name)
    td = b.gen_side.tokens_per_block
    # cached prefix of 5 tokens (mid-block on both sides), prompt of 23 tokens (mid-block too)
    run_range(b, TokenRange(5, 23), dst_first=5 // td * td, strategy=strategy, named_src=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(list(WORLDS)),
    start=st.integers(0, 22),
    length=st.integers(1, 14),
    strategy=st.sampled_from(list(Strategy)),
    named_src=st.booleans(),
)
def test_random_ranges_move_exactly_their_tokens(
    name: str, start: int, length: int, strategy: Strategy, named_src: bool
) -> None:
    b = bench(name)
    span = TokenRange(start, min(start + length, 24))
    run_range(b, span, dst_first=start, strategy=strategy, named_src=named_src)


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("name", list(WORLDS))
@pytest.mark.parametrize(("src_cached", "dst_cached"), [(0, 0), (5, 0), (0, 5), (9, 13)])
def test_prompt_only_lists_move_the_tokens_both_hold_up_to_the_prompts_end(
    name: str, strategy: Strategy, src_cached: int, dst_cached: int
) -> None:
    """A job naming only the prompt's length: each list is the prompt's last blocks (upstream's
    suffix rule), either side may leave a cached prefix out; the tokens both lists hold move, up
    to the prompt's last token, and no byte past it (issue 20: these were refused, or wrote the
    bytes of positions after the prompt; issue 35: with equal block sizes they moved whole blocks,
    past the prompt, and lists of different lengths were refused)."""
    b = bench(name)
    prompt = 23
    ts, td = b.ctx_side.tokens_per_block, b.gen_side.tokens_per_block
    src_first, dst_first = src_cached // ts * ts, dst_cached // td * td
    src_blocks = b.sender_order[src_first // ts : -(-prompt // ts)]
    dst_blocks = list(range(SLOTS))[::-1][: -(-prompt // td) - dst_first // td]
    request = Request(src_blocks, dst_blocks, prompt_tokens=prompt)
    window = TokenWindow(prompt_tokens=prompt)
    positions = range(max(src_first, dst_first), prompt)
    run_job(b, window, request, dst_first, positions, strategy)


def test_a_gap_is_refused_before_anything_is_copied() -> None:
    b = bench("hnd 2 -> 8, TP2 -> TP1, indexer")
    before = background(b.gen_layouts[0])
    dst_pools = _open(b, b.cache, "gen-gap", b.gen_layouts[0], before)
    plan = CopyPlan.from_plan(build_plan(b.ctx, b.gen[0]))
    leg = TransferLeg(plan, b.src_pools, dst_pools)
    # the sender's list holds tokens [4, 12) (blocks of 2); the range needs [6, 14)
    job = TransferJob(
        [leg], b.sender_order[2:6], [0, 1], window=TokenWindow(TokenRange(6, 14), 4, 0)
    )
    with pytest.raises(TransferValidationError) as refused:
        CopyEngine().validate(job)
    error = refused.value
    assert (error.code, error.field) == ("token_range_not_covered", "src_blocks")
    assert error.extras == {"token": 12, "covered": [4, 12], "tokens": [6, 14]}
    for pool_id, memory in dst_pools.items():
        assert np.array_equal(memory.tensor.numpy(), as_bytes(before[pool_id]))


def test_a_cut_range_costs_the_fragments_of_its_blocks() -> None:
    b = bench("hnd 2 -> 8, TP2 -> TP1, indexer")
    plan = CopyPlan.from_plan(build_plan(b.ctx, b.gen[0]))
    engine = CopyEngine()
    dst_pools = _open(b, b.cache, "gen-count", b.gen_layouts[0], background(b.gen_layouts[0]))
    leg = TransferLeg(plan, b.src_pools, dst_pools)
    aligned = TransferJob([leg], b.sender_order[:8], [3, 4], window=TokenWindow(TokenRange(0, 16)))
    cut = TransferJob([leg], b.sender_order[:8], [3, 4], window=TokenWindow(TokenRange(1, 15)))
    whole, partial = engine.totals(aligned), engine.totals(cut)
    per_token = whole.bytes // 16
    assert partial.bytes == per_token * 14
    # 2 -> 8: fragments never cross a sender block, so a token range costs what its blocks cost
    assert whole.fragments == plan.fragments_per_block * 2
    assert partial.fragments == whole.fragments


def test_a_plan_with_block_fragments_only_cannot_cut_a_range() -> None:
    b = bench("hnd 4 -> 4 (equal), TP1 -> TP2")
    document = build_plan(b.ctx, b.gen[0]).to_json()  # as a worker fetches it: block form
    dst_pools = _open(b, b.cache, "gen-blocks", b.gen_layouts[0], background(b.gen_layouts[0]))
    leg = TransferLeg(CopyPlan.from_plan(Plan.from_json(document)), b.src_pools, dst_pools)
    job = TransferJob([leg], [0, 1], [0, 1], window=TokenWindow(TokenRange(2, 8)))
    with pytest.raises(TransferValidationError, match="needs the plan's period form"):
        CopyEngine().validate(job)
    # the same plan in its period form cuts the range: 6 tokens of a 4-token-per-block world
    period = CopyPlan.from_plan(Plan.from_json(build_plan(b.ctx, b.gen[0]).to_json(period=True)))
    cut = TransferJob(
        [TransferLeg(period, b.src_pools, dst_pools)], [0, 1], [0, 1], window=job.window
    )
    assert CopyEngine().totals(cut).bytes == 6 * period.bytes_per_block // 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("name", ["hnd 2 -> 8, TP2 -> TP1, indexer", "nhd 3 -> 4, heads halved"])
def test_cuda_pools_move_the_same_ranges(name: str, strategy: Strategy) -> None:
    b = bench(name, "cuda:0")
    run_range(b, TokenRange(5, 23), dst_first=3, strategy=strategy, named_src=False)


CHUNKED_WORLDS = {
    "hnd TP1 x CP2 zig-zag -> TP2 x CP2 (interleave 1), 4 -> 2 tokens/block": (
        [KV, INDEX],
        Side(
            "context",
            1,
            (2,),
            tokens_per_block=4,
            num_slots=SLOTS,
            seed=3,
            cp_size=2,
            cp_layout="zigzag",
            prompt_tokens=22,
        ),
        Side("generation", 2, (2,), tokens_per_block=2, num_slots=SLOTS, seed=4, cp_size=2),
    ),
    "nhd TP2 x CP3 contiguous -> TP1, 4 -> 3 tokens/block": (
        [KV_NHD],
        Side(
            "context",
            2,
            (2,),
            tokens_per_block=4,
            num_slots=SLOTS,
            seed=5,
            cp_size=3,
            cp_layout="contiguous",
            prompt_tokens=22,
        ),
        Side("generation", 1, (2,), tokens_per_block=3, num_slots=SLOTS, seed=6),
    ),
}


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("name", list(CHUNKED_WORLDS))
def test_prefill_chunks_arrive_on_the_cp_rank_holding_each_token(
    name: str, strategy: Strategy
) -> None:
    """A context instance holding zig-zag or contiguous chunks of a 22-token prompt (each CP rank
    its chunks from local block 0, one shared list), a receiver with 5 tokens cached: the copy
    engine and the world's executor move exactly tokens [5, 22), each from the rank holding it."""
    classes, ctx_side, gen_side = CHUNKED_WORLDS[name]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx")
    truth, ts, td = Truth(classes), ctx_side.tokens_per_block, gen_side.tokens_per_block
    order = [int(s) for s in np.random.default_rng(7).permutation(SLOTS)][: -(-12 // ts)]
    backend = LocalBackend()
    b = Bench(
        name, ctx, truth, ctx_side, gen_side, {}, *instance(gen_side, classes, "gen"),
        ctx_layouts, {}, order, backend, PoolMemoryCache([backend]),
    )  # fmt: skip
    for rank, layout in enumerate(ctx_layouts):
        arrays = truth.place(ctx_side, layout, rank, {s: i * ts for i, s in enumerate(order)})
        b.sender_arrays[rank] = arrays
        for pool_id, memory in _open(b, b.cache, f"cctx{next(NAMES)}", layout, arrays).items():
            b.src_pools[(rank, pool_id)] = memory
    # The receiver's list starts at the first local block any of its CP ranks needs from token 5
    # (CP2 rank 1 holds 2 tokens before it) and ends with the last one the rank holding most needs.
    cp = gen_side.cp_size > 1
    first_block, held = (2, 11) if cp else (5, 22)
    first_block //= td
    dst_blocks = list(range(SLOTS))[::-1][: -(-held // td) - first_block]
    window = TokenWindow(TokenRange(5, 22), 0, 5, 22)
    request = Request(order, dst_blocks, TokenRange(5, 22), (0, 5), prompt_tokens=22)
    run_chunked(b, window, request, first_block * td, strategy)


def run_chunked(
    b: Bench, window: TokenWindow, request: Request, dst_start: int, strategy: Strategy
) -> None:
    td = b.gen_side.tokens_per_block
    for receiver, layout in zip(b.gen, b.gen_layouts, strict=True):
        before = background(layout)
        dst_pools = _open(b, b.cache, f"gen{receiver.rank}-{next(NAMES)}", layout, before)
        plan = build_plan(b.ctx, receiver, prompt_tokens=22)
        leg = TransferLeg(CopyPlan.from_plan(plan), b.src_pools, dst_pools)
        job = TransferJob([leg], request.src_blocks, request.dst_blocks, window=window)
        result = CopyEngine().copy(job, strategy=strategy)
        placement = {block: dst_start + i * td for i, block in enumerate(request.dst_blocks)}
        want = b.truth.place(b.gen_side, layout, receiver.rank, placement, range(5, 22), before)
        assert result.bytes == sum(int((want[p] != before[p]).sum()) for p in want)
        for pool_id, memory in dst_pools.items():
            np.testing.assert_array_equal(
                memory.tensor.cpu().numpy(), as_bytes(want[pool_id]), err_msg=f"{pool_id}"
            )
        out, writes = execute(
            plan.to_json(), b.sender_arrays, dict(enumerate(b.ctx_layouts)), layout, request,
            into=before,
        )  # fmt: skip
        for pool_id in want:
            np.testing.assert_array_equal(out[pool_id], want[pool_id])
            assert writes[pool_id].max(initial=0) <= 1
