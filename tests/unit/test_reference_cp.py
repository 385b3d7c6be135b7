"""Context parallelism: the placement rule of the helix / DCP write-ups, written out by hand, and
what plans, block lists and pictures make of it.

Reference cases: token ``i`` lives on CP rank ``(i / N) mod cp`` (integer division), at local
position ``(i / (N cp)) N + i mod N``; vLLM's DCP slot mapping with ``dcp_kv_cache_interleave_size``
N and TensorRT-LLM helix (a rank owns global blocks ``[cp_rank :: cp_size]``, N = tokens per block).
"""

from __future__ import annotations

import pytest

from kvroute.geometry import (
    BlockList,
    GeometryError,
    Plan,
    RankRegistration,
    Spread,
    TokenGap,
    TokenRange,
    TokenRangeError,
    TokenWindow,
    build_plan,
    check_registration,
    range_copies,
    window_start,
)
from kvroute.pictures import plan_svg
from kvroute.render import plan_text
from tests.unit.docs import rank, view

LATENT = 8  # bytes per token of the MLA latent row in these cases


@pytest.mark.parametrize(
    ("cp", "n", "owners"),
    [
        (4, 1, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]),  # DCP interleave 1
        (2, 4, [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]),  # helix, 4-token blocks
        (3, 2, [0, 0, 1, 1, 2, 2, 0, 0, 1, 1]),
    ],
)
def test_token_i_lives_on_rank_i_div_n_mod_cp(cp: int, n: int, owners: list[int]) -> None:
    for token, owner in enumerate(owners):
        assert [Spread(cp, r, n).holds(token) for r in range(cp)] == [r == owner for r in range(cp)]
        local = token // (n * cp) * n + token % n
        assert Spread(cp, owner, n).local(token) == local
        assert Spread(cp, owner, n).token(local) == token


def test_vllm_dcp_virtual_block_is_tpb_times_cp() -> None:
    # DCP4, interleave 1, 16-token blocks: block j of a request covers prompt tokens
    # [64 j, 64 (j + 1)) on every rank; token 70 is rank 2's local position 17, block 1 offset 1.
    spread = Spread(4, 2, 1)
    assert spread.local(70) == 17
    assert divmod(spread.local(70), 16) == (1, 1)
    assert [spread.count(64 * j, 0) // 16 for j in range(4)] == [0, 1, 2, 3]


def _mla(role: str, *, tpb: int, cp: int = 1, cp_rank: int = 0, n: int = 1, tp: int = 1, tp_rank=0):
    latent = view(
        0, [0, 1], tpb * LATENT, kind="replicated", roles=["latent"], buffers=1, heads=None
    )
    return rank(
        role, tp=tp, tp_rank=tp_rank, heads=1, mla=True, tpb=tpb, views=[latent],
        cp=cp, cp_rank=cp_rank, interleave=n,
    )  # fmt: skip


def test_tp4_context_to_cp4_generation_moves_each_token_to_its_rank() -> None:
    ctx = [_mla("context", tpb=8, tp=4, tp_rank=q) for q in range(4)]
    for c in range(4):
        gen = _mla("generation", tpb=2, cp=4, cp_rank=c)
        check_registration(gen, [], ctx)
        plan = build_plan(ctx, gen).to_json()
        assert [p["rank"] for p in plan["peers"] if p["sends"]] == [0]  # one elected TP replica
        (pair,) = plan["peers"][0]["views"]
        assert pair["dst_cp"] == {"size": 4, "rank": c, "interleave": 1}
        assert "src_cp" not in pair
        assert pair["period_tokens"] == 8
        # One period: the receiver's 2 prompt tokens c and 4 + c, in its local block 0 (2 layers).
        tokens = sorted({(f[5], f[6]) for f in pair["period_fragments"]})
        assert tokens == [(c, 1), (4 + c, 1)]
        # Tokens [3, 13) of a 16-token prompt: context blocks 0-1, the CP ranks' shared list of
        # local blocks 0-1 (2 tokens each).
        period = build_plan(ctx, gen).peers[0].views[0].period_map
        span, src, dst = TokenWindow(TokenRange(3, 13)).lists(
            [10, 11], [20, 21], 8, 2, (Spread(), gen.spread)
        )
        copies = range_copies(period, span, src, dst)
        moved = [t for t in range(3, 13) if t % 4 == c]
        assert sum(length for *_, length in copies) == 2 * LATENT * len(moved)
        for t in moved:
            src_at = (10 + t // 8, (t % 8) * LATENT)
            dst_at = (20 + t // 8, (t // 4 % 2) * LATENT)
            assert any((s, so, d, do) == (*src_at, *dst_at) for s, so, d, do, _ in copies), t


def test_helix_cp2_receiver_rank1_hears_from_cp4_ranks_1_and_3_by_block() -> None:
    ctx = [_mla("context", tpb=4, cp=4, cp_rank=c, n=4) for c in range(4)]
    gen = _mla("generation", tpb=4, cp=2, cp_rank=1, n=4)
    plan = build_plan(ctx, gen).to_json()
    sends = {p["rank"]: p["views"][0] for p in plan["peers"] if p["sends"]}
    assert sorted(sends) == [1, 3]
    # Global blocks: receiver rank 1 owns 1, 3, 5, 7 (local 0-3); sender 1 owns 1, 5 (local 0, 1),
    # sender 3 owns 3, 7. One period is 16 tokens: sender local block 0 -> receiver local block 0
    # (global block 1) from rank 1, -> receiver local block 1 (global block 3) from rank 3.
    assert sends[1]["period_tokens"] == 16
    assert {(f[0], f[2], f[5]) for f in sends[1]["period_fragments"]} == {(0, 0, 4)}
    assert {(f[0], f[2], f[5]) for f in sends[3]["period_fragments"]} == {(0, 1, 12)}


def test_shared_list_suffix_rule_and_named_first_token() -> None:
    spread = Spread(4, 3, 1)
    # 37 tokens: CP rank 0 holds 10 of them, 3 blocks of 4; five listed blocks start at block -2.
    assert BlockList.suffix([1, 2, 3], 37, 4, "dst_blocks", spread).first_block == 0
    assert BlockList.suffix([5, 6], 37, 4, "dst_blocks", spread).first_block == 1
    # A list named from token 16 starts at local block 1: rank 3's first token there is 19.
    named = BlockList([7, 8], 16, 4, spread)
    assert named.first_block == 1
    assert named.gap(TokenRange(16, 32), "dst_blocks") is None
    assert named.gap(TokenRange(16, 48), "dst_blocks") is None  # local positions 4-11
    # Token 51 is rank 3's local position 12: block 3, after the two-block list.
    gap = named.gap(TokenRange(16, 52), "dst_blocks")
    assert gap is not None
    assert gap.token == 51
    with pytest.raises(TokenRangeError, match="local block -3"):  # too long for its end
        BlockList.suffix([1, 2, 3, 4], 9, 4, "dst_blocks", Spread(4, 0, 1))


def test_a_cp_list_short_of_a_token_raises_a_gap_naming_it() -> None:
    ctx = [_mla("context", tpb=4)]
    gen = _mla("generation", tpb=4, cp=2, cp_rank=1)
    period = build_plan(ctx, gen).peers[0].views[0].period_map
    span, src, dst = TokenWindow(TokenRange(0, 16), dst_first_token=0).lists(
        [0, 1, 2, 3], [9], 4, 4, (Spread(), gen.spread)
    )
    with pytest.raises(TokenGap) as gap:
        range_copies(period, span, src, dst)
    # Rank 1 holds the odd tokens; its 2nd local block starts at local position 4: token 9.
    assert (gap.value.field, gap.value.token) == ("dst_blocks", 9)


def test_windows_with_cp_move_the_window_from_each_side_s_block_start() -> None:
    # A 128-token window on 16-token blocks, generation CP2 interleave 1, prompt of 300 tokens:
    # the first in-window token is 173; CP rank 1 holds it at local 86 (local block 5, from local
    # 80 on); rank 0's local 80 is token 160, rank 1's is 161, so every CP rank's tokens lie in
    # local block 5 on from token 160 (the context side's block start is 160 too).
    windowed = view(0, [0, 1], 16 * 64, sliding_window=128)
    ctx = rank("context", tp=1, heads=1, views=[windowed])
    gen = rank("generation", tp=1, heads=1, views=[windowed], cp=2)
    check_registration(gen, [], [ctx])
    pair = build_plan([ctx], gen).peers[0].views[0]
    assert pair.window is not None
    assert pair.window.first_token(300, (Spread(), gen.spread)) == 160
    assert window_start(128, 300, 16, 16, (Spread(), Spread(2, 0, 16))) == 160  # helix: blocks
    assert window_start(128, 300, 16, 16) == 160  # without CP: floor(173 / 16) * 16


@pytest.mark.parametrize(
    ("layout", "cp", "prompt", "ranks"),
    [
        # Megatron / TransformerEngine zig-zag, 8 tokens over CP2: rank 0 holds chunks 0 and 3.
        ("zigzag", 2, 8, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        # 10 tokens in 4 chunks: the first 10 % 4 = 2 chunks hold one more (numpy array_split).
        ("zigzag", 2, 10, [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]),
        ("contiguous", 4, 10, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]),
        ("contiguous", 4, 3, [[0], [1], [2], []]),  # a prompt shorter than CP: rank 3 holds none
        ("zigzag", 3, 7, [[0, 1, 6], [2, 5], [3, 4]]),  # chunks of 2, 1, 1, 1, 1, 1
    ],
)
def test_chunk_boundaries_and_local_positions(
    layout: str, cp: int, prompt: int, ranks: list[list[int]]
) -> None:
    for r, tokens in enumerate(ranks):
        spread = Spread(cp, r, 1, layout, prompt)
        assert [t for t in range(prompt) if spread.holds(t)] == tokens
        assert [spread.local(t) for t in tokens] == list(range(len(tokens)))  # back to back
        assert [spread.token(at) for at in range(len(tokens))] == tokens


def _chunked_mla(layout: str, cp_rank: int, *, cp: int = 2, tpb: int = 4) -> RankRegistration:
    latent = view(
        0, [0, 1], tpb * LATENT, kind="replicated", roles=["latent"], buffers=1, heads=None
    )
    return rank(
        "context", tp=1, heads=1, mla=True, tpb=tpb, views=[latent], cp=cp, cp_rank=cp_rank,
        cp_layout=layout,
    )  # fmt: skip


def test_zigzag_context_to_cp2_interleaved_generation_for_one_prompt() -> None:
    ctx = [_chunked_mla("zigzag", c) for c in range(2)]
    gen = _mla("generation", tpb=2, cp=2, cp_rank=1)
    check_registration(ctx[0], ctx[1:], [gen])
    check_registration(gen, [], ctx)
    plan = build_plan(ctx, gen, prompt_tokens=10)
    doc = plan.to_json()
    assert doc["prompt_tokens"] == 10
    # Receiver rank 1 holds the odd tokens; zig-zag rank 0 holds 0-2 and 8-9, rank 1 holds 3-7.
    sends = {p["rank"]: p["views"][0] for p in doc["peers"] if p["sends"]}
    assert sends[0]["src_cp"] == {"size": 2, "rank": 0, "layout": "zigzag", "prompt_tokens": 10}
    tokens = {r: sorted({(f[5], f[6]) for f in v["period_fragments"]}) for r, v in sends.items()}
    assert tokens == {0: [(1, 1), (9, 1)], 1: [(3, 1), (5, 1), (7, 1)]}
    # Token 9: sender rank 0's local 4 (block 1, position 0) -> receiver local 4 (block 2, 0).
    assert any(f[:4] == [1, 0, 2, 0] and f[5] == 9 for f in sends[0]["period_fragments"])
    # Tokens [2, 10) of the 10-token prompt, moved with each side's shared list.
    period = plan.peers[0].views[0].period_map
    span, src, dst = TokenWindow(TokenRange(2, 10), prompt_tokens=10).lists(
        [10, 11], [20, 21, 22], 4, 2, (period.src_spread, period.dst_spread)
    )
    assert (src.first_block, dst.first_block) == (0, 0)
    copies = range_copies(period, span, src, dst)
    # Token 9 in both layers (regions of 4 and 2 latent rows a block).
    assert sorted(copies) == [(11, 0, 22, 0, LATENT), (11, 4 * LATENT, 22, 2 * LATENT, LATENT)]
    read = Plan.from_json(doc)  # as a worker holds it
    text = plan_text(read)
    assert "CP rank 0 of 2 (zigzag chunks of a 10-token prompt): tokens [0,3) [8,10)" in text
    assert "CP rank 1 of 2 (zigzag chunks of a 10-token prompt): tokens [3,8)" in text
    assert "sender holds tokens [8, 10)" in plan_svg(read)


def test_chunked_plans_and_jobs_need_their_prompt_length() -> None:
    ctx = [_chunked_mla("contiguous", c) for c in range(2)]
    gen = _mla("generation", tpb=4)
    with pytest.raises(GeometryError) as refused:
        build_plan(ctx, gen)
    assert refused.value.code == "prompt_tokens_required"
    assert (refused.value.field, refused.value.local, refused.value.peer) == (
        "prompt_tokens",
        None,
        "contiguous",
    )
    period = build_plan(ctx, gen, prompt_tokens=12).peers[0].views[0].period_map
    with pytest.raises(TokenRangeError) as mismatch:
        TokenWindow(TokenRange(0, 8), prompt_tokens=9).lists(
            [1, 2], [3, 4], 4, 4, (period.src_spread, Spread())
        )
    assert mismatch.value.code == "prompt_tokens_mismatch"
    assert (mismatch.value.extras["local"], mismatch.value.extras["peer"]) == (9, 12)


def test_generation_ranks_cannot_hold_prefill_chunks() -> None:
    gen = rank("generation", tp=1, heads=1, cp=2, cp_layout="zigzag")
    with pytest.raises(GeometryError) as refused:
        check_registration(gen, [], [])
    assert refused.value.code == "context_parallel_layout_unsupported"
    assert (refused.value.field, refused.value.local, refused.value.peer) == (
        "cp_layout",
        "zigzag",
        "interleaved",
    )


def test_text_and_svg_show_the_token_split() -> None:
    ctx = [_mla("context", tpb=4, tp=2, tp_rank=q) for q in range(2)]
    gen = _mla("generation", tpb=2, cp=2, cp_rank=1)
    plan = Plan.from_json(build_plan(ctx, gen).to_json())
    text = plan_text(plan)
    assert "receiver CP rank 1 of 2 (interleave 1): tokens [1,2) [3,4)" in text
    assert "sender every token" in text
    svg = plan_svg(plan)
    assert "receiver holds tokens [1, 2)" in svg
    assert "from rank 0" in svg
