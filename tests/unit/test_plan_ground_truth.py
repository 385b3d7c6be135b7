"""Property test: every plan, executed on bytes, writes every destination byte exactly once, correctly.

Hypothesis draws whole deployments: TP 1..16 on each side, PP 1..4 with uneven splits, head totals with
every legal divisibility (head replication, non-integer TP ratios), HND/NHD/replicated views, target and
draft views with different head totals sharing one pool, attention-DP on either side, legacy views
without head counts, sub-byte (1-byte unit) views. The expected bytes come from tests/world.py, which
shards one logical KV tensor by rule 1 written independently of the planner.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, build_plan, check_registration
from tests.world import Side, Truth, ViewClass, execute, instance

EXAMPLES = int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000"))
HEAD_TOTALS = [1, 2, 3, 4, 6, 8, 12, 16]


def _tp_choices(totals: list[int]) -> list[int]:
    return [t for t in range(1, 17) if all(h % t == 0 or t % h == 0 for h in totals)]


@st.composite
def splits(draw: st.DrawFn, layers: int, stages: int) -> tuple[int, ...]:
    if stages == 1:
        return (layers,)
    cuts = sorted(
        draw(
            st.lists(
                st.integers(1, layers - 1), min_size=stages - 1, max_size=stages - 1, unique=True
            )
        )
    )
    bounds = [0, *cuts, layers]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


@st.composite
def classes(draw: st.DrawFn, draft_layers: int) -> list[ViewClass]:
    kv_kind = draw(st.sampled_from(["hnd", "nhd"]))
    result = [
        ViewClass(
            ("key", "value"),
            "target",
            kv_kind,
            draw(st.sampled_from(HEAD_TOTALS)),
            2,
            draw(st.integers(1, 3)),
        )
    ]
    if draw(st.booleans()):  # block scales: sub-byte formats give 1-byte units
        result.append(
            ViewClass(
                ("key_block_scale", "value_block_scale"),
                "target",
                draw(st.sampled_from(["hnd", "nhd"])),
                result[0].total_heads,
                2,
                1,
                "float8_e4m3fn",
            )
        )
    if draw(st.booleans()):
        result.append(
            ViewClass(("index_key",), "target", "replicated", 1, 1, draw(st.integers(1, 3)))
        )
    if draft_layers:
        result.append(
            ViewClass(
                ("key", "value"),
                "draft",
                draw(st.sampled_from(["hnd", "nhd"])),
                draw(st.sampled_from(HEAD_TOTALS)),
                2,
                draw(st.integers(1, 2)),
                "nvfp4",
            )
        )
    return result


@st.composite
def side(
    draw: st.DrawFn, role: str, cls: list[ViewClass], layers: int, draft_layers: int, tokens: int
) -> Side:
    totals = [c.total_heads for c in cls if c.kind != "replicated"]
    tp_per_dp = draw(st.sampled_from(_tp_choices(totals)))
    dp = draw(st.sampled_from([d for d in (1, 2, 4) if tp_per_dp * d <= 16]))
    pp = draw(st.integers(1, min(4, layers, max(1, 32 // (tp_per_dp * dp)))))
    sharded = [i for i, c in enumerate(cls) if c.kind != "replicated"]
    legacy_class = draw(st.sampled_from([None, *sharded]))
    legacy = frozenset(
        i
        for i in sharded
        if legacy_class is not None
        and _heads(cls[i], tp_per_dp) == _heads(cls[legacy_class], tp_per_dp)
    )
    return Side(
        role=role,
        tp_size=tp_per_dp * dp,
        layers_per_stage=draw(splits(layers, pp)),
        dp_size=dp,
        attention_dp=dp > 1,
        legacy=legacy,
        declare_totals=draw(st.booleans()),
        tokens_per_block=tokens,
        num_draft_layers=draft_layers,
        shared_pool=draw(st.booleans()),
        draft_stage=draw(st.sampled_from([-1, 0])),
        seed=draw(st.integers(0, 10**6)),
    )


def _heads(c: ViewClass, tp: int) -> int:
    return max(1, c.total_heads // tp)


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[ViewClass], Side, Side]:
    layers = draw(st.integers(1, 6))
    draft_layers = draw(st.integers(0, 2))
    tokens = draw(st.integers(1, 4))
    cls = draw(classes(draft_layers))
    return (
        cls,
        draw(side("context", cls, layers, draft_layers, tokens)),
        draw(side("generation", cls, layers, draft_layers, tokens)),
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(world=worlds(), data=st.data())
def test_every_destination_byte_written_once_with_the_right_content(world, data) -> None:
    cls, ctx_side, gen_side = world
    ctx, ctx_layouts = instance(ctx_side, cls, "ctx")
    gen, gen_layouts = instance(gen_side, cls, "gen")
    check_registration(ctx[0], ctx[1:], gen)
    check_registration(gen[-1], gen[:-1], ctx)
    truth = Truth(cls, ctx_side.tokens_per_block)
    sender_dp = data.draw(st.integers(0, ctx_side.dp_size - 1)) if ctx_side.attention_dp else 0
    src_blocks = data.draw(st.permutations([0, 1, 2]))[:2]
    dst_blocks = data.draw(st.permutations([0, 1, 2]))[:2]
    sender_pools = {
        r: truth.fill(ctx_side, ctx_layouts[r], r, [0, 1, 2], [0, 1, 2]) for r in range(len(ctx))
    }
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        plan = build_plan(ctx, receiver, sender_dp_rank=sender_dp).to_json()
        assert all(ctx[p["rank"]].group == sender_dp for p in plan["peers"])
        out, writes = execute(
            plan, sender_pools, dict(enumerate(ctx_layouts)), layout, src_blocks, dst_blocks
        )
        expected = truth.fill(gen_side, layout, receiver.rank, dst_blocks, src_blocks)
        for pool, want in expected.items():
            np.testing.assert_array_equal(
                writes[pool], (want != 0).astype(np.int64), err_msg=f"write count, pool {pool}"
            )
            np.testing.assert_array_equal(out[pool], want, err_msg=f"content, pool {pool}")
        assert plan["expected_writers"] == sum(p["sends"] for p in plan["peers"])


MUTATIONS = [
    "draft_layers",
    "tokens_per_block",
    "head_dim",
    "dtype",
    "unit",
    "kind",
    "roles",
    "total_heads",
]


@settings(
    max_examples=max(50, EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(world=worlds(), mutation=st.sampled_from(MUTATIONS))
def test_incompatible_pairs_are_refused_with_their_code(world, mutation) -> None:
    cls, ctx_side, gen_side = world
    gen_cls = list(cls)
    expected = _mutate(mutation, cls, gen_cls, ctx_side, gen_side)
    if expected is None:
        return
    gen_side, code = expected
    ctx, _ = instance(ctx_side, cls, "ctx")
    gen, _ = instance(gen_side, gen_cls, "gen")
    with pytest.raises(GeometryError) as refused:
        check_registration(gen[0], [], ctx)
    assert refused.value.code == code, (
        f"{mutation}: got {refused.value.code}: {refused.value.detail}"
    )
    assert refused.value.stage == "peer"
    assert refused.value.peer_instance == "ctx"


def _mutate(mutation: str, cls: list[ViewClass], gen_cls: list[ViewClass], ctx: Side, gen: Side):
    from dataclasses import replace

    kv = cls[0]
    if mutation == "draft_layers":
        # Draft head geometry broken too: the draft-layer count must still be what is reported.
        if ctx.num_draft_layers:
            gen_cls[-1] = replace(cls[-1], unit=cls[-1].unit + 1)
        return replace(gen, num_draft_layers=gen.num_draft_layers + 1), "draft_layers_mismatch"
    if mutation == "tokens_per_block":
        return replace(gen, tokens_per_block=gen.tokens_per_block + 1), "tokens_per_block_mismatch"
    if mutation == "head_dim":
        return replace(gen, head_dim=gen.head_dim * 2), "head_dim_mismatch"
    if mutation == "dtype":
        return replace(gen, dtype="float32"), "element_size_mismatch"
    if mutation == "unit":
        gen_cls[0] = replace(kv, unit=kv.unit + 1)
        same = _heads(kv, ctx.tp_per_dp) == _heads(kv, gen.tp_per_dp)
        return gen, "bytes_per_layer_mismatch" if same else "bytes_per_head_mismatch"
    if mutation == "kind":
        gen_cls[0] = replace(kv, kind="nhd" if kv.kind == "hnd" else "hnd")
        return gen, "mapper_kind_mismatch"
    if mutation == "roles":
        gen_cls[0] = replace(kv, roles=("key", "value", "extra"))
        return gen, "view_missing"
    if mutation == "total_heads" and ctx.declare_totals and gen.declare_totals:
        doubled = kv.total_heads * 2
        if doubled % gen.tp_per_dp == 0 or gen.tp_per_dp % doubled == 0:
            gen_cls[0] = replace(kv, total_heads=doubled)
            # Legacy views read the rank-wide count, which the doubled total changes for every class.
            return replace(gen, legacy=frozenset()), "total_kv_heads_mismatch"
    return None
