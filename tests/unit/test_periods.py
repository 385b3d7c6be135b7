"""The period mapping between blocks of different sizes, and token ranges cut from it, by hand.

Each case spells out the expected fragments from the byte layout of docs/geometry.md (HND buffers are
[heads][tokens][bytes], NHD buffers [tokens][heads][bytes], replicated buffers [tokens][bytes]) with
the case's own numbers; the property test in test_plan_ground_truth.py covers the general case.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from kvroute.geometry import (
    BlockList,
    PeriodMap,
    TokenGap,
    TokenRange,
    TokenRangeError,
    build_plan,
    check_registration,
    first_gap,
    full_periods,
    range_copies,
)
from tests.unit.docs import instance, rank, view

SPEC = Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml"


def _moved(ctx, gen, sender: int = 0) -> dict:
    check_registration(gen, [], ctx)
    peer = next(p for p in build_plan(ctx, gen).to_json()["peers"] if p["rank"] == sender)
    (moved,) = peer["views"]
    return moved


def _spans(moved: dict) -> set[tuple[int, ...]]:
    spans = [tuple(span) for span in moved["period_fragments"]]
    assert spans == sorted(spans, key=lambda s: (s[2], s[3]))
    assert len(set(spans)) == len(spans) == moved["descriptors_per_period"]
    return set(spans)


def test_hnd_sender_blocks_of_16_fill_half_a_receiver_block_of_32() -> None:
    # 8 bytes per token-head; sender TP2 holds 2 of 4 heads, the receiver (TP1, 32 tokens) all 4.
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 512, total=4)])
    gen = rank("generation", tp=1, heads=4, tpb=32, views=[view(0, [0, 1], 2048, total=4)])
    moved = _moved(ctx, gen, sender=1)  # heads 2 and 3
    assert (moved["period_tokens"], moved["src_blocks_per_period"]) == (32, 2)
    assert moved["dst_blocks_per_period"] == 1
    assert _spans(moved) == {
        (
            sb,
            layer * 512 + b * 256 + k * 128,
            0,
            layer * 2048 + b * 1024 + (2 + k) * 256 + sb * 128,
            128,
            16 * sb,
            16,
        )
        for layer in (0, 1)
        for b in (0, 1)
        for k in (0, 1)
        for sb in (0, 1)
    }
    assert (moved["bytes_per_block"], moved["bytes_per_period"]) == (2048, 2048)
    assert moved["descriptors_per_block"] == 16


def test_hnd_sender_block_of_32_splits_into_two_receiver_blocks_of_16() -> None:
    ctx = instance("context", tp=1, heads=4, tpb=32, views=lambda t, p: [view(0, [0, 1], 2048)])
    gen = rank("generation", tp=2, tp_rank=1, tpb=16, views=[view(0, [0, 1], 512)])
    moved = _moved(ctx, gen)
    assert (moved["src_blocks_per_period"], moved["dst_blocks_per_period"]) == (1, 2)
    assert _spans(moved) == {
        (
            0,
            layer * 2048 + b * 1024 + (2 + k) * 256 + db * 128,
            db,
            layer * 512 + b * 256 + k * 128,
            128,
            16 * db,
            16,
        )
        for layer in (0, 1)
        for b in (0, 1)
        for k in (0, 1)
        for db in (0, 1)
    }
    assert moved["descriptors_per_block"] == 8  # per receiver block: 2 layers x K/V x 2 heads


def test_nhd_head_slices_move_one_token_per_fragment() -> None:
    # Sender TP1 rows hold 4 heads (32 bytes a token); receiver rank 1 holds heads 2..3 (16 bytes).
    ctx = instance("context", tp=1, heads=4, views=lambda t, p: [view(0, [0, 1], 1024, kind="nhd")])
    gen = rank("generation", tp_rank=1, tpb=32, views=[view(0, [0, 1], 1024, kind="nhd")])
    moved = _moved(ctx, gen)
    assert _spans(moved) == {
        (
            t // 16,
            layer * 1024 + b * 512 + t % 16 * 32 + 16,
            0,
            layer * 1024 + b * 512 + t * 16,
            16,
            t,
            1,
        )
        for layer in (0, 1)
        for b in (0, 1)
        for t in range(32)
    }


def test_nhd_whole_rows_move_a_piece_of_tokens_per_fragment() -> None:
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 512, kind="nhd")])
    gen = rank("generation", tpb=8, views=[view(0, [0, 1], 256, kind="nhd")])
    moved = _moved(ctx, gen)
    assert moved["mapper"] == "intact"
    assert _spans(moved) == {
        (0, layer * 512 + b * 256 + db * 128, db, layer * 256 + b * 128, 128, 8 * db, 8)
        for layer in (0, 1)
        for b in (0, 1)
        for db in (0, 1)
    }


def test_replicated_rows_of_36_bytes_per_token_fill_a_block_of_64() -> None:
    def latent(tokens: int) -> dict:
        return view(0, [0, 1], 36 * tokens, kind="replicated", roles=["index_key"], buffers=1)

    ctx = instance("context", tp=2, views=lambda t, p: [latent(16)])
    gen = rank("generation", tp=1, tpb=64, views=[latent(64)])
    moved = _moved(ctx, gen)
    assert moved["period_tokens"] == 64
    assert _spans(moved) == {
        (sb, layer * 576, 0, layer * 2304 + sb * 576, 576, 16 * sb, 16)
        for layer in (0, 1)
        for sb in range(4)
    }


def test_sub_byte_heads_are_cut_by_exact_byte_division() -> None:
    # nvfp4, head_dim 8: 4 bytes per token-head, never derived from a 0.5-byte element size.
    ctx = instance(
        "context", tp=1, heads=4, dtype="nvfp4", views=lambda t, p: [view(0, [0, 1], 512, heads=4)]
    )
    gen = rank("generation", tp_rank=1, tpb=32, dtype="nvfp4", views=[view(0, [0, 1], 512)])
    moved = _moved(ctx, gen)
    assert _spans(moved) == {
        (
            sb,
            layer * 512 + b * 256 + (2 + k) * 64,
            0,
            layer * 512 + b * 256 + k * 128 + sb * 64,
            64,
            16 * sb,
            16,
        )
        for layer in (0, 1)
        for b in (0, 1)
        for k in (0, 1)
        for sb in (0, 1)
    }


def test_equal_sizes_keep_block_fragments_and_their_period_form_holds_the_same_bytes() -> None:
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 512, total=4)])
    gen = rank("generation", tp=1, heads=4, views=[view(0, [0, 1], 1024, total=4)])
    plan = build_plan(ctx, gen)
    classic, period = plan.to_json(), plan.to_json(period=True)
    for block_doc, period_doc in zip(classic["peers"], period["peers"], strict=True):
        (by_block,), (by_period,) = block_doc["views"], period_doc["views"]
        assert "period_tokens" not in by_block
        assert (by_period["period_tokens"], by_period["dst_blocks_per_period"]) == (16, 1)
        block_bytes = {(s + i, d + i) for s, d, n in by_block["fragments"] for i in range(n)}
        span_bytes = {
            (s + i, d + i)
            for _, s, _, d, n, _, _ in by_period["period_fragments"]
            for i in range(n)
        }
        assert block_bytes == span_bytes
        assert by_block["bytes_per_block"] == by_period["bytes_per_block"] == 256 * 2 * 2


def _period() -> PeriodMap:
    """One HND head row of 4 bytes a token, 16 -> 64 tokens per block."""
    spans = tuple((sb, 100, 0, 200 + sb * 64, 64, 16 * sb, 16) for sb in range(4))
    return PeriodMap(16, 64, spans)


def test_a_range_starting_and_ending_mid_block_on_both_sides_is_cut_per_token() -> None:
    # The receiver holds tokens 0..19 of its block 3 already; the sender's list starts at token 16.
    src = BlockList([5, 6, 7], first_token=16, tokens_per_block=16)
    dst = BlockList([3], first_token=0, tokens_per_block=64)
    assert range_copies(_period(), TokenRange(20, 50), src, dst) == [
        (5, 100 + 4 * 4, 3, 200 + 20 * 4, 12 * 4),
        (6, 100, 3, 200 + 32 * 4, 16 * 4),
        (7, 100, 3, 200 + 48 * 4, 2 * 4),
    ]


def test_a_receiver_list_in_a_later_period_maps_by_absolute_block() -> None:
    src = BlockList.suffix([10, 11, 12, 13, 14], end=150, tokens_per_block=16, field="src_blocks")
    dst = BlockList.suffix([4], end=150, tokens_per_block=64, field="dst_blocks")
    assert (src.first_token, dst.first_token) == (80, 128)
    assert range_copies(_period(), TokenRange(140, 150), src, dst) == [
        (13, 100 + 12 * 4, 4, 200 + 12 * 4, 4 * 4),
        (14, 100, 4, 200 + 16 * 4, 6 * 4),
    ]


def test_upstream_suffix_rule_and_a_list_too_long_for_its_range() -> None:
    assert BlockList.suffix([1, 2, 3], 100, 16, "src_blocks").first_token == 64
    assert BlockList.suffix([1, 2], 100, 64, "dst_blocks").first_token == 0
    with pytest.raises(TokenRangeError, match="would start at token -64") as too_long:
        BlockList.suffix([1, 2, 3], 100, 64, "dst_blocks")
    assert too_long.value.field == "dst_blocks"


def test_first_gap_names_the_side_and_the_lowest_missing_token() -> None:
    src = BlockList([1, 2], first_token=16, tokens_per_block=16)  # tokens [16, 48)
    dst = BlockList([9], first_token=20, tokens_per_block=64)  # tokens [20, 64)
    assert first_gap(TokenRange(20, 48), src, dst) is None
    gap = first_gap(TokenRange(20, 60), src, dst)
    assert (gap.field, gap.token, gap.covered) == ("src_blocks", 48, (16, 48))
    gap = first_gap(TokenRange(17, 30), src, dst)
    assert (gap.field, gap.token) == ("dst_blocks", 17)
    gap = first_gap(TokenRange(0, 30), src, dst)
    assert (gap.field, gap.token) == ("src_blocks", 0)  # both lack token 0: the sender first
    with pytest.raises(TokenGap) as missing:
        range_copies(_period(), TokenRange(20, 60), src, dst)
    assert missing.value.extras == {"token": 48, "covered": [16, 48], "tokens": [20, 60]}
    assert "holds tokens [16, 48), so token 48 of the range [20, 60) has no block" in str(
        missing.value
    )


def test_ranges_must_be_non_empty_and_full_periods_lie_inside_them() -> None:
    for start, end in ((5, 5), (-1, 3), (7, 2)):
        with pytest.raises(TokenRangeError):
            TokenRange(start, end)
    assert full_periods(TokenRange(20, 200), 64) == range(1, 3)
    assert full_periods(TokenRange(64, 128), 64) == range(1, 2)
    assert not full_periods(TokenRange(20, 100), 64)


@pytest.mark.parametrize(
    ("member", "value", "message"),
    [
        ("dst_blocks_per_period", 2, "not the least common multiple"),
        ("src_blocks_per_period", 3, "not a whole number of blocks"),
        ("period_fragments", [[0, 0, 0, 0, 8, 12, 8]], "not inside sender block 0"),
        ("period_fragments", [[0, 0, 0, 0, 7, 0, 2]], "not a positive multiple of 2 tokens"),
        ("period_fragments", [[3, 0, 0, 0, 8, 62, 4]], "leave the period"),
        ("period_fragments", [[0, 0, 0, 0, 4, 0]], "must be [src_block"),
    ],
)
def test_period_documents_are_checked(member: str, value: object, message: str) -> None:
    doc = {
        "period_tokens": 64,
        "src_blocks_per_period": 4,
        "dst_blocks_per_period": 1,
        "period_fragments": [[1, 0, 0, 64, 64, 16, 16]],
    }
    assert PeriodMap.from_json(doc).spans == ((1, 0, 0, 64, 64, 16, 16),)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        PeriodMap.from_json(doc | {member: value})


def test_both_plan_shapes_satisfy_the_published_schema() -> None:
    spec = yaml.safe_load(SPEC.read_text())
    validator = Draft202012Validator(
        {"$ref": "#/components/schemas/Plan", "components": spec["components"]}
    )
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 512)])
    for tokens in (16, 64):
        gen = rank("generation", tpb=tokens, views=[view(0, [0, 1], 512 * tokens // 16)])
        plan = build_plan(ctx, gen)
        for document in (plan.to_json(receiver_generation=1), plan.to_json(period=True)):
            document["receiver"]["generation"] = 1
            document["sender"]["generations"] = {"0": 1, "1": 1}
            validator.validate(document)
    broken = build_plan(ctx, gen).to_json(receiver_generation=1)
    broken["sender"]["generations"] = {"0": 1, "1": 1}
    broken["peers"][0]["views"][0]["fragments"] = []  # both shapes at once
    assert not validator.is_valid(broken)
