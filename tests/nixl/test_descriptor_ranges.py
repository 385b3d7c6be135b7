"""Plan -> NIXL descriptor lists for token ranges, hybrid requests and context parallelism, applied
as memcpy against the logical tensor."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvroute.client.nixl_descs import PoolAddress, plan_descriptors
from kvroute.geometry import Plan, RequestBlocks, TokenGap, TokenRange, TokenWindow, build_plan
from tests.hybrid import HYBRID
from tests.nixl.pulled import place_senders, pulled
from tests.truth import Truth, background, window_starts
from tests.world import Side, ViewClass, instance


def served(built: Plan, *, period: bool = False) -> Plan:
    """The plan as a client holds it: the served document read back (``PlanDocument.plan``)."""
    return Plan.from_json(built.to_json(period=period))


RANGE_WORLDS = {
    "hnd 2 -> 8, TP2 -> TP1": (
        [ViewClass(("key", "value"), "target", "hnd", 4, 2, 3)],
        Side("context", 2, (2,), tokens_per_block=2, num_slots=12, seed=1),
        Side("generation", 1, (2,), tokens_per_block=8, num_slots=4, seed=2),
    ),
    "nhd 6 -> 4, heads split": (
        [ViewClass(("key", "value"), "target", "nhd", 4, 2, 2)],
        Side("context", 1, (2,), tokens_per_block=6, num_slots=5, seed=3),
        Side("generation", 2, (2,), tokens_per_block=4, num_slots=7, seed=4),
    ),
    "hnd 4 -> 4 in the period form": (
        [ViewClass(("key", "value"), "target", "hnd", 4, 2, 3)],
        Side("context", 1, (2,), tokens_per_block=4, num_slots=7, seed=5),
        Side("generation", 2, (2,), tokens_per_block=4, num_slots=7, seed=6),
    ),
}


@pytest.mark.parametrize("form", ["served with period=True", "built here"])
@pytest.mark.parametrize("name", list(RANGE_WORLDS))
@pytest.mark.parametrize(("start", "end"), [(0, 24), (5, 23), (9, 11)])
def test_a_token_range_pulls_exactly_its_tokens(name: str, start: int, end: int, form: str) -> None:
    """Descriptors of a range cut mid-block, applied as memcpy, against the logical tensor; from
    the plan a client reads in the period form and from the planner's own (both forms)."""
    classes, ctx_side, gen_side = RANGE_WORLDS[name]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx")
    gen, gen_layouts = instance(gen_side, classes, "gen")
    truth, ts, td = Truth(classes), ctx_side.tokens_per_block, gen_side.tokens_per_block
    order = list(range(ctx_side.num_slots))[::-1]
    src_blocks = order[: -(-end // ts)]  # the whole prompt from token 0
    dst_blocks = list(range(gen_side.num_slots))[: -(-end // td) - start // td]  # the suffix
    senders, sender_pools = place_senders(truth, ctx_side, ctx_layouts, src_blocks)
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        built = build_plan(ctx, receiver)
        ((_, stride, slots),) = layout.pools.values()
        result = plan_descriptors(
            served(built, period=True) if form.startswith("served") else built,
            receiver_pools={0: PoolAddress(0, stride, slots)},
            sender_pools=sender_pools,
            blocks=RequestBlocks(
                src_blocks, dst_blocks, TokenWindow(TokenRange(start, end), src_first_token=0)
            ),
        )
        before = background(layout)
        got = pulled(result, senders, before[0])
        placement = {s: (start // td + i) * td for i, s in enumerate(dst_blocks)}
        want = truth.place(gen_side, layout, receiver.rank, placement, range(start, end), before)
        np.testing.assert_array_equal(got, want[0], err_msg=f"{name}: gen rank {receiver.rank}")
        assert result.bytes == int((want[0] != before[0]).sum())
        assert result.descriptors <= sum(p.fragments for p in result.peers)


def test_a_token_range_needs_the_period_form_and_the_lists_must_cover_it() -> None:
    classes, ctx_side, gen_side = RANGE_WORLDS["hnd 4 -> 4 in the period form"]
    ctx, _ = instance(ctx_side, classes, "ctx")
    gen, gen_layouts = instance(gen_side, classes, "gen")
    ((_, stride, slots),) = gen_layouts[0].pools.values()
    arguments: dict[str, Any] = {
        "receiver_pools": {0: PoolAddress(0, stride, slots)},
        "sender_pools": {0: {0: PoolAddress(1 << 32, 1 << 20, 7)}},
    }
    blocks_only = served(build_plan(ctx, gen[0]))
    with pytest.raises(ValueError, match="fetch the plan with period=True"):
        plan_descriptors(
            blocks_only, blocks=_two_blocks(TokenWindow(TokenRange(1, 7))), **arguments
        )
    # a prompt-only pull stops at the prompt's last token: the block form cannot cut it either
    with pytest.raises(ValueError, match="prompt-only transfer cuts the prompt's last block"):
        plan_descriptors(blocks_only, blocks=_two_blocks(TokenWindow(prompt_tokens=7)), **arguments)
    period = served(build_plan(ctx, gen[0]), period=True)
    with pytest.raises(TokenGap) as gap:
        plan_descriptors(
            period, blocks=_two_blocks(TokenWindow(TokenRange(1, 9), 0, 0)), **arguments
        )
    assert (gap.value.field, gap.value.token, gap.value.covered) == ("src_blocks", 8, (0, 8))


def _two_blocks(window: TokenWindow) -> RequestBlocks:
    return RequestBlocks([0, 1], [2, 3], window)


def _hybrid_world(ctx_tokens: int = 4, gen_tokens: int = 4):
    ctx_side = Side(
        "context", 4, (6,), tokens_per_block=ctx_tokens, num_slots=8, shared_state_pool=True, seed=1
    )
    gen_side = Side("generation", 2, (3, 3), tokens_per_block=gen_tokens, num_slots=8, seed=2)
    ctx, ctx_layouts = instance(ctx_side, HYBRID, "ctx")
    gen, gen_layouts = instance(gen_side, HYBRID, "gen")
    return ctx_side, gen_side, ctx, ctx_layouts, gen, gen_layouts  # fmt: skip


def _address(rank: int, pool: int, offset: int = 0) -> int:
    return ((rank + 1) << 32) + (pool << 24) + offset


# (tokens per block on each side, request): issue 12's paired suffix lists with the prompt length,
# and a token range cut mid-block between block sizes (the window measured from its end).
HYBRID_REQUESTS = {
    "4 -> 4, paired, prompt 12": ((4, 4), {"src_blocks": [0, 1, 2], "dst_blocks": [2, 0, 1],
                                           "prompt_tokens": 12}),
    # issue 35: a prompt-only pull stops at the prompt's last token, windowed views or not, and
    # the receiver's cached prefix (one block) leaves its list shorter
    "4 -> 4, prompt 10, cached block": ((4, 4), {"src_blocks": [0, 1, 2], "dst_blocks": [5, 3],
                                                "prompt_tokens": 10}),
    "2 -> 8, prompt 13": ((2, 8), {"src_blocks": [2, 3, 4, 5, 6], "dst_blocks": [2, 0],
                                   "prompt_tokens": 13}),
    "2 -> 8, tokens [3, 13)": ((2, 8), {"src_blocks": [0, 1, 2, 3, 4, 5, 6], "dst_blocks": [2, 0],
                                        "tokens": (3, 13), "src_first_token": 0}),
    "6 -> 4, tokens [5, 12), prompt 14": ((6, 4), {"src_blocks": [0, 1], "dst_blocks": [3, 1],
                                                   "tokens": (5, 12), "src_first_token": 0,
                                                   "prompt_tokens": 14}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HYBRID_REQUESTS))
def test_hybrid_descriptors_pull_the_window_and_the_state_slot(name: str) -> None:
    """Per request: the windowed layer's tokens from the window on, the state slot once."""
    (ts, td), request = HYBRID_REQUESTS[name]
    ctx_side, gen_side, ctx, ctx_layouts, gen, gen_layouts = _hybrid_world(ts, td)
    truth, src_slot, dst_slot = Truth(HYBRID), 7, 6
    placement = {b: b * ts for b in request["src_blocks"]}  # sender slot b holds block b
    sender = {
        r: truth.place(ctx_side, layout, r, placement, states={src_slot: 5})
        for r, layout in enumerate(ctx_layouts)
    }
    tokens = request.get("tokens")
    prompt = request.get("prompt_tokens") or tokens[1]
    if tokens is None:  # the prompt's last blocks: the tokens both hold, up to the prompt's end
        src_first, dst_first = (
            (-(-prompt // size) - len(request[name])) * size
            for name, size in (("src_blocks", ts), ("dst_blocks", td))
        )
        tokens = (max(src_first, dst_first), prompt)
        first = dst_first // td
    else:
        first = tokens[0] // td
    want_placement = {d: (first + i) * td for i, d in enumerate(request["dst_blocks"])}
    positions = range(*tokens)
    starts = window_starts(ctx_side, gen_side, HYBRID, prompt)
    named = request.get("tokens")
    window = TokenWindow(
        None if named is None else TokenRange(*named),
        request.get("src_first_token"),
        prompt_tokens=request.get("prompt_tokens"),
    )
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        result = plan_descriptors(
            build_plan(ctx, receiver),
            receiver_pools={p: PoolAddress(_address(-1, p), s, n) for p, (_, s, n) in layout.pools.items()},
            sender_pools={
                r: {p: PoolAddress(_address(r, p), s, n) for p, (_, s, n) in lay.pools.items()}
                for r, lay in enumerate(ctx_layouts)
            },
            blocks=RequestBlocks(request["src_blocks"], request["dst_blocks"], window, src_slot,
                                 dst_slot),
        )  # fmt: skip
        out = {p: np.zeros(s * n, np.int64) for p, (_, s, n) in layout.pools.items()}
        for descs in result.peers:
            for (dst, length, _), (src, _, _) in zip(descs.local, descs.remote, strict=True):
                rank, pool, offset = (src >> 32) - 1, (src >> 24) & 0xFF, src & 0xFFFFFF
                target = out[(dst >> 24) & 0xFF]
                target[dst & 0xFFFFFF : (dst & 0xFFFFFF) + length] = sender[rank][pool][
                    offset : offset + length
                ]
        want = truth.place(gen_side, layout, receiver.rank, want_placement, positions,
                           starts=starts, states={dst_slot: 5})  # fmt: skip
        for pool, ids in want.items():
            np.testing.assert_array_equal(
                out[pool], ids, err_msg=f"rank {receiver.rank} pool {pool}"
            )


@pytest.mark.parametrize(
    ("missing", "message"),
    [("src_state_slot", "moves recurrent state"), ("prompt_tokens", "sliding-window views")],
)
def test_hybrid_descriptors_need_the_state_slots_and_the_prompt(missing: str, message: str) -> None:
    _, _, ctx, _, gen, gen_layouts = _hybrid_world()
    arguments: dict[str, Any] = {"src_state_slot": 3, "dst_state_slot": 1, "prompt_tokens": 12}
    arguments[missing] = None
    window = TokenWindow(prompt_tokens=arguments.pop("prompt_tokens"))
    pools = {p: PoolAddress(0, s, n) for p, (_, s, n) in gen_layouts[3].pools.items()}
    with pytest.raises(ValueError, match=message):
        plan_descriptors(
            build_plan(ctx, gen[3]), receiver_pools=pools,
            sender_pools={r: pools for r in range(4)},
            blocks=RequestBlocks([0, 1, 2], [2, 0, 1], window, **arguments),
        )  # fmt: skip


CP_WORLDS = {
    "MLA latent TP2 -> TP1 x CP2, 4 -> 2 tokens/block": (
        [ViewClass(("latent",), "target", "replicated", 1, 1, 3)],
        Side("context", 2, (2,), tokens_per_block=4, num_slots=7, seed=7),
        Side("generation", 1, (2,), tokens_per_block=2, num_slots=8, seed=8, cp_size=2),
    ),
    "hnd TP2 x CP2 (helix, interleave 4) -> TP2 x CP4 (interleave 1)": (
        [ViewClass(("key", "value"), "target", "hnd", 4, 2, 2)],
        Side(
            "context", 2, (2,), tokens_per_block=4, num_slots=7, seed=9, cp_size=2, cp_interleave=4
        ),
        Side("generation", 2, (2,), tokens_per_block=2, num_slots=8, seed=10, cp_size=4),
    ),
    "hnd TP2 x CP2 zig-zag (24-token prompt) -> TP2 x CP4 (interleave 1)": (
        [ViewClass(("key", "value"), "target", "hnd", 4, 2, 2)],
        Side(
            "context",
            2,
            (2,),
            tokens_per_block=4,
            num_slots=7,
            seed=11,
            cp_size=2,
            cp_layout="zigzag",
            prompt_tokens=24,
        ),
        Side("generation", 2, (2,), tokens_per_block=2, num_slots=8, seed=12, cp_size=4),
    ),
    "MLA latent TP1 x CP3 contiguous (24-token prompt) -> TP1, 4 -> 8 tokens/block": (
        [ViewClass(("latent",), "target", "replicated", 1, 1, 3)],
        Side(
            "context",
            1,
            (2,),
            tokens_per_block=4,
            num_slots=7,
            seed=13,
            cp_size=3,
            cp_layout="contiguous",
            prompt_tokens=24,
        ),
        Side("generation", 1, (2,), tokens_per_block=8, num_slots=8, seed=14),
    ),
}


def _held(side: Side, end: int) -> int:
    """The most prompt positions before ``end`` any CP rank holds."""
    return max(
        sum(1 for t in range(end) if side.holder(t)[0] == cp_rank)
        for cp_rank in range(side.cp_size)
    )


@pytest.mark.parametrize("name", list(CP_WORLDS))
@pytest.mark.parametrize(("start", "end"), [(0, 24), (5, 23)])
def test_cp_descriptors_pull_each_token_from_the_rank_holding_it(
    name: str, start: int, end: int
) -> None:
    """Context parallel sides: the CP ranks share one list of local blocks from token 0."""
    classes, ctx_side, gen_side = CP_WORLDS[name]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx")
    gen, gen_layouts = instance(gen_side, classes, "gen")
    truth, ts, td = Truth(classes), ctx_side.tokens_per_block, gen_side.tokens_per_block
    src_blocks = list(range(ctx_side.num_slots))[::-1][: -(-_held(ctx_side, end) // ts)]
    dst_blocks = list(range(gen_side.num_slots))[: -(-_held(gen_side, end) // td)]
    senders, sender_pools = place_senders(truth, ctx_side, ctx_layouts, src_blocks)
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        ((_, stride, slots),) = layout.pools.values()
        prompt = ctx_side.prompt_tokens if ctx_side.chunked else None
        result = plan_descriptors(
            build_plan(ctx, receiver, prompt_tokens=prompt),
            receiver_pools={0: PoolAddress(0, stride, slots)},
            sender_pools=sender_pools,
            blocks=RequestBlocks(
                src_blocks, dst_blocks, TokenWindow(TokenRange(start, end), 0, 0, prompt)
            ),
        )
        before = background(layout)
        got = pulled(result, senders, before[0])
        placement = {s: i * td for i, s in enumerate(dst_blocks)}
        want = truth.place(gen_side, layout, receiver.rank, placement, range(start, end), before)
        np.testing.assert_array_equal(got, want[0], err_msg=f"{name}: gen rank {receiver.rank}")
        assert result.bytes == int((want[0] != before[0]).sum())
