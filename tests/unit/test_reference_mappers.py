"""Reference cases 16-26 and 31: mapper choice and byte math, including sub-byte formats.

The reference states results as pointers for block bases 1000 (sender) and 2000 (receiver); kvroute
plans are block-relative, so each expected pointer appears here minus its base.
"""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, build_plan, check_registration
from tests.unit.docs import fragments, instance, rank, view


def _pair(sender_views, receiver_views, *, sender=None, receiver=None):
    sender = sender or {}
    receiver = receiver or {}
    tp = sender.pop("tp", 2)
    ctx = instance("context", tp=tp, views=lambda t, p: sender_views, **sender)
    gen = rank("generation", views=receiver_views, **receiver)
    return ctx, gen


def _only_view(plan, rank_=0):
    peer = next(p for p in plan["peers"] if p["rank"] == rank_)
    (only,) = peer["views"]
    return only


def test_case_16_identical_tables_move_the_whole_region_in_one_fragment() -> None:
    ctx, gen = _pair([view()], [view()])
    only = _only_view(build_plan(ctx, gen).to_json())
    assert only["mapper"] == "intact"
    assert only["fragments"] == [[0, 0, 1024]]


def test_case_17_partial_pp_copies_the_peer_stage_layer_only() -> None:
    ctx, gen = _pair([view()], [view(0, [1], 512)], receiver={"stages": (1, 1), "pp_rank": 1})
    only = _only_view(build_plan(ctx, gen).to_json())
    assert only["mapper"] == "intact"
    assert only["fragments"] == [[512, 0, 512]]


def test_case_18_different_heads_per_rank_use_the_hnd_mapper() -> None:
    ctx, gen = _pair(
        [view(0, [0, 1], 1024, heads=4)],
        [view(0, [0, 1], 512, heads=2)],
        sender={"tp": 1, "heads": 4},
    )
    assert _only_view(build_plan(ctx, gen).to_json())["mapper"] == "hnd"


def test_case_19_nhd_head_slice_is_one_fragment_per_token() -> None:
    ctx = instance(
        "context",
        tp=2,
        dp=2,
        tpb=2,
        head_dim=2,
        stages=(1,),
        views=lambda t, p: [view(0, [0], 32, kind="nhd", heads=2)],
    )
    gen = rank(
        "generation",
        tp=2,
        tpb=2,
        head_dim=2,
        heads=1,
        stages=(1,),
        views=[view(0, [0], 16, kind="nhd", heads=1)],
    )
    plan = build_plan(ctx, gen, sender_dp_rank=0).to_json()
    assert _only_view(plan)["mapper"] == "nhd"
    assert fragments(plan, 0) == [[0, 0, 4], [8, 4, 4], [16, 8, 4], [24, 12, 4]]


def test_case_20_sub_byte_nhd_scales_move_one_byte_per_token() -> None:
    # Consistent form of the reference case (it pairs 4 heads at TP2 with 1 head at TP1, which kvroute
    # refuses as different models): 2 heads at TP1 to 1 head per rank at TP2, 1 byte per token-head.
    ctx = instance(
        "context",
        tp=1,
        tpb=2,
        head_dim=128,
        dtype="nvfp4",
        stages=(1,),
        views=lambda t, p: [view(0, [0], 8, kind="nhd", heads=2)],
    )
    gen = rank(
        "generation",
        tp=2,
        tpb=2,
        head_dim=128,
        dtype="nvfp4",
        heads=1,
        stages=(1,),
        views=[view(0, [0], 4, kind="nhd", heads=1)],
    )
    assert fragments(build_plan(ctx, gen).to_json(), 0) == [
        [0, 0, 1],
        [2, 1, 1],
        [4, 2, 1],
        [6, 3, 1],
    ]


def _sub_byte_hnd(receiver_bytes_per_layer: int):
    ctx = instance(
        "context",
        tp=1,
        dtype="nvfp4",
        views=lambda t, p: [view(0, [0, 1], 256, offsets=[0, 256], heads=2)],
    )
    gen = rank(
        "generation",
        tp=2,
        tp_rank=1,
        dtype="nvfp4",
        heads=1,
        views=[
            view(
                0, [0, 1], receiver_bytes_per_layer, offsets=[0, receiver_bytes_per_layer], heads=1
            )
        ],
    )
    return ctx, gen


def test_case_21_sub_byte_hnd_selects_head_1_at_byte_64() -> None:
    ctx, gen = _sub_byte_hnd(128)
    plan = build_plan(ctx, gen).to_json()
    assert fragments(plan, 0) == [[64, 0, 64], [192, 64, 64], [320, 128, 64], [448, 192, 64]]


def test_case_22_hnd_bytes_per_head_mismatch_is_refused() -> None:
    ctx, gen = _sub_byte_hnd(256)
    with pytest.raises(GeometryError) as refused:
        check_registration(gen, [], ctx)
    assert refused.value.code == "bytes_per_head_mismatch"
    assert (refused.value.local, refused.value.peer) == (128, 64)


def _replicated(offsets, bytes_per_layer=128):
    return [
        view(
            0,
            [0, 1],
            bytes_per_layer,
            offsets=offsets,
            kind="replicated",
            roles=["index_key"],
            buffers=1,
        )
    ]


def test_case_23_replicated_views_ignore_head_counts() -> None:
    ctx, gen = _pair(
        _replicated([0, 128]),
        _replicated([0, 128]),
        sender={"tp": 1, "heads": 8},
        receiver={"heads": 1},
    )
    assert _only_view(build_plan(ctx, gen).to_json())["mapper"] == "replicated"


def test_case_24_replicated_layers_merge_into_one_fragment() -> None:
    ctx, gen = _pair(_replicated([0, 128]), _replicated([128, 256]))
    assert fragments(build_plan(ctx, gen).to_json(), 0) == [[0, 128, 256]]


def test_case_25_intact_runs_break_where_either_side_is_not_contiguous() -> None:
    ctx, gen = _pair(
        [view(0, [0, 1, 2], 128, offsets=[0, 192, 320])],
        [view(0, [0, 1, 2], 128, offsets=[0, 128, 256])],
        sender={"stages": (3,)},
        receiver={"stages": (3,)},
    )
    assert fragments(build_plan(ctx, gen).to_json(), 0) == [[0, 0, 128], [192, 128, 256]]


@pytest.mark.parametrize(
    ("sender_view", "receiver_view"),
    [
        (view(0, [0, 1], 256), view(0, [0, 1], 128)),
        (_replicated([0, 128])[0], _replicated([0, 128], 64)[0]),
    ],
    ids=["intact", "replicated"],
)
def test_case_26_region_size_mismatch_is_refused(sender_view, receiver_view) -> None:
    ctx, gen = _pair([sender_view], [receiver_view])
    with pytest.raises(GeometryError) as refused:
        check_registration(gen, [], ctx)
    assert refused.value.code == "bytes_per_layer_mismatch"


def test_case_31_nhd_with_equal_heads_is_a_whole_region_copy() -> None:
    ctx, gen = _pair([view(kind="nhd")], [view(kind="nhd")])
    only = _only_view(build_plan(ctx, gen).to_json())
    assert only["mapper"] == "intact"
    assert only["fragments"] == [[0, 0, 1024]]
