"""Property test: views whose kernels tile a head's tokens their own way (``interior``) move exactly.

vLLM's CPU attention keeps, per head, K then V, K transposed (``[head_dim][tokens]``) or VNNI-packed
(``[head_dim / 2][tokens][2]``) and V in token pairs: the bytes of a token are not one row. Hypothesis
draws such interiors independently on both sides (head/buffer order, planes per buffer, packed token
groups cut in pieces), with every TP, PP and block-size pair the main property test draws, and executes every plan
against tests/truth.py, whose ``_in_region`` writes the interior's definition out independently of
the planner. Sides that pack tokens in groups pair only with the same tiling: anything else must be
refused with ``interior_mismatch``, naming both interiors.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, check_registration
from tests.unit.test_plan_ground_truth import HEAD_TOTALS, assert_plans_exact, side
from tests.world import Side, ViewClass, instance

EXAMPLES = int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000")) // 4
Interior = tuple[str, tuple[tuple[int, int, int], ...]]


@st.composite
def interiors(draw: st.DrawFn, unit: int, tokens: int) -> Interior | None:
    if draw(st.booleans()):
        return None
    order = draw(st.sampled_from(["head_buffer", "buffer_head"]))
    return order, (draw(tilings(unit, tokens)), draw(tilings(unit, tokens)))


@st.composite
def tilings(draw: st.DrawFn, unit: int, tokens: int) -> tuple[int, int, int]:
    """(planes, token_group, group_planes): a packed group's chunks cut in pieces (amx's VNNI)."""
    planes = draw(st.sampled_from([p for p in (1, 2, 4, 8) if unit % p == 0]))
    group = draw(st.sampled_from([g for g in (1, 2, 4) if tokens % g == 0]))
    chunk = unit // planes
    pieces = draw(st.sampled_from([q for q in (1, 2, 4) if chunk % q == 0])) if group > 1 else 1
    return planes, group, pieces


@st.composite
def tiled_worlds(draw: st.DrawFn) -> tuple[list[ViewClass], Side, Side]:
    layers = draw(st.integers(1, 4))
    tokens = draw(st.sampled_from([2, 4, 6, 8]))
    gen_tokens = draw(st.one_of(st.just(tokens), st.sampled_from([2, 4, 8])))
    unit = draw(st.sampled_from([2, 4, 8]))
    cls = [
        ViewClass(("key", "value"), "target", "hnd", draw(st.sampled_from(HEAD_TOTALS)), 2, unit)
    ]
    tiles = [draw(interiors(unit, size)) for size in (tokens, gen_tokens)]
    grouped = any(g > 1 for tile in tiles for _, g, _ in _tilings(tile))
    # An untiled class beside it (block scales); not beside packed groups, which widen their own
    # pair's range only, while the truth's expected positions are one range for every class.
    if not grouped and draw(st.booleans()):
        cls.append(
            ViewClass(("key_scale", "value_scale"), "target", "hnd", cls[0].total_heads, 2, 1)
        )
    ctx = draw(side("context", cls, layers, 0, tokens))
    gen = draw(side("generation", cls, layers, 0, gen_tokens))
    ctx, gen = (
        Side(**{**vars(s), "interiors": ((0, t),) if t else ()})
        for s, t in zip((ctx, gen), tiles, strict=True)
    )
    return cls, ctx, gen


def _tilings(interior: Interior | None) -> tuple[tuple[int, int, int], ...]:
    return interior[1] if interior else ((1, 1, 1), (1, 1, 1))


def _compatible(ctx: Side, gen: Side) -> bool:
    pairs = zip(_tilings(ctx.interior(0)), _tilings(gen.interior(0)), strict=True)
    return all(mine == theirs or (mine[1] == theirs[1] == 1) for mine, theirs in pairs)


def _canonical(interior: Interior | None) -> Interior | None:
    return None if interior in (None, ("buffer_head", ((1, 1, 1), (1, 1, 1)))) else interior


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=tiled_worlds(), data=st.data())
def test_tiled_views_move_exactly_or_are_refused(world, data) -> None:
    cls, ctx_side, gen_side = world
    if not _compatible(ctx_side, gen_side):
        ctx, _ = instance(ctx_side, cls, "ctx")
        gen, _ = instance(gen_side, cls, "gen")
        with pytest.raises(GeometryError) as refused:
            check_registration(gen[0], [], ctx)
        assert refused.value.code == "interior_mismatch", refused.value.detail
        assert refused.value.field == "views[0].interior"
        return
    group = max(g for interior in (ctx_side.interior(0), gen_side.interior(0))
                for _, g, _ in _tilings(interior))  # fmt: skip
    differ = _canonical(ctx_side.interior(0)) != _canonical(gen_side.interior(0))
    assert_plans_exact(world, data, recut=frozenset({0} if differ else ()), group=group)
