"""Property test: every plan, executed on bytes, writes every destination byte exactly once, correctly.

Hypothesis draws whole deployments: TP 1..16 on each side, PP 1..4 with uneven splits, head totals with
every legal divisibility (head replication, non-integer TP ratios), HND/NHD/replicated views, target and
draft views with different head totals sharing one pool, attention-DP on either side, legacy views
without head counts, sub-byte (1-byte unit) views, and independent tokens per block on the two sides.
Each deployment moves a random token range (starting and ending mid-block on either side, lists named
by their first token or by upstream's suffix rule), or, with equal block sizes, whole block pairs by
the block fragments. The expected bytes come from tests/truth.py, which shards one logical KV tensor
by rule 1 written independently of the planner; bytes outside the range must stay untouched.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, TokenGap, TokenRange, build_plan, check_registration
from tests.executor import Request, execute
from tests.truth import Truth, assert_exact, background
from tests.world import Side, ViewClass, admitted, instance

EXAMPLES = int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000"))


def world_settings(examples: int) -> settings:
    """A ground-truth property over generated worlds: no deadline (one example registers, admits
    and plans a whole deployment), and its large, slow draws are the point, not a health issue."""
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


HEAD_TOTALS = [1, 2, 3, 4, 6, 8, 12, 16]
BLOCK_TOKENS = [1, 2, 3, 4, 6, 8]
MAX_PROMPT = 16


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
        num_slots=-(-MAX_PROMPT // tokens) + 1,
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
    tokens = draw(st.sampled_from(BLOCK_TOKENS))
    gen_tokens = draw(st.one_of(st.just(tokens), st.sampled_from(BLOCK_TOKENS)))
    cls = draw(classes(draft_layers))
    return (
        cls,
        draw(side("context", cls, layers, draft_layers, tokens)),
        draw(side("generation", cls, layers, draft_layers, gen_tokens)),
    )


@dataclass(frozen=True)
class Lists:
    """One side's block list: slot ids, the first token it holds, and whether to name it."""

    blocks: list[int]
    first: int
    named: bool  # False: kvroute derives ``first`` by upstream's suffix rule

    def placement(self, tokens: int) -> dict[int, int]:
        start = self.first // tokens * tokens
        return {block: start + i * tokens for i, block in enumerate(self.blocks)}

    def positions(self, tokens: int) -> set[int]:
        return {
            p
            for s in self.placement(tokens).values()
            for p in range(s, s + tokens)
            if p >= self.first
        }


@st.composite
def block_list(draw: st.DrawFn, tokens: int, span: TokenRange, slots: int) -> Lists:
    """A list covering ``span``: suffix-shaped, or named by a first token at or before the start."""
    end_block = -(-span.end // tokens)
    if draw(st.booleans()):
        first, named = draw(st.integers(0, span.start // tokens)) * tokens, False
    else:
        first, named = draw(st.integers(0, span.start)), True
        end_block += draw(st.integers(0, 1))
    count = end_block - first // tokens
    return Lists(draw(st.permutations(range(slots)))[:count], first, named)


def shortened(lists: Lists, tokens: int, drop_first: bool) -> Lists:
    """The list less one block; a suffix list then starts one block later (upstream's rule)."""
    if lists.named and drop_first:
        return Lists(lists.blocks[1:], (lists.first // tokens + 1) * tokens, True)
    first = lists.first if lists.named else lists.first + tokens
    return Lists(lists.blocks[:-1], first, lists.named)


@st.composite
def transfers(
    draw: st.DrawFn, ctx: Side, gen: Side, *, gaps: bool = True
) -> tuple[TokenRange | None, Lists, Lists]:
    """A token range with lists on both sides (with ``gaps``, now and then a list a block short),
    or (equal sizes) whole block pairs (range None)."""
    if ctx.tokens_per_block == gen.tokens_per_block and draw(st.booleans()):
        count = draw(st.integers(1, 3))
        src = draw(st.permutations(range(ctx.num_slots)))[:count]
        dst = draw(st.permutations(range(gen.num_slots)))[:count]
        return None, Lists(src, 0, True), Lists(dst, 0, True)
    start = draw(st.integers(0, MAX_PROMPT - 1))
    span = TokenRange(start, draw(st.integers(start + 1, MAX_PROMPT)))
    src = draw(block_list(ctx.tokens_per_block, span, ctx.num_slots))
    dst = draw(block_list(gen.tokens_per_block, span, gen.num_slots))
    if gaps and draw(st.integers(0, 9)) == 0:  # one list a block short: the range may have a gap
        drop_first = draw(st.booleans())
        if draw(st.booleans()) and len(src.blocks) > 1:
            src = shortened(src, ctx.tokens_per_block, drop_first)
        elif len(dst.blocks) > 1:
            dst = shortened(dst, gen.tokens_per_block, drop_first)
    return span, src, dst


def expected_gap(span: TokenRange, src: set[int], dst: set[int]) -> tuple[str, int] | None:
    """The first position of the range a side does not hold, by brute force over positions."""
    for position in range(span.start, span.end):
        if position not in src:
            return "src_blocks", position
        if position not in dst:
            return "dst_blocks", position
    return None


def sender_groups(ctx: Side) -> st.SearchStrategy[int]:
    """The attention-DP group of the senders a receiver reads from (0 without attention DP)."""
    return st.integers(0, ctx.dp_size - 1) if ctx.attention_dp else st.just(0)


@pytest.mark.slow
@world_settings(EXAMPLES)
@given(world=worlds(), data=st.data())
def test_every_destination_byte_written_once_with_the_right_content(world, data) -> None:
    assert_plans_exact(world, data)


def assert_plans_exact(
    world: tuple[list[ViewClass], Side, Side],
    data: st.DataObject,
    *,
    recut: frozenset[int] = frozenset(),
    group: int = 1,
) -> None:
    """Admits both instances, then executes every receiver rank's plan on bytes against the truth.

    ``recut``: views (classes) whose sides place tokens differently inside equal blocks (their
    pairs state a period); ``group``: tokens packed in groups this size, so a range moves whole groups."""
    cls, ctx_side, gen_side = world
    ctx, ctx_layouts, gen, gen_layouts = admitted(cls, ctx_side, gen_side)
    truth = Truth(cls)
    sender_dp = data.draw(sender_groups(ctx_side))
    span, src, dst = data.draw(transfers(ctx_side, gen_side))
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    gap = span and expected_gap(span, src.positions(ts), dst.positions(td))
    sender_pools = {
        r: truth.place(ctx_side, ctx_layouts[r], r, src.placement(ts)) for r in range(len(ctx))
    }
    firsts = (src.first if src.named else None, dst.first if dst.named else None)
    request = Request(src.blocks, dst.blocks, span, firsts if span else (None, None))
    periodic = ts != td
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        built = build_plan(ctx, receiver, sender_dp_rank=sender_dp)
        plan = built.to_json()
        # Equal block sizes keep today's block fragments; different ones state a period instead.
        views = [view for peer in plan["peers"] for view in peer["views"]]
        for v in views:
            recuts = periodic or v["dst_view"] in recut
            assert ("fragments" in v, "period_fragments" in v) == (not recuts, recuts)
        if span is not None and not periodic:
            plan = built.to_json(period=True)
        assert all(ctx[p["rank"]].group == sender_dp for p in plan["peers"])
        assert plan["expected_writers"] == sum(p["sends"] for p in plan["peers"])
        run = partial(execute, plan, sender_pools, dict(enumerate(ctx_layouts)), layout, request)
        if gap:
            with pytest.raises(TokenGap) as missing:
                run()
            assert (missing.value.field, missing.value.token) == gap
            continue
        before = background(layout)
        out, writes = run(into=before)
        positions = (
            range(span.start - span.start % group, -(-span.end // group) * group) if span else None
        )
        expected = truth.place(
            gen_side, layout, receiver.rank, dst.placement(td), positions, before
        )
        assert_exact(out, writes, expected, before)


MUTATIONS = [
    "draft_layers",
    "head_dim",
    "dtype",
    "unit",
    "kind",
    "roles",
    "total_heads",
]


@pytest.mark.slow
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
