"""Reference section 2.10 (recurrent state) in kvroute's model: mamba TP, pairing, the mappers for
equal TP, replicated state, SSM heads and conv sections across different TP, the compatibility
checks, and the receiver's recurrent payload for bounce.

Geometry: 8 SSM heads of 64 bytes, Mamba2 conv sections [x | B | C] of 64, 16 and 16 bytes in the
model, two Mamba layers [0, 1] in pool 1 (a per-request state pool).
"""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, build_plan, check_registration
from tests.unit.docs import instance, rank, view

BPH = 64
SECTIONS = (64, 16, 16)


def ssm(tp: int, *, layers=(0, 1), view_id: int = 0, bph: int = BPH, heads: int = 8, pool=1):
    size = heads // tp * bph
    return view(
        view_id, list(layers), size, kind="ssm", roles=["ssm"], buffers=1, pool=pool,
        ssm_bytes_per_head=bph,
    )  # fmt: skip


def conv(tp: int, *, layers=(0, 1), view_id: int = 1, sections=SECTIONS, base: int | None = None):
    per_rank = [size // tp for size in sections]
    size = sum(per_rank)
    start = 8 // tp * BPH * len(layers) if base is None else base
    offsets = [start + i * size for i in range(len(layers))]
    return view(
        view_id, list(layers), size, kind="conv", roles=["conv"], buffers=1, pool=1,
        offsets=offsets, conv_sections=per_rank,
    )  # fmt: skip


def mamba(role: str, tp: int, **kwargs):
    return instance(role, tp=tp, views=lambda t, p: [ssm(tp), conv(tp)], **kwargs)


def _state(plan_json: dict, sender: int, dst_view: int = 0) -> dict:
    peer = next(p for p in plan_json["peers"] if p["rank"] == sender)
    return next(s for s in peer["states"] if s["dst_view"] == dst_view)


def _refusal(candidate, peers) -> GeometryError:
    with pytest.raises(GeometryError) as refused:
        check_registration(candidate, [], peers)
    return refused.value


@pytest.mark.parametrize(
    ("tp", "dp", "tp_rank", "expected"),
    [(4, 1, 3, (4, 3)), (4, 4, 3, (1, 0)), (4, 2, 3, (2, 1)), (1, 1, 0, (1, 0))],
)
def test_mamba_tp_is_the_attention_dp_group_tp(tp, dp, tp_rank, expected) -> None:
    # Reference: (1, 0) under attention DP (dp_size == tp_size), (tp, tp_rank) otherwise.
    reg = rank("context", tp=tp, tp_rank=tp_rank, dp=dp, views=[ssm(tp // dp)])
    assert (reg.state_tp, reg.state_rank) == expected


@pytest.mark.parametrize(
    ("tp", "tp_rank", "cp", "cp_rank", "expected"),
    [(2, 1, 2, 0, (4, 2)), (2, 1, 2, 1, (4, 3)), (1, 0, 4, 3, (4, 3)), (2, 0, 4, 1, (8, 1))],
)
def test_helix_mamba_tp_is_tp_times_cp(tp, tp_rank, cp, cp_rank, expected) -> None:
    # Reference 2.10: (tp x cp, tp_rank x cp + cp_rank) when cp > 1 (helix repurposes CP as TP).
    reg = rank("context", tp=tp, tp_rank=tp_rank, cp=cp, cp_rank=cp_rank, views=[ssm(tp * cp)])
    assert (reg.state_tp, reg.state_rank) == expected


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 2), (2, 1), (2, 8), (8, 2), (4, 4), (1, 8)])
def test_pairing_follows_the_reference_rule(ctx_tp: int, gen_tp: int) -> None:
    ctx, gen = mamba("context", ctx_tp), mamba("generation", gen_tp)
    for receiver in gen:
        plan = build_plan(ctx, receiver).to_json()
        p = receiver.tp_rank
        expected = [
            q
            for q in range(ctx_tp)
            if (q == p // (gen_tp // ctx_tp) if ctx_tp <= gen_tp else q // (ctx_tp // gen_tp) == p)
        ]
        assert [peer["rank"] for peer in plan["peers"]] == expected
        assert all(peer["sends"] and peer["states"] for peer in plan["peers"])
        assert {tuple(_state(plan, q)["mamba_tp"]["dst"]) for q in expected} == {(gen_tp, p)}


def test_equal_mamba_tp_copies_each_layer_region_whole() -> None:
    plan = build_plan(mamba("context", 2), mamba("generation", 2)[1]).to_json()
    ssm_state, conv_state = _state(plan, 1, 0), _state(plan, 1, 1)
    # Both layers are back to back on both sides: one fragment per view.
    assert ssm_state["fragments"] == [[0, 0, 2 * 4 * BPH]]
    assert conv_state["fragments"] == [[2 * 4 * BPH, 2 * 4 * BPH, 2 * 48]]
    assert plan["state_bytes"] == 2 * 4 * BPH + 2 * 48


def test_ssm_finer_receiver_copies_its_heads_from_the_coarse_sender() -> None:
    # ctx TP2 holds 4 heads, gen TP4 2: copy min(heads) x bph at (fine rank mod ratio) x copy.
    plan = build_plan(mamba("context", 2), mamba("generation", 4)[3]).to_json()
    state = _state(plan, 1)
    assert state["fragments"] == [[2 * BPH, 0, 2 * BPH], [4 * BPH + 2 * BPH, 2 * BPH, 2 * BPH]]
    assert state["shard"] == {"unit": "head", "total": 8, "src": [4, 8], "dst": [6, 8]}


def test_ssm_coarser_receiver_places_each_sender_at_its_offset() -> None:
    plan = build_plan(mamba("context", 4), mamba("generation", 2)[0]).to_json()
    assert _state(plan, 0)["fragments"] == [[0, 0, 2 * BPH], [2 * BPH, 4 * BPH, 2 * BPH]]
    assert _state(plan, 1)["fragments"] == [[0, 2 * BPH, 2 * BPH], [2 * BPH, 6 * BPH, 2 * BPH]]


def test_conv_sections_split_each_section_with_accumulated_starts() -> None:
    # ctx TP2 sections [32, 8, 8] at 512, gen TP4 [16, 4, 4] at 256; gen rank 1 <- ctx rank 0.
    plan = build_plan(mamba("context", 2), mamba("generation", 4)[1]).to_json()
    state = _state(plan, 0, dst_view=1)
    layer0 = [[512 + 16, 256, 16], [512 + 32 + 4, 256 + 16, 4], [512 + 40 + 4, 256 + 20, 4]]
    layer1 = [[src + 48, dst + 24, length] for src, dst, length in layer0]
    assert state["fragments"] == layer0 + layer1
    assert state["shard"] == {"unit": "part", "total": 4, "src": [0, 2], "dst": [1, 2]}


def test_replicated_state_is_copied_whole_from_one_elected_rank() -> None:
    side = view(
        0, [0, 1], 40, kind="replicated", roles=["side"], buffers=1, pool=1, per_request=True
    )
    ctx = instance("context", tp=4, views=lambda t, p: [side])
    gen = rank("generation", tp=1, heads=8, views=[side])
    plan = build_plan(ctx, gen).to_json()
    assert [(p["rank"], p["sends"]) for p in plan["peers"]] == [
        (0, True), (1, False), (2, False), (3, False),
    ]  # fmt: skip
    state = _state(plan, 0)
    assert (state["fragments"], state["duplicate_head_factor"]) == ([[0, 0, 80]], 4)
    assert plan["fanin_bounce_safe"] is True  # one writer


def test_replicated_state_bytes_must_be_equal() -> None:
    side = view(
        0, [0, 1], 40, kind="replicated", roles=["side"], buffers=1, pool=1, per_request=True
    )
    bigger = view(
        0, [0, 1], 48, kind="replicated", roles=["side"], buffers=1, pool=1, per_request=True
    )
    error = _refusal(
        rank("generation", views=[bigger]), instance("context", tp=2, views=lambda t, p: [side])
    )
    assert (error.code, error.field, error.local, error.peer) == (
        "bytes_per_layer_mismatch", "views[0].bytes_per_layer", 48, 40,
    )  # fmt: skip
    assert "differs for overlapping layers" in error.detail


def test_replicated_state_missing_on_the_peer_is_refused() -> None:
    side = view(
        2,
        [0, 1],
        40,
        kind="replicated",
        roles=["side"],
        buffers=1,
        pool=1,
        per_request=True,
        offsets=[1000, 1040],
    )
    ctx = instance("context", tp=2, views=lambda t, p: [ssm(2), conv(2)])
    error = _refusal(rank("generation", tp=2, views=[ssm(2), conv(2), side]), ctx)
    assert (error.code, error.field) == ("view_missing", "views[2]")
    assert "no target state view with roles ['side']" in error.detail


def test_ssm_bytes_per_head_must_be_equal() -> None:
    error = _refusal(
        rank("generation", tp=2, views=[ssm(2, bph=32, heads=16), conv(2)]), mamba("context", 2)
    )
    assert (error.code, error.field, error.local, error.peer) == (
        "ssm_bytes_per_head_mismatch", "views[0].ssm_bytes_per_head", 32, 64,
    )  # fmt: skip
    assert "check head_dim / d_state / mamba_ssm_cache_dtype" in error.detail


def test_ssm_state_must_add_up_to_the_same_model() -> None:
    # gen TP2 registers 8 heads per rank: 16 heads in all against the context's 8.
    gen = rank("generation", tp=2, views=[ssm(1), conv(2, base=2 * 8 * BPH)])
    error = _refusal(gen, mamba("context", 4))
    assert (error.code, error.field, error.local, error.peer) == (
        "state_bytes_mismatch", "views[0].bytes_per_layer", 1024, 512,
    )  # fmt: skip
    assert "TP-aggregated" in error.detail
    assert "mamba_tp 2" in error.detail


def test_conv_section_count_and_sizes_must_agree() -> None:
    two = rank("generation", tp=2, views=[ssm(2), conv(2, sections=(80, 16))])
    error = _refusal(two, mamba("context", 2))
    assert (error.code, error.field, error.local, error.peer) == (
        "conv_sections_count_mismatch", "views[1].conv_sections", 2, 3,
    )  # fmt: skip
    wider = rank("generation", tp=2, views=[ssm(2), conv(2, sections=(64, 32, 16))])
    error = _refusal(wider, mamba("context", 4))
    assert (error.code, error.field, error.local, error.peer) == (
        "conv_section_mismatch", "views[1].conv_sections[1]", 32, 16,
    )  # fmt: skip


def test_a_stage_without_mamba_layers_has_nothing_to_check() -> None:
    # gen PP2: stage 0 holds the attention layer 0 only, stage 1 the Mamba layer 1.
    kv = view(0, [0], 512, heads=2)
    gen0 = rank("generation", stages=(1, 1), views=[kv])
    ctx = instance(
        "context",
        tp=2,
        views=lambda t, p: [
            kv | {"layers": [{"layer": 0, "offset": 0}]},
            ssm(2, layers=(1,), view_id=1),
        ],
    )
    check_registration(gen0, [], ctx)
    assert not build_plan(ctx, gen0).has_state


def test_draft_layer_check_comes_before_state_geometry() -> None:
    error = _refusal(
        rank("generation", tp=2, draft=1, views=[ssm(2, bph=32, heads=16), conv(2)]),
        mamba("context", 2),
    )
    assert error.code == "draft_layers_mismatch"


def test_receiver_payload_is_matched_layers_times_receiver_bytes() -> None:
    # ctx PP2 holds Mamba layers [0] and [1, 2]; gen stage 0 holds [0, 1] of them.
    def ctx_views(t: int, p: int):
        return [ssm(2, layers=(0,) if p == 0 else (1, 2))]

    ctx = instance("context", tp=2, stages=(1, 2), views=ctx_views)
    gen = rank("generation", tp=4, tp_rank=1, stages=(2, 1), views=[ssm(4, layers=(0, 1))])
    plan = build_plan(ctx, gen)
    assert plan.state_bytes == 2 * (8 // 4 * BPH)
    assert [p.rank for p in plan.peers] == [0, 2]
    assert plan.fanin_bounce_safe is False  # two writers and recurrent state


def test_state_with_several_writers_is_not_bounce_safe_one_writer_is() -> None:
    assert build_plan(mamba("context", 4), mamba("generation", 2)[0]).fanin_bounce_safe is False
    assert build_plan(mamba("context", 2), mamba("generation", 2)[0]).fanin_bounce_safe is True
