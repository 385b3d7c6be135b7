"""Derived cases D1-D7 (trtllm-native-disagg.md section 4): bf16, head_dim 128, 32 tokens per block,
so one head of one buffer is 8192 bytes. HND with K and V buffers, two layers unless stated.

Every case is built twice, with per-view head counts and as a legacy table (views without
``num_kv_heads``/``total_kv_heads``, falling back to the rank-wide count); D7 asserts both give the
same plans.
"""

from __future__ import annotations

import pytest

from kvroute.geometry import build_plan
from tests.unit.docs import fragments, instance, peers, rank, senders, stage_layers, view

HEAD = 8192
GEOMETRY = {"tpb": 32, "head_dim": 128}


def _kv(heads: int, total: int, *, legacy: bool, layers=(0, 1), owner="target", view_id=0, base=0):
    size = 2 * heads * HEAD
    return view(
        view_id,
        list(layers),
        size,
        offsets=[base + i * size for i in range(len(layers))],
        owner=owner,
        heads=None if legacy else heads,
        total=None if legacy else total,
    )


def d1(legacy: bool):
    ctx = instance(
        "context", tp=4, heads=1, views=lambda t, p: [_kv(1, 2, legacy=legacy)], **GEOMETRY
    )
    return ctx, [rank("generation", tp=1, heads=2, views=[_kv(2, 2, legacy=legacy)], **GEOMETRY)]


def d2(legacy: bool):
    ctx = instance(
        "context", tp=1, heads=2, views=lambda t, p: [_kv(2, 2, legacy=legacy)], **GEOMETRY
    )
    return ctx, instance(
        "generation", tp=4, heads=1, views=lambda t, p: [_kv(1, 2, legacy=legacy)], **GEOMETRY
    )


def _target_and_draft(heads: int, legacy: bool):
    # Legacy tables carry no per-view count, so the draft view (1 head) needs its own count even there:
    # the rank-wide default describes the target views.
    target = _kv(heads, 8, legacy=legacy)
    draft = _kv(
        1, 1, legacy=False, layers=(0,), owner="draft", view_id=1, base=2 * 2 * heads * HEAD
    )
    return [target, draft]


def d3(legacy: bool):
    ctx = instance(
        "context",
        tp=8,
        heads=1,
        draft=1,
        views=lambda t, p: _target_and_draft(1, legacy),
        **GEOMETRY,
    )
    gen = instance(
        "generation",
        tp=4,
        heads=2,
        draft=1,
        views=lambda t, p: _target_and_draft(2, legacy),
        **GEOMETRY,
    )
    return ctx, gen


def d4(legacy: bool):
    latent = view(0, [0, 1], 4 * HEAD, roles=["key"], buffers=1, heads=None if legacy else 1)
    ctx = instance("context", tp=8, heads=1, mla=True, views=lambda t, p: [latent], **GEOMETRY)
    return ctx, instance(
        "generation", tp=8, dp=8, heads=1, mla=True, views=lambda t, p: [latent], **GEOMETRY
    )


def d5(legacy: bool):
    ctx = instance(
        "context", tp=4, heads=2, views=lambda t, p: [_kv(2, 8, legacy=legacy)], **GEOMETRY
    )
    gen = instance(
        "generation", tp=4, dp=4, heads=8, views=lambda t, p: [_kv(8, 8, legacy=legacy)], **GEOMETRY
    )
    return ctx, gen


def d6(legacy: bool):
    stages = (16, 14)
    ctx = instance(
        "context",
        tp=1,
        heads=1,
        stages=stages,
        views=lambda t, p: [_kv(1, 1, legacy=legacy, layers=stage_layers(stages, p))],
        **GEOMETRY,
    )
    gen = rank(
        "generation",
        tp=1,
        heads=1,
        stages=(30,),
        views=[_kv(1, 1, legacy=legacy, layers=range(30))],
        **GEOMETRY,
    )
    return ctx, [gen]


@pytest.mark.parametrize("legacy", [False, True])
def test_d1_duplicated_sender_heads_elect_ranks_0_and_2(legacy: bool) -> None:
    ctx, (gen,) = d1(legacy)
    plan = build_plan(ctx, gen).to_json()
    assert peers(plan) == [0, 1, 2, 3]
    assert senders(plan) == [0, 2]
    layer = 2 * HEAD  # sender layer stride (1 head x K/V); receiver layer stride is 4 heads
    for sender, head_offset in ((0, 0), (2, HEAD)):
        assert fragments(plan, sender) == [
            [0, head_offset, HEAD],
            [HEAD, 2 * HEAD + head_offset, HEAD],
            [layer, 4 * HEAD + head_offset, HEAD],
            [layer + HEAD, 6 * HEAD + head_offset, HEAD],
        ]
    assert {v["duplicate_head_factor"] for p in plan["peers"] for v in p["views"]} == {2}
    assert plan["fanin_bounce_safe"] is False


@pytest.mark.parametrize("legacy", [False, True])
def test_d2_replicated_receiver_heads_read_head_p_div_2(legacy: bool) -> None:
    ctx, gen = d2(legacy)
    for receiver in gen:
        plan = build_plan(ctx, receiver).to_json()
        src_head = (receiver.rank // 2) * HEAD
        assert fragments(plan, 0)[:2] == [[src_head, 0, HEAD], [2 * HEAD + src_head, HEAD, HEAD]]
        assert plan["peers"][0]["views"][0]["peer_duplicate_head_factor"] == 2
        # The reference lets a single writer bounce regardless; rule 6 refuses head duplication on
        # either side, which only costs the unstaged path.
        assert (plan["expected_writers"], plan["fanin_bounce_safe"]) == (1, False)


@pytest.mark.parametrize("legacy", [False, True])
def test_d3_draft_view_is_elected_per_view_not_by_the_rank_wide_factor(legacy: bool) -> None:
    ctx, gen = d3(legacy)
    draft_senders = []
    for receiver in gen:
        plan = build_plan(ctx, receiver).to_json()
        assert peers(plan) == [2 * receiver.rank, 2 * receiver.rank + 1]
        for peer in plan["peers"]:
            target = next(v for v in peer["views"] if v["owner"] == "target")
            assert target["fragments"][0][1] == (peer["rank"] % 2) * HEAD
            assert target["duplicate_head_factor"] == 1
            draft = [v for v in peer["views"] if v["owner"] == "draft"]
            if draft:
                draft_senders.append(peer["rank"])
                assert draft[0]["mapper"] == "intact"
                assert draft[0]["duplicate_head_factor"] == 2
        assert plan["fanin_bounce_safe"] is False
    assert draft_senders == [0, 2, 4, 6]


@pytest.mark.parametrize("legacy", [False, True])
def test_d4_mla_receiver_with_attention_dp_hears_one_writer_in_eight(legacy: bool) -> None:
    ctx, gen = d4(legacy)
    for receiver in gen:
        plan = build_plan(ctx, receiver).to_json()
        assert peers(plan) == list(range(8))
        assert senders(plan) == [receiver.dp_rank]
        view_pair = plan["peers"][receiver.dp_rank]["views"][0]
        assert (view_pair["duplicate_head_factor"], view_pair["mapper"]) == (8, "intact")
        assert (
            plan["fanin_bounce_safe"] is False
        )  # G3: sender duplication; G2 would wrongly say safe


@pytest.mark.parametrize("legacy", [False, True])
def test_d5_attention_dp_fan_in_places_two_heads_per_sender(legacy: bool) -> None:
    ctx, gen = d5(legacy)
    for receiver in gen:
        plan = build_plan(ctx, receiver).to_json()
        assert senders(plan) == [0, 1, 2, 3]
        for r in range(4):
            assert fragments(plan, r)[0] == [0, 2 * r * HEAD, 2 * HEAD]
        assert plan["fanin_bounce_safe"] is True


@pytest.mark.parametrize("legacy", [False, True])
def test_d6_uneven_pp_fan_in_is_not_bounce_safe(legacy: bool) -> None:
    ctx, (gen,) = d6(legacy)
    plan = build_plan(ctx, gen)
    assert [(p.rank, len(p.views[0].layers)) for p in plan.peers] == [(0, 16), (1, 14)]
    assert plan.fanin_bounce_safe is False


@pytest.mark.parametrize("case", [d1, d2, d3, d4, d5, d6])
def test_d7_legacy_tables_plan_exactly_like_per_view_tables(case) -> None:
    (ctx, gen), (legacy_ctx, legacy_gen) = case(False), case(True)
    for receiver, legacy_receiver in zip(gen, legacy_gen, strict=True):
        plan = build_plan(ctx, receiver).to_json()
        legacy_plan = build_plan(legacy_ctx, legacy_receiver).to_json()
        plan.pop("fingerprint")
        legacy_plan.pop("fingerprint")
        assert plan == legacy_plan
