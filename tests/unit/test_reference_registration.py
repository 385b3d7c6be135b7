"""Reference cases 9-15 and 27-30 (registration checks) and D8 (check order), in kvroute's model."""

from __future__ import annotations

import math

import pytest

from kvroute.geometry import GeometryError, build_plan, check_registration
from tests.unit.docs import instance, rank, view


def _refusal(candidate, peers) -> GeometryError:
    with pytest.raises(GeometryError) as refused:
        check_registration(candidate, [], peers)
    return refused.value


def test_case_9_mla_flag_mismatch() -> None:
    ctx = instance("context", tp=2)
    gen = rank(
        "generation",
        mla=True,
        heads=1,
        views=[view(0, [0, 1], 256, roles=["key"], buffers=1, heads=1)],
    )
    error = _refusal(gen, ctx)
    assert (error.code, error.field, error.local, error.peer) == (
        "mla_mismatch",
        "attention.is_mla",
        True,
        False,
    )
    assert (error.peer_instance, error.peer_rank) == ("ctx", 0)


@pytest.mark.parametrize(("kind", "tokens"), [("hnd", 32), ("hnd", 24), ("nhd", 32), ("nhd", 8)])
def test_cases_10_to_12_different_tokens_per_block_are_planned_by_period(
    kind: str, tokens: int
) -> None:
    # The reference admits 16 vs 32 for HND with a warning and refuses the rest; kvroute admits any
    # pair and plans one period of lcm(16, tokens) tokens, so nothing depends on prompt alignment.
    ctx = instance("context", tp=2, views=lambda t, p: [view(kind=kind)])
    gen = rank("generation", tpb=tokens, views=[view(0, [0, 1], 512 * tokens // 16, kind=kind)])
    check_registration(gen, [], ctx)
    (moved,) = build_plan(ctx, gen).to_json()["peers"][0]["views"]
    period = 16 * tokens // math.gcd(16, tokens)
    assert (moved["mapper"], moved["period_tokens"]) == ("intact", period)
    assert (moved["src_blocks_per_period"], moved["dst_blocks_per_period"]) == (
        period // 16,
        period // tokens,
    )
    assert moved["bytes_per_block"] == 512 * tokens // 16 * 2  # both layers of a receiver block
    assert "fragments" not in moved


def test_different_block_sizes_without_whole_token_rows_are_refused() -> None:
    # 520 bytes per HND layer split into K/V x 2 heads (130 bytes each) is admitted alone, but 130
    # bytes are not 16 tokens of equal rows: such a block has no per-token layout to re-cut.
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 520)])
    same = rank("generation", views=[view(0, [0, 1], 520)])
    check_registration(same, [], ctx)
    error = _refusal(rank("generation", tpb=32, views=[view(0, [0, 1], 1040)]), ctx)
    assert (error.code, error.field, error.local, error.peer) == (
        "tokens_per_block_mismatch",
        "views[0].tokens_per_block",
        32,
        16,
    )
    assert "view 0's bytes_per_layer 1040 is not a whole number of token rows" in error.detail


def test_case_13_sub_byte_head_slicing_that_is_byte_aligned_is_admitted() -> None:
    ctx = instance(
        "context", tp=1, heads=4, dtype="nvfp4", views=lambda t, p: [view(0, [0, 1], 1024, heads=4)]
    )
    gen = rank("generation", tp=2, heads=2, dtype="nvfp4", views=[view(0, [0, 1], 512, heads=2)])
    check_registration(gen, [], ctx)
    assert build_plan(ctx, gen).peers[0].views[0].mapper == "hnd"


def test_case_14_half_byte_heads_are_refused_at_registration() -> None:
    # 2 heads of one token x one nvfp4 element: 2 bytes for K+V of 2 heads, not byte-aligned per head.
    error = _refusal(
        rank("generation", dtype="nvfp4", tpb=1, head_dim=1, views=[view(0, [0, 1], 2, heads=2)]),
        [],
    )
    assert (error.code, error.stage) == ("bytes_per_layer_not_divisible", "self")


def test_case_15_nhd_head_mismatch_reports_its_descriptor_count() -> None:
    ctx = instance(
        "context", tp=1, heads=4, views=lambda t, p: [view(0, [0, 1], 1024, kind="nhd", heads=4)]
    )
    gen = rank("generation", tp=2, views=[view(0, [0, 1], 512, kind="nhd", heads=2)])
    plan = build_plan(ctx, gen)
    assert plan.fragments_per_block == 64  # 2 layers x K/V x 16 tokens
    (warning,) = plan.warnings
    assert "local_kv_heads=2, peer_kv_heads=4" in warning
    assert "~4 per transferred token" in warning


def test_case_27_nhd_bytes_not_divisible_by_buffers_tokens_heads() -> None:
    error = _refusal(rank(tpb=2, views=[view(0, [0, 1], 17, kind="nhd", heads=2)]), [])
    assert (error.code, error.local, error.peer) == ("bytes_per_layer_not_divisible", 17, 8)


def test_case_28_nhd_tokens_per_block_mismatch_is_planned_and_bytes_per_token_must_agree() -> None:
    ctx = instance("context", tp=2, tpb=2, views=lambda t, p: [view(0, [0, 1], 64, kind="nhd")])
    check_registration(rank("generation", tpb=4, views=[view(0, [0, 1], 128, kind="nhd")]), [], ctx)
    error = _refusal(rank("generation", tpb=4, views=[view(0, [0, 1], 256, kind="nhd")]), ctx)
    assert (error.code, error.local, error.peer) == ("bytes_per_layer_mismatch", 16, 8)


def test_case_29_uneven_buffers_cannot_be_expressed_and_duplicate_layers_are_refused() -> None:
    # kvroute declares buffers_per_layer and bytes_per_layer once per view, so the reference's uneven
    # buffer entries have no encoding; the nearest malformed table lists one layer twice.
    error = _refusal(rank(views=[view(0, [0, 0], 256, offsets=[0, 256])]), [])
    assert (error.code, error.local) == ("duplicate_layer", 0)


def test_case_30_overlapping_layer_regions_are_refused() -> None:
    error = _refusal(rank(views=[view(0, [0, 1], 512, offsets=[0, 256])]), [])
    assert error.code == "views_overlap"


def test_d8_draft_layer_count_is_reported_before_draft_head_geometry() -> None:
    def with_draft(layers, draft_bytes):
        return [
            view(),
            view(
                1,
                layers,
                draft_bytes,
                owner="draft",
                heads=1,
                offsets=[1024 + 512 * i for i in range(len(layers))],
            ),
        ]

    ctx = instance("context", tp=2, draft=1, views=lambda t, p: with_draft([0], 256))
    gen = rank("generation", draft=2, views=with_draft([0, 1], 512))
    error = _refusal(gen, ctx)
    assert (error.code, error.local, error.peer) == ("draft_layers_mismatch", 2, 1)
    # With the counts equal, the same draft views fail on their head geometry.
    gen_one = rank("generation", draft=1, views=with_draft([0], 512))
    assert _refusal(gen_one, ctx).code == "bytes_per_layer_mismatch"
