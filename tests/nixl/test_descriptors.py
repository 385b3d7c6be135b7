"""Plan -> NIXL descriptor lists: exact addresses, coalescing rules, refusals, and equivalence."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvroute.client.nixl_descs import PoolAddress, plan_descriptors
from kvroute.client.pools import KvLayout, Parallel, SharedKvPool, rank_document
from kvroute.geometry import Kind, Owner, RankRegistration, TokenGap, build_plan
from tests.hybrid import HYBRID
from tests.truth import Truth, background, window_starts
from tests.world import Side, ViewClass, instance


def plan(*peers: dict[str, Any]) -> dict[str, Any]:
    return {"peers": list(peers), "expected_writers": sum(1 for p in peers if p["sends"])}


def peer(rank: int, *views: dict[str, Any]) -> dict[str, Any]:
    return {"rank": rank, "sends": any(v["fragments"] for v in views), "views": list(views)}


def view(fragments: list[list[int]], src_pool: int = 0, dst_pool: int = 0) -> dict[str, Any]:
    return {"src_view": 0, "src_pool": src_pool, "dst_pool": dst_pool, "fragments": fragments}


RECEIVER = {0: PoolAddress(base=100_000, slot_stride=64, num_slots=16)}
SENDER = {0: PoolAddress(base=5_000, slot_stride=64, num_slots=16, device=1)}


def test_fragment_addresses_are_exact() -> None:
    result = plan_descriptors(
        plan(peer(0, view([[0, 0, 16], [16, 32, 16]]))),
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER},
        src_blocks=[0, 3],
        dst_blocks=[2, 9],
    )
    [descs] = result.peers
    assert descs.local == (
        (100_000 + 2 * 64, 16, 0),
        (100_000 + 2 * 64 + 32, 16, 0),
        (100_000 + 9 * 64, 16, 0),
        (100_000 + 9 * 64 + 32, 16, 0),
    )
    assert descs.remote == (
        (5_000, 16, 1),
        (5_016, 16, 1),
        (5_000 + 3 * 64, 16, 1),
        (5_000 + 3 * 64 + 16, 16, 1),
    )
    assert (descs.bytes, descs.fragments, result.expected_notifications) == (64, 4, 1)


def test_runs_contiguous_on_both_sides_merge_across_blocks() -> None:
    whole_slot = plan(peer(0, view([[0, 0, 32], [32, 32, 32]])))
    consecutive = plan_descriptors(
        whole_slot,
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER},
        src_blocks=[0, 1, 2],
        dst_blocks=[5, 6, 7],
    )
    assert consecutive.peers[0].local == ((100_000 + 5 * 64, 192, 0),)
    assert consecutive.peers[0].remote == ((5_000, 192, 1),)
    assert consecutive.descriptors == 1
    assert consecutive.peers[0].fragments == 6
    gap = plan_descriptors(
        whole_slot,
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER},
        src_blocks=[0, 1, 2],
        dst_blocks=[5, 7, 8],
    )
    assert [length for _, length, _ in gap.peers[0].local] == [64, 128]


def test_runs_never_cross_pools_even_when_adjacent() -> None:
    receiver = {0: PoolAddress(0, 64, 1), 1: PoolAddress(64, 64, 1)}
    sender = {0: PoolAddress(1000, 64, 1), 1: PoolAddress(1064, 64, 1)}
    result = plan_descriptors(
        plan(peer(0, view([[0, 0, 64]], 0, 0), view([[0, 0, 64]], 1, 1))),
        receiver_pools=receiver,
        sender_pools={0: sender},
        src_blocks=[0],
        dst_blocks=[0],
    )
    assert result.peers[0].local == ((0, 64, 0), (64, 64, 0))


def test_silent_peers_get_no_list_and_notifications_count_writers() -> None:
    result = plan_descriptors(
        plan(peer(0, view([[0, 0, 8]])), peer(1, view([])), peer(2, view([[8, 8, 8]]))),
        receiver_pools=RECEIVER,
        sender_pools={0: SENDER, 2: SENDER},
        src_blocks=[1],
        dst_blocks=[1],
    )
    assert [p.rank for p in result.peers] == [0, 2]
    assert result.expected_notifications == 2
    assert result.bytes == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"src_blocks": [0], "dst_blocks": [0, 1]}, "1 source blocks but 2"),
        ({"src_blocks": [16], "dst_blocks": [0]}, "16 slots"),
        ({"src_blocks": [0], "dst_blocks": [-1]}, "receiver pool 0 has 16 slots"),
        ({"src_blocks": [0], "dst_blocks": [0], "sender_pools": {}}, "sender rank 0"),
        ({"src_blocks": [0], "dst_blocks": [0], "receiver_pools": {}}, "receiver pool 0"),
    ],
)
def test_bad_inputs_are_named(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"receiver_pools": RECEIVER, "sender_pools": {0: SENDER}, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan_descriptors(plan(peer(0, view([[0, 0, 8]]))), **arguments)


def test_fragment_beyond_the_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds the slot stride"):
        plan_descriptors(
            plan(peer(0, view([[60, 0, 8]]))),
            receiver_pools=RECEIVER,
            sender_pools={0: SENDER},
            src_blocks=[0],
            dst_blocks=[0],
        )


def _rank(
    role: str, tp: int, rank: int, kind: Kind, blocks: int
) -> tuple[RankRegistration, SharedKvPool]:
    target = KvLayout(kind, 4, 8 // tp, 4, 8, "bfloat16", total_kv_heads=8)
    draft = KvLayout(kind, 1, 1, 4, 8, "bfloat16", owner=Owner.DRAFT, total_kv_heads=1)
    pool = SharedKvPool.carve([target, draft], blocks)
    doc = rank_document(
        role=role,
        target=target,
        pools=[pool.describe()],
        num_draft_layers=1,
        parallel=Parallel(tp_size=tp, tp_rank=rank),
    )
    reg = RankRegistration.from_json(doc, deployment="d", instance=role, rank=rank)
    return reg, pool


@pytest.mark.parametrize("kind", [Kind.HND, Kind.NHD])
def test_descriptors_move_exactly_what_the_fragments_move(kind: Kind) -> None:
    """Coalesced descriptors applied as memcpy == every fragment applied one by one."""
    senders = [_rank("context", 4, r, kind, 6) for r in range(4)]
    receiver, _ = _rank("generation", 2, 1, kind, 6)
    document = build_plan([reg for reg, _ in senders], receiver).to_json()
    rng = np.random.default_rng(0)
    sender_bytes = {
        r: rng.integers(0, 256, pool.buffer.numel(), dtype=np.uint8)
        for r, (_, pool) in enumerate(senders)
    }
    stride_s = senders[0][1].slot_stride
    stride_r = receiver.pools[0].slot_stride
    bases = {r: (r + 1) << 32 for r in range(4)}
    src_blocks, dst_blocks = [4, 0, 1, 2], [0, 1, 2, 5]
    result = plan_descriptors(
        document,
        receiver_pools={0: PoolAddress(0, stride_r, 6)},
        sender_pools={r: {0: PoolAddress(bases[r], stride_s, 6)} for r in range(4)},
        src_blocks=src_blocks,
        dst_blocks=dst_blocks,
    )
    by_descriptors = np.zeros(stride_r * 6, dtype=np.uint8)
    for descs in result.peers:
        for (dst, length, _), (src, _, _) in zip(descs.local, descs.remote, strict=True):
            offset = src - bases[descs.rank]
            by_descriptors[dst : dst + length] = sender_bytes[descs.rank][offset : offset + length]
    by_fragments = np.zeros_like(by_descriptors)
    for p in document["peers"]:
        for v in p["views"]:
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                for so, do, length in v["fragments"]:
                    by_fragments[d * stride_r + do : d * stride_r + do + length] = sender_bytes[
                        p["rank"]
                    ][s * stride_s + so : s * stride_s + so + length]
    assert np.array_equal(by_descriptors, by_fragments)
    assert result.expected_notifications == document["expected_writers"] == 2
    assert result.descriptors <= sum(p.fragments for p in result.peers)
    assert result.bytes == document["bytes_per_block"] * len(src_blocks)


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


@pytest.mark.parametrize("name", list(RANGE_WORLDS))
@pytest.mark.parametrize(("start", "end"), [(0, 24), (5, 23), (9, 11)])
def test_a_token_range_pulls_exactly_its_tokens(name: str, start: int, end: int) -> None:
    """Descriptors of a range cut mid-block, applied as memcpy, against the logical tensor."""
    classes, ctx_side, gen_side = RANGE_WORLDS[name]
    ctx, ctx_layouts = instance(ctx_side, classes, "ctx")
    gen, gen_layouts = instance(gen_side, classes, "gen")
    truth, ts, td = Truth(classes), ctx_side.tokens_per_block, gen_side.tokens_per_block
    order = list(range(ctx_side.num_slots))[::-1]
    src_blocks = order[: -(-end // ts)]  # the whole prompt from token 0
    dst_blocks = list(range(gen_side.num_slots))[: -(-end // td) - start // td]  # the suffix
    bases = {rank: (rank + 1) << 32 for rank in range(len(ctx))}
    senders = {
        rank: truth.place(ctx_side, layout, rank, {s: i * ts for i, s in enumerate(src_blocks)})
        for rank, layout in enumerate(ctx_layouts)
    }
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        document = build_plan(ctx, receiver).to_json(period=True)
        ((_, stride, slots),) = layout.pools.values()
        result = plan_descriptors(
            document,
            receiver_pools={0: PoolAddress(0, stride, slots)},
            sender_pools={
                rank: {0: PoolAddress(bases[rank], pools[0][1], pools[0][2])}
                for rank, pools in ((r, lay.pools) for r, lay in enumerate(ctx_layouts))
            },
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
            tokens=(start, end),
            src_first_token=0,
        )
        before = background(layout)
        got = before[0].copy()
        for descs in result.peers:
            for (dst, length, _), (src, _, _) in zip(descs.local, descs.remote, strict=True):
                offset = src - bases[descs.rank]
                got[dst : dst + length] = senders[descs.rank][0][offset : offset + length]
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
        "src_blocks": [0, 1],
        "dst_blocks": [2, 3],
    }
    blocks_only = build_plan(ctx, gen[0]).to_json()
    with pytest.raises(ValueError, match="fetch the plan with period=True"):
        plan_descriptors(blocks_only, tokens=(1, 7), **arguments)
    period = build_plan(ctx, gen[0]).to_json(period=True)
    with pytest.raises(TokenGap) as gap:
        plan_descriptors(period, tokens=(1, 9), src_first_token=0, dst_first_token=0, **arguments)
    assert (gap.value.field, gap.value.token, gap.value.covered) == ("src_blocks", 8, (0, 8))


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
    first = tokens[0] // td if tokens else 0
    want_placement = {d: (first + i) * td for i, d in enumerate(request["dst_blocks"])}
    positions = range(*tokens) if tokens else None
    starts = window_starts(ctx_side, gen_side, HYBRID, prompt)
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        result = plan_descriptors(
            build_plan(ctx, receiver).to_json(period=tokens is not None),
            receiver_pools={p: PoolAddress(_address(-1, p), s, n) for p, (_, s, n) in layout.pools.items()},
            sender_pools={
                r: {p: PoolAddress(_address(r, p), s, n) for p, (_, s, n) in lay.pools.items()}
                for r, lay in enumerate(ctx_layouts)
            },
            src_state_slot=src_slot, dst_state_slot=dst_slot, **request,
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
    pools = {p: PoolAddress(0, s, n) for p, (_, s, n) in gen_layouts[3].pools.items()}
    with pytest.raises(ValueError, match=message):
        plan_descriptors(
            build_plan(ctx, gen[3]).to_json(), receiver_pools=pools,
            sender_pools={r: pools for r in range(4)}, src_blocks=[0, 1, 2], dst_blocks=[2, 0, 1],
            **arguments,
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
}


def _held(side: Side, end: int) -> int:
    """Prompt positions before ``end`` CP rank 0 holds (the most any CP rank holds)."""
    return sum(1 for t in range(end) if t // side.cp_interleave % side.cp_size == 0)


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
    bases = {rank: (rank + 1) << 32 for rank in range(len(ctx))}
    senders = {
        rank: truth.place(ctx_side, layout, rank, {s: i * ts for i, s in enumerate(src_blocks)})
        for rank, layout in enumerate(ctx_layouts)
    }
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        ((_, stride, slots),) = layout.pools.values()
        result = plan_descriptors(
            build_plan(ctx, receiver).to_json(),
            receiver_pools={0: PoolAddress(0, stride, slots)},
            sender_pools={
                rank: {0: PoolAddress(bases[rank], pools[0][1], pools[0][2])}
                for rank, pools in ((r, lay.pools) for r, lay in enumerate(ctx_layouts))
            },
            src_blocks=src_blocks,
            dst_blocks=dst_blocks,
            tokens=(start, end),
            src_first_token=0,
            dst_first_token=0,
        )
        before = background(layout)
        got = before[0].copy()
        for descs in result.peers:
            for (dst, length, _), (src, _, _) in zip(descs.local, descs.remote, strict=True):
                offset = src - bases[descs.rank]
                got[dst : dst + length] = senders[descs.rank][0][offset : offset + length]
        placement = {s: i * td for i, s in enumerate(dst_blocks)}
        want = truth.place(gen_side, layout, receiver.rank, placement, range(start, end), before)
        np.testing.assert_array_equal(got, want[0], err_msg=f"{name}: gen rank {receiver.rank}")
        assert result.bytes == int((want[0] != before[0]).sum())
