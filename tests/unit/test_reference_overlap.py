"""Reference cases 1-8 (overlap, registration) and 32-34 (sender election), in kvroute's model.

In kvroute the "overlap" of a receiver rank is the ``peers`` list of its plan: every sender rank it
hears from, including elected-out replicas (``sends: false``).
"""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, build_plan, check_registration
from tests.unit.docs import instance, peers, rank, senders, stage_layers, view


def _kv(stages, heads=2, total=None):
    return lambda t, p: [view(0, stage_layers(stages, p), 256 * heads, heads=heads, total=total)]


def test_case_1_pp_fan_in_hears_from_both_stages() -> None:
    ctx = instance("context", tp=1, stages=(1, 1), views=_kv((1, 1)))
    gen = rank("generation", tp=1, stages=(2,))
    plan = build_plan(ctx, gen)
    assert peers(plan.to_json()) == [0, 1]
    assert {p.pp_rank for p in plan.peers} == {0, 1}


def test_case_2_stage_without_layers_hears_from_nobody() -> None:
    ctx = instance("context", tp=1, stages=(2,), views=_kv((2,)))
    gen = rank("generation", tp=1, stages=(2, 0), pp_rank=1, views=[])
    plan = build_plan(ctx, gen)
    assert plan.peers == ()
    assert plan.expected_writers == 0
    assert plan.fanin_bounce_safe is False


def test_case_3_uneven_stage_overlaps_one_sender_stage() -> None:
    ctx = instance("context", tp=1, stages=(3,), views=_kv((3,)))
    gen = rank("generation", tp=1, stages=(1, 2), pp_rank=1, views=[view(0, [1, 2])])
    assert peers(build_plan(ctx, gen).to_json()) == [0]


def test_case_4_receiver_tp2_rank1_hears_from_sender_tp4_ranks_2_and_3() -> None:
    ctx = instance(
        "context", tp=4, views=lambda t, p: [view(0, [0, 1], 256, heads=1, total=4)], heads=1
    )
    gen = rank("generation", tp=2, tp_rank=1, views=[view(0, [0, 1], 512, heads=2, total=4)])
    assert peers(build_plan(ctx, gen).to_json()) == [2, 3]


def test_case_5_cp_receiver_hears_from_the_sender_cp_ranks_holding_its_tokens() -> None:
    # Self CP2 rank 1, peer CP4 (TP1). The reference computes the CP overlap positionally, like TP
    # ([2, 3]), which holds for contiguous chunks only. Helix deals whole blocks round robin
    # (interleave = tokens per block): the receiver owns blocks 1, 3, 5, ..., which sender CP ranks
    # 1 (blocks 1, 5, ...) and 3 (blocks 3, 7, ...) hold, so those two write; ranks 0 and 2 hold
    # none of its tokens and send nothing.
    mla = [view(0, [0, 1], 16 * 64, kind="replicated", roles=["latent"], buffers=1, heads=None)]
    ctx = [
        rank("context", tp=1, heads=1, mla=True, views=mla, cp=4, cp_rank=c, interleave=16)
        for c in range(4)
    ]
    gen = rank("generation", tp=1, heads=1, mla=True, views=mla, cp=2, cp_rank=1, interleave=16)
    check_registration(gen, [], ctx)
    plan = build_plan(ctx, gen).to_json()
    assert peers(plan) == [0, 1, 2, 3]
    assert [p["rank"] for p in plan["peers"] if p["sends"]] == [1, 3]


def test_case_6_pp_and_tp_overlap_together() -> None:
    # The reference's CP dimension is refused (case 5); its TP/PP part: the receiver stage holds
    # layers 1..2 at TP2 rank 1; sender PP4 [1,1,1,1], TP4. Ranks are pp * tp_size + tp. The receiver
    # gets a third stage so both sides hold 4 layers (kvroute refuses differing layer counts).
    stages = (1, 1, 1, 1)
    ctx = instance("context", tp=4, stages=stages, heads=2, views=_kv(stages, heads=2, total=8))
    gen = rank(
        "generation",
        tp=2,
        tp_rank=1,
        stages=(1, 2, 1),
        pp_rank=1,
        heads=4,
        views=[view(0, [1, 2], 1024, heads=4, total=8)],
    )
    plan = build_plan(ctx, gen).to_json()
    assert peers(plan) == [6, 7, 10, 11]
    factors = {
        (v["duplicate_head_factor"], v["peer_duplicate_head_factor"])
        for p in plan["peers"]
        for v in p["views"]
    }
    assert factors == {(1, 1)}


def test_case_6_literal_head_counts_are_refused() -> None:
    # The reference pairs 2 heads/rank at TP2 with 2 heads/rank at TP4 and reports peer_dup 2; those are
    # different models (4 vs 8 KV heads), which kvroute refuses instead of planning.
    ctx = instance("context", tp=4, views=_kv((2,), heads=2))
    with pytest.raises(GeometryError) as refused:
        check_registration(rank("generation", tp=2, views=_kv((2,))(0, 0)), [], ctx)
    assert refused.value.code == "head_count_mismatch"


def test_case_7_attention_dp_both_sides_pairs_each_rank_with_itself() -> None:
    kv = lambda t, p: [view(0, [0, 1], 512 * 4, heads=4, total=4)]  # noqa: E731
    ctx = instance("context", tp=4, dp=4, heads=4, views=kv)
    gen = instance("generation", tp=4, dp=4, heads=4, views=kv)
    for receiver in gen:
        for dp_rank in range(4):
            plan = build_plan(ctx, receiver, sender_dp_rank=dp_rank).to_json()
            assert peers(plan) == [dp_rank]


def test_case_8_compatible_peer_is_admitted_and_a_missing_sender_has_no_plan() -> None:
    ctx = instance("context", tp=2)
    gen = rank("generation", tp=2)
    check_registration(gen, [], ctx)
    assert peers(build_plan(ctx, gen).to_json()) == [0]
    with pytest.raises(GeometryError) as refused:
        build_plan([], gen)
    assert refused.value.code == "no_sender_ranks"


def _replicated(t, p):
    return [view(0, [0, 1], 128, kind="replicated", roles=["indexer_k"], buffers=1)]


@pytest.mark.parametrize("dp_rank", [0, 1, 3, 7])
def test_case_32_replicated_owner_rotates_with_receiver_dp_rank(dp_rank: int) -> None:
    ctx = instance("context", tp=8, views=_replicated)
    gen = rank("generation", tp=8, tp_rank=dp_rank, dp=8, views=_replicated(0, 0))
    plan = build_plan(ctx, gen).to_json()
    assert peers(plan) == list(range(8))
    assert senders(plan) == [dp_rank % 8]


def test_case_33_first_replica_owns_without_receiver_attention_dp() -> None:
    ctx = instance("context", tp=8, views=_replicated)
    for receiver in (
        rank("generation", tp=1, views=_replicated(0, 0)),
        rank("generation", tp=8, tp_rank=0, dp=8, views=_replicated(0, 0)),
    ):
        ownership = [p["sends"] for p in build_plan(ctx, receiver).to_json()["peers"]]
        assert ownership == [True] + [False] * 7


def test_case_34_duplicated_heads_elect_odd_ranks_for_dp_rank_1() -> None:
    # 2 KV heads over context TP4 (replicated twice, dup 2) to an attention-DP receiver in DP group 1.
    ctx = instance(
        "context", tp=4, heads=1, views=lambda t, p: [view(0, [0, 1], 256, heads=1, total=2)]
    )
    gen = rank("generation", tp=2, tp_rank=1, dp=2, views=[view(0, [0, 1], 512, heads=2, total=2)])
    plan = build_plan(ctx, gen).to_json()
    assert senders(plan) == [1, 3]
    assert {v["duplicate_head_factor"] for p in plan["peers"] for v in p["views"]} == {2}
