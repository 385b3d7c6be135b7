"""Property test: quantized KV caches move their scales byte-exactly, whatever the two TP layouts.

Hypothesis draws a quantized model (fp8 or NVFP4 K and V of 1..3 bytes per token-head) with its
scales in one of the three layouts a registration can declare (``kv_quantization.scale_layout``):
per-head scales (a float32 per token and head: an ``hnd``/``nhd`` view split over TP like the
heads), per-block microscaling scales (one fp8 byte per ``scale_block`` elements of a head's row,
split the same way) or per-tensor scales (a ``replicated`` view, identical on every TP rank and
written by one elected sender). Both sides declare the quantization, so admission's scale-view
checks run; then every receiver rank's plan is executed on bytes against one logical tensor
sharded both ways (``tests/truth.py``), by the same harness as the dense property test: every
destination byte, scales included, is written exactly once with the right content.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, check_registration
from tests.unit.test_plan_ground_truth import (
    BLOCK_TOKENS,
    HEAD_TOTALS,
    assert_plans_exact,
    side,
    world_settings,
)
from tests.world import Side, ViewClass, instance

EXAMPLES = max(50, int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000")) // 4)
SCALE_ROLES = ("key_scale", "value_scale")


def scale_class(layout: str, kv: ViewClass, kind: str) -> ViewClass:
    if layout == "per_tensor":  # one value per layer and buffer, the same on every TP rank
        return ViewClass(SCALE_ROLES, "target", "replicated", 1, 2, 4, "float32")
    if layout == "per_head":  # a float32 per token and head
        return ViewClass(SCALE_ROLES, "target", kind, kv.total_heads, 2, 4, "float32")
    return ViewClass(SCALE_ROLES, "target", kind, kv.total_heads, 2, 1, "float8_e4m3fn")


@st.composite
def quantized_worlds(draw: st.DrawFn) -> tuple[list[ViewClass], Side, Side]:
    layout = draw(st.sampled_from(["per_tensor", "per_head", "per_block"]))
    dtype = draw(st.sampled_from(["float8_e4m3fn", "nvfp4"]))
    kv = ViewClass(
        ("key", "value"),
        "target",
        draw(st.sampled_from(["hnd", "nhd"])),
        draw(st.sampled_from(HEAD_TOTALS)),
        2,
        draw(st.integers(1, 3)),
        dtype,
    )
    cls = [kv, scale_class(layout, kv, draw(st.sampled_from(["hnd", "nhd"])))]
    quant: dict[str, object] = {"kv_dtype": "nvfp4" if dtype == "nvfp4" else "fp8_e4m3"}
    quant["scale_layout"] = layout
    if layout == "per_block":
        quant.update(scale_block=16, scale_dtype="e4m3")
    layers = draw(st.integers(1, 6))
    tokens = draw(st.sampled_from(BLOCK_TOKENS))
    gen_tokens = draw(st.one_of(st.just(tokens), st.sampled_from(BLOCK_TOKENS)))
    ctx = draw(side("context", cls, layers, 0, tokens))
    gen = draw(side("generation", cls, layers, 0, gen_tokens))
    members = tuple(quant.items())
    return cls, replace(ctx, quantization=members), replace(gen, quantization=members)


@pytest.mark.slow
@world_settings(EXAMPLES)
@given(world=quantized_worlds(), data=st.data())
def test_scale_views_move_byte_exactly_under_any_tp_pair(world, data) -> None:
    cls, ctx, gen = world
    regs, _ = instance(gen, cls, "gen")
    assert regs[0].kv_quantization is not None
    assert regs[0].kv_quantization.scale_layout.value == dict(ctx.quantization)["scale_layout"]
    assert_plans_exact(world, data)


def test_a_generation_side_without_the_scale_view_is_refused_not_planned_without_scales() -> None:
    kv = ViewClass(("key", "value"), "target", "hnd", 8, 2, 1, "float8_e4m3fn")
    scales = scale_class("per_head", kv, "hnd")
    ctx_side = Side("context", tp_size=4, layers_per_stage=(2,))
    gen_side = Side("generation", tp_size=2, layers_per_stage=(2,))
    ctx, _ = instance(ctx_side, [kv, scales], "ctx")
    gen, _ = instance(gen_side, [kv], "gen")  # an engine that keeps no scales
    with pytest.raises(GeometryError) as refused:
        check_registration(gen[0], gen[1:], ctx)
    assert refused.value.code == "view_missing"
    assert "scale" in refused.value.detail
