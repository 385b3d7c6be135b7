"""Plans rendered for people: the text table and the SVG name the right writer for every head."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from kvroute.geometry import Plan, build_plan
from kvroute.pictures import plan_svg
from kvroute.render import plan_rows, plan_text
from tests.unit.docs import instance, view
from tests.unit.test_reference_derived import d1, d3
from tests.unit.test_reference_state import ssm

SVG = "{http://www.w3.org/2000/svg}"


def _tp3_to_tp2(receiver: int) -> dict:
    ctx = instance(
        "context", tp=3, heads=2, views=lambda t, p: [view(0, [0, 1], 512, heads=2, total=6)]
    )
    gen = instance(
        "generation", tp=2, heads=3, views=lambda t, p: [view(0, [0, 1], 768, heads=3, total=6)]
    )
    return build_plan(ctx, gen[receiver]).to_json(
        sender_generations={0: 4, 1: 4, 2: 5}, receiver_generation=2
    )


def test_text_table_lists_each_sender_view_pair() -> None:
    plan = Plan.from_json(_tp3_to_tp2(1))
    assert plan_rows(plan) == [
        ("1", "yes", "0->0", "target", "key+value", "hnd", "3", "0-1", "512", "4"),
        ("2", "yes", "0->0", "target", "key+value", "hnd", "4-5", "0-1", "1024", "4"),
    ]
    text = plan_text(plan)
    assert "ctx (dp group 0) -> gen rank 1 (generation 2)" in text
    assert "{0:4, 1:4, 2:5}" in text
    assert "expected writers 2  fan-in bounce safe False" in text


def test_text_table_shows_silent_replicas() -> None:
    ctx, (gen,) = d1(False)
    rows = plan_rows(Plan.from_json(build_plan(ctx, gen).to_json()))
    assert [(r[0], r[1]) for r in rows] == [("0", "yes"), ("1", "no"), ("2", "yes"), ("3", "no")]


def _cells(svg: str) -> list[tuple[str, str]]:
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter(f"{SVG}text")]
    titles = [
        r.find(f"{SVG}title").text
        for r in root.iter(f"{SVG}rect")
        if r.find(f"{SVG}title") is not None
    ]
    return texts, titles


def test_svg_colours_every_receiver_head_with_its_writer() -> None:
    texts, titles = _cells(plan_svg(Plan.from_json(_tp3_to_tp2(1))))
    assert titles == [
        "head 3, layers 0-1: sender rank 1",
        "head 4, layers 0-1: sender rank 2",
        "head 5, layers 0-1: sender rank 2",
    ]
    assert "view 0 (target, key+value, hnd)" in texts


def test_svg_draws_target_and_draft_views_separately() -> None:
    ctx, gen = d3(False)
    texts, titles = _cells(plan_svg(Plan.from_json(build_plan(ctx, gen[0]).to_json())))
    assert [t for t in texts if t.startswith("view")] == [
        "view 0 (target, key+value, hnd)",
        "view 1 (draft, key+value, intact)",
    ]
    assert titles == [
        "head 0, layers 0-1: sender rank 0",
        "head 1, layers 0-1: sender rank 1",
        "head 0, layers 0: sender rank 0",
    ]


def test_svg_names_both_sizes_the_totals_and_explains_its_labels() -> None:
    texts, _ = _cells(plan_svg(Plan.from_json(_tp3_to_tp2(1))))
    assert texts[:2] == [
        "plan d: ctx (context, TP3 PP1, dp group 0) -> gen rank 1 (generation, TP2 PP1)",
        "2 writers of 2 sender ranks heard; 1,536 bytes and 8 fragments per block; "
        "fan-in bounce safe: False",
    ]
    assert "cell labelled rN: sender rank N writes that receiver head" in texts


def test_svg_lists_the_heads_and_bytes_each_writer_moves() -> None:
    plan = Plan.from_json(_tp3_to_tp2(1))
    texts, _ = _cells(plan_svg(plan))
    writers = [t for t in texts if " writes view " in t]
    assert writers == [
        "tp1 pp0 writes view 0 (target) h3 = 512 bytes, 4 fragments",
        "tp2 pp0 writes view 0 (target) h4-5 = 1,024 bytes, 4 fragments",
    ]
    moved = sum(int(line.split("= ")[1].split(" bytes")[0].replace(",", "")) for line in writers)
    assert moved == plan.bytes_per_block


def test_svg_says_which_replicas_stay_silent() -> None:
    ctx, (gen,) = d1(False)
    texts, _ = _cells(plan_svg(Plan.from_json(build_plan(ctx, gen).to_json())))
    silent = [t for t in texts if "sends nothing" in t]
    assert [t.split()[0] for t in silent] == ["tp1", "tp3"]


def _sixteen_to_sixty_four() -> Plan:
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 512)])
    gen = instance("generation", tp=2, tpb=64, views=lambda t, p: [view(0, [0, 1], 2048)])
    return Plan.from_json(build_plan(ctx, gen[0]).to_json())


def test_text_names_each_cut_of_a_period() -> None:
    text = plan_text(_sixteen_to_sixty_four())
    assert (
        "period view 0: 64 tokens = 4 sender blocks of 16 -> 1 receiver blocks of 64; "
        "sb0->rb0 [0,16)  sb1->rb0 [16,32)  sb2->rb0 [32,48)  sb3->rb0 [48,64)"
    ) in text
    assert plan_rows(_sixteen_to_sixty_four()) == [
        ("0", "yes", "0->0", "target", "key+value", "intact", "0-1", "0-1", "4096", "32")
    ]


def test_svg_draws_the_period_under_its_view() -> None:
    texts, titles = _cells(plan_svg(_sixteen_to_sixty_four()))
    assert [t for t in texts if t.startswith(("sb", "rb"))] == ["sb0", "sb1", "sb2", "sb3", "rb0"]
    cuts = [title for title in titles if title.startswith("tokens")]
    assert cuts == [
        f"tokens [{a}, {a + 16}): sender block {a // 16} -> receiver block 0"
        for a in (0, 16, 32, 48)
    ]
    assert "64 tokens per period, 32 fragments" in texts


def _hybrid_plan() -> Plan:
    ctx = instance("context", tp=4, views=lambda t, p: _hybrid_views(4))
    gen = instance("generation", tp=2, views=lambda t, p: _hybrid_views(2))
    return Plan.from_json(build_plan(ctx, gen[1]).to_json())


def _hybrid_views(tp: int) -> list[dict]:
    # Attention layer 0 with a 64-token window, Mamba layers 1 and 2 (8 SSM heads of 64 bytes).
    return [
        view(0, [0], 4 * 8 * 16 // tp * 2, heads=8 // tp, total=8, sliding_window=64),
        ssm(tp, layers=(1, 2), view_id=1),
    ]


def test_text_shows_windows_and_state_writers() -> None:
    text = plan_text(_hybrid_plan())
    assert "window 0->0: last 64 tokens (sender 64, receiver 64)" in text
    assert "floor((prompt_tokens + 1 - 64) / 16)" in text
    assert "recurrent state, once per request slot: 512 bytes/request" in text
    state_rows = [r for r in text.splitlines() if " ssm " in f" {r} "]
    assert [r.split()[:2] + r.split()[4:8] for r in state_rows] == [
        ["2", "1->1", "ssm", "2/4->1/2", "heads", "4-5"],
        ["3", "1->1", "ssm", "3/4->1/2", "heads", "6-7"],
    ]


def test_svg_draws_state_views_per_request_slot() -> None:
    texts, titles = _cells(plan_svg(_hybrid_plan()))
    assert "view 0 (target, key+value, hnd) window 64" in texts
    assert "state view 1 (target, ssm, ssm, per request)" in texts
    writer = "tp2 pp0 writes view 0 (target) h4-5 = 256 bytes, 2 fragments; "
    assert f"{writer}state view 1 heads 4-5 = 256 bytes per request" in texts
    assert [t for t in titles if t.startswith("state")] == [
        "state head 4, layers 1-2: sender rank 2",
        "state head 5, layers 1-2: sender rank 2",
        "state head 6, layers 1-2: sender rank 3",
        "state head 7, layers 1-2: sender rank 3",
    ]


def test_text_names_a_window_between_block_sizes() -> None:
    ctx = instance("context", tp=2, views=lambda t, p: [view(0, [0, 1], 512, sliding_window=64)])
    gen = instance(
        "generation", tp=2, tpb=64, views=lambda t, p: [view(0, [0, 1], 2048, sliding_window=64)]
    )
    text = plan_text(Plan.from_json(build_plan(ctx, gen[0]).to_json()))
    assert (
        "window 0->0: last 64 tokens (sender 64, receiver 64); tokens from the later block start "
        "at or before prompt_tokens + 1 - 64 (16-token sender blocks, 64-token receiver blocks) "
        "are sent"
    ) in text
    assert "period view 0: 64 tokens = 4 sender blocks of 16 -> 1 receiver blocks of 64" in text
