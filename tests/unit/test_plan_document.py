"""``Plan.from_json``: a plan document read back is the plan that wrote it, and a document that
is not a plan is refused by member (``invalid_plan``), never coerced or half read."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from kvroute.geometry import GeometryError, Plan, build_plan
from kvroute.pictures import plan_svg
from kvroute.render import plan_text
from kvroute.transfer import CopyPlan
from tests.unit.docs import instance, view
from tests.unit.test_reference_cp import _mla
from tests.unit.test_render import _hybrid_views, _tp3_to_tp2


def _plans() -> dict[str, Plan]:
    def pair(ctx: Any, gen: Any, receiver: int = 0) -> Plan:
        return build_plan(ctx, gen[receiver])

    dense = lambda t, p: [view(0, [0, 1], 512)]  # noqa: E731
    windowed = lambda t, p: [view(0, [0, 1], 512, sliding_window=64)]  # noqa: E731
    return {
        "tp2-to-tp2": pair(instance("context", tp=2, views=dense), instance("generation", tp=2, views=dense)),
        "16-to-64-tokens": pair(
            instance("context", tp=2, views=dense),
            instance("generation", tp=2, tpb=64, views=lambda t, p: [view(0, [0, 1], 2048)]),
        ),
        "windowed": pair(
            instance("context", tp=2, views=windowed),
            instance("generation", tp=2, tpb=64, views=lambda t, p: [view(0, [0, 1], 2048, sliding_window=64)]),
        ),
        "hybrid": pair(
            instance("context", tp=4, views=lambda t, p: _hybrid_views(4)),
            instance("generation", tp=2, views=lambda t, p: _hybrid_views(2)),
            1,
        ),
        "tp4-to-cp4": build_plan(
            [_mla("context", tpb=8, tp=4, tp_rank=q) for q in range(4)],
            _mla("generation", tpb=2, cp=4, cp_rank=1),
        ),
    }  # fmt: skip


PLANS = _plans()


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("period", [False, True])
def test_a_document_read_back_writes_itself_again(name: str, period: bool) -> None:
    plan = PLANS[name]
    doc = plan.to_json(sender_generations={0: 3}, receiver_generation=7, period=period)
    read = Plan.from_json(doc)
    assert read.to_json() == doc
    assert (read.fingerprint, read.expected_writers) == (plan.fingerprint, plan.expected_writers)
    generations = {rank: 3 if rank == 0 else None for rank in plan.sender_ranks}
    assert (read.sender_generations, read.receiver_generation) == (generations, 7)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_copy_plan_of_a_document_read_back_is_the_plans(name: str) -> None:
    """Compiled from the planner's plan or from its period-form document: the same copies."""
    built = CopyPlan.from_plan(PLANS[name])
    read = CopyPlan.from_plan(Plan.from_json(PLANS[name].to_json(period=True)))
    assert (read.bytes_per_block, read.state_bytes) == (built.bytes_per_block, built.state_bytes)
    for mine, theirs in zip(built.senders, read.senders, strict=True):
        for a, b in zip(mine.copies, theirs.copies, strict=True):
            assert (a.src_pool, a.dst_pool, a.state, a.period) == (
                b.src_pool,
                b.dst_pool,
                b.state,
                b.period,
            )
            assert a.sliding_window == b.sliding_window
            if not a.period:  # equal block sizes keep block fragments beside the period here
                assert a.fragments.tolist() == b.fragments.tolist()


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("period", [False, True])
def test_the_typed_plan_renders_as_its_document_read_back(name: str, period: bool) -> None:
    """The service renders the typed plan (``period_form`` for ``fragments=period``); a worker
    renders the document it fetched, read back: one table, one picture, one document."""
    generations = {rank: 3 for rank in PLANS[name].sender_ranks}
    plan = replace(PLANS[name], sender_generations=generations, receiver_generation=7)
    read = Plan.from_json(plan.to_json(period=period))
    typed = plan.period_form() if period else plan
    assert typed.to_json() == read.to_json() == plan.to_json(period=period)
    assert plan_text(typed) == plan_text(read)
    assert plan_svg(typed) == plan_svg(read)


def _refused(doc: Any) -> GeometryError:
    with pytest.raises(GeometryError) as refused:
        Plan.from_json(doc)
    assert refused.value.code == "invalid_plan"
    return refused.value


def test_missing_and_mistyped_members_are_named() -> None:
    doc = _tp3_to_tp2(1)
    assert _refused([]).field == "plan"
    for path, value, field in [
        (("deployment",), None, "plan.deployment"),
        (("receiver", "rank"), "1", "plan.receiver.rank"),
        (("receiver", "rank"), True, "plan.receiver.rank"),
        (("fanin_bounce_safe",), 1, "plan.fanin_bounce_safe"),
        (("peers", 0, "views", 0, "src_pool"), 0.5, "plan.peers[0].views[0].src_pool"),
        (("peers", 0, "views", 0, "owner"), "both", "plan.peers[0].views[0].owner"),
        (("peers", 0, "views", 0, "heads", "dst"), [0], "plan.peers[0].views[0].heads.dst"),
        (("peers", 1, "views", 0, "fragments"), [[0, 0, 0]], "plan.peers[1].views[0].fragments[0]"),
        (
            ("peers", 1, "views", 0, "fragments"),
            [[0, 0, 4], [0, -1, 4]],
            "plan.peers[1].views[0].fragments[1]",
        ),
        (
            ("peers", 1, "views", 0, "fragments"),
            [[0, 8, True]],
            "plan.peers[1].views[0].fragments[0]",
        ),
        (("peers", 1, "views", 0, "fragments"), [[0, 8]], "plan.peers[1].views[0].fragments[0]"),
        (("peers", 1, "views", 0, "dst_pool"), None, "plan.peers[1].views[0].dst_pool"),
    ]:
        broken = copy.deepcopy(doc)
        *parents, last = path
        target = broken
        for key in parents:
            target = target[key]
        if value is None:
            del target[last]
        else:
            target[last] = value
        assert _refused(broken).field == field, path


def test_derived_members_that_contradict_the_fragments_are_refused() -> None:
    doc = _tp3_to_tp2(1)
    for member, field in [
        ({"expected_writers": 1}, "plan.expected_writers"),
        ({"bytes_per_block": 1}, "plan.bytes_per_block"),
    ]:
        assert _refused(doc | member).field == field
    lying = copy.deepcopy(doc)
    lying["peers"][0]["sends"] = not lying["peers"][0]["sends"]
    assert _refused(lying).field == "plan.peers[0].sends"


def test_a_window_cutting_other_blocks_than_its_period_is_refused() -> None:
    doc = PLANS["windowed"].to_json()
    view_doc = doc["peers"][0]["views"][0]
    assert "period_fragments" in view_doc
    view_doc["window"]["dst_tokens_per_block"] = 32
    error = _refused(doc)
    assert error.field == "plan.peers[0].views[0].window"
    assert "the period 16 -> 64" in error.detail
