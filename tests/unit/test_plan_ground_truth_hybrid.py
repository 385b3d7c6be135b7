"""Property test for hybrid models: every plan, executed on bytes, writes each destination byte of the
request's KV tokens (within the window) and of its state slot exactly once, with the right content.

Hypothesis draws hybrid deployments: recurrent layers (SSM heads with the conv sections of Mamba2
[x | B | C], Gated DeltaNet [q | k | v], Kimi Delta Attention or none (lightning), optionally
replicated per-request state) beside full and sliding-window attention layers, one layer id possibly
in both, target + draft, TP 1..16 on each side (different mamba TP, non-integer ratios), attention DP,
uneven PP, state in its own pool or sharing the KV pool's slots, windows that differ per side, and
independent tokens per block on the two sides. Each request moves either block lists that are a
suffix of the prompt's blocks with its prompt length (issue 12's jobs: the tokens both hold, up to
the prompt's last token), or a random token range (starting and ending mid-block on either side) with a prompt length at or past
its end or none. tests/truth.py computes the expected bytes and the window from first principles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, TokenRange, build_plan, check_registration
from tests.executor import Request, execute
from tests.truth import Truth, assert_exact, background, window_starts
from tests.unit.test_plan_ground_truth import (
    BLOCK_TOKENS,
    HEAD_TOTALS,
    MAX_PROMPT,
    Lists,
    sender_groups,
    splits,
    transfers,
    world_settings,
)
from tests.world import Layout, Side, ViewClass, admitted, instance

EXAMPLES = int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000")) // 5
REQUEST = 5  # the request whose state the state slots hold


@st.composite
def conv_sections(draw: st.DrawFn, ssm_heads: int) -> tuple[int, ...]:
    """The conv state's sections (model bytes) of one recurrent family: Mamba2's [x | B | C],
    Gated DeltaNet's [q | k | v] (fewer key heads than value heads), Kimi Delta Attention's three
    equal ones, or none (MiniMax lightning attention keeps only its recurrent state)."""
    family = draw(st.sampled_from(["mamba2", "gdn", "kda", "lightning"]))
    if family == "mamba2":
        x, bc = draw(st.integers(1, 3)), draw(st.integers(1, 2))
        return (x * ssm_heads, bc * ssm_heads, bc * ssm_heads)
    if family == "gdn":
        key_heads = draw(
            st.sampled_from([g for g in range(1, ssm_heads + 1) if ssm_heads % g == 0])
        )
        key, value = draw(st.integers(1, 2)), draw(st.integers(1, 3))
        return (key * key_heads, key * key_heads, value * ssm_heads)
    if family == "kda":
        return (draw(st.integers(1, 2)) * ssm_heads,) * 3
    return ()


@st.composite
def hybrid_classes(draw: st.DrawFn, layers: int, draft_layers: int) -> list[ViewClass]:
    attention = draw(st.sets(st.integers(0, layers - 1), min_size=1, max_size=layers - 1))
    mamba = set(range(layers)) - attention
    if draw(st.booleans()):  # one global layer id with both attention KV and recurrent state
        mamba.add(min(attention))
    windowed = {layer for layer in attention if draw(st.booleans())}
    kv_kind = draw(st.sampled_from(["hnd", "nhd"]))
    heads = draw(st.sampled_from(HEAD_TOTALS))
    ssm_heads = draw(st.sampled_from([2, 4, 8, 12, 16]))
    result = [
        ViewClass(("ssm",), "target", "ssm", ssm_heads, 1, draw(st.integers(1, 3)),
                  layers=frozenset(mamba)),
    ]  # fmt: skip
    sections = draw(conv_sections(ssm_heads))
    if sections:
        result.append(
            ViewClass(("conv",), "target", "conv", 1, 1, 1, layers=frozenset(mamba),
                      sections=sections)
        )  # fmt: skip
    if attention - windowed:
        result.append(
            ViewClass(("key", "value"), "target", kv_kind, heads, 2, draw(st.integers(1, 3)),
                      layers=frozenset(attention - windowed))
        )  # fmt: skip
    if windowed:
        result.append(
            ViewClass(("key", "value"), "target", kv_kind, heads, 2, draw(st.integers(1, 2)),
                      layers=frozenset(windowed), window=draw(st.integers(1, 12)))
        )  # fmt: skip
    if draw(st.booleans()):
        result.append(
            ViewClass(("side_state",), "target", "replicated", 1, 1, draw(st.integers(1, 3)),
                      layers=frozenset(mamba), per_request=True)
        )  # fmt: skip
    if draft_layers:
        result.append(
            ViewClass(("key", "value"), "draft", "hnd", draw(st.sampled_from([1, 2])), 2, 1)
        )
    return result


def _tp_choices(classes: list[ViewClass]) -> list[int]:
    totals = [c.total_heads for c in classes if c.kind in ("hnd", "nhd")]
    state = [c.total_heads for c in classes if c.kind == "ssm"]
    state += [size for c in classes if c.kind == "conv" for size in c.sections]
    return [
        t
        for t in range(1, 17)
        if all(h % t == 0 or t % h == 0 for h in totals) and all(h % t == 0 for h in state)
    ]


@st.composite
def hybrid_side(
    draw: st.DrawFn, role: str, cls: list[ViewClass], layers: int, draft_layers: int, tokens: int
) -> Side:
    tp_per_dp = draw(st.sampled_from(_tp_choices(cls)))
    dp = draw(st.sampled_from([d for d in (1, 2, 4) if tp_per_dp * d <= 16]))
    pp = draw(st.integers(1, min(4, layers, max(1, 32 // (tp_per_dp * dp)))))
    return Side(
        role=role,
        tp_size=tp_per_dp * dp,
        layers_per_stage=draw(splits(layers, pp)),
        dp_size=dp,
        attention_dp=dp > 1,
        declare_totals=draw(st.booleans()),
        tokens_per_block=tokens,
        # Block lists use every slot but the last, which a state slot sharing their pool takes.
        num_slots=-(-MAX_PROMPT // tokens) + 2,
        num_draft_layers=draft_layers,
        shared_pool=draw(st.booleans()),
        shared_state_pool=draw(st.booleans()),
        draft_stage=draw(st.sampled_from([-1, 0])),
        seed=draw(st.integers(0, 10**6)),
    )


@st.composite
def hybrid_worlds(draw: st.DrawFn) -> tuple[list[ViewClass], Side, Side]:
    layers = draw(st.integers(2, 6))
    draft_layers = draw(st.integers(0, 1))
    tokens = draw(st.sampled_from(BLOCK_TOKENS))
    gen_tokens = draw(st.one_of(st.just(tokens), st.sampled_from(BLOCK_TOKENS)))
    cls = draw(hybrid_classes(layers, draft_layers))
    ctx = draw(hybrid_side("context", cls, layers, draft_layers, tokens))
    gen = draw(hybrid_side("generation", cls, layers, draft_layers, gen_tokens))
    windowed = [c for c, v in enumerate(cls) if v.window is not None]
    if windowed:
        # Either side may have the larger window; a full-attention sender serves any receiver.
        (c,) = windowed
        ctx_window = draw(st.sampled_from([None, *range(1, 13)]))
        ctx = replace(ctx, windows=((c, ctx_window),))
        gen = replace(gen, windows=((c, draw(st.integers(1, 12))),))
    return cls, ctx, gen


@dataclass(frozen=True)
class Job:
    """One request: its token range (None: issue 12's paired suffix lists), the lists, the
    prompt length (None: the range's end) and the state slot pair."""

    span: TokenRange | None
    src: Lists
    dst: Lists
    prompt: int | None
    state: tuple[int, int]

    def request(self) -> Request:
        firsts = (
            self.src.first if self.src.named else None,
            self.dst.first if self.dst.named else None,
        )
        return Request(
            self.src.blocks,
            self.dst.blocks,
            self.span,
            firsts if self.span else (None, None),
            [self.state],
            self.prompt,
        )


def _state_slot(draw: st.DrawFn, side: Side) -> int:
    last = side.num_slots - 1
    return last if side.shared_state_pool else draw(st.integers(0, last))


@st.composite
def _suffix_list(draw: st.DrawFn, side: Side, prompt: int) -> Lists:
    """The prompt's last 1-3 blocks of a side (a cached prefix left out), by the suffix rule."""
    tokens = side.tokens_per_block
    blocks = -(-prompt // tokens)
    count = draw(st.integers(1, min(3, blocks)))
    ids = draw(st.permutations(range(side.num_slots - 1)))[:count]
    return Lists(ids, (blocks - count) * tokens, False)


@st.composite
def jobs(draw: st.DrawFn, ctx: Side, gen: Side) -> Job:
    """Issue 12's jobs (each list the prompt's last blocks, of any length, with the prompt length;
    any block sizes) or a token range with lists covering it and a prompt length at or past its
    end."""
    state = (_state_slot(draw, ctx), _state_slot(draw, gen))
    if draw(st.booleans()):
        prompt = draw(st.integers(1, MAX_PROMPT))
        src, dst = (draw(_suffix_list(side, prompt)) for side in (ctx, gen))
        return Job(None, src, dst, prompt, state)
    lists = (replace(side, num_slots=side.num_slots - 1) for side in (ctx, gen))
    span, src, dst = draw(transfers(*lists, gaps=False))
    if span is None:  # whole block pairs from token 0: name the range they hold
        span = TokenRange(0, len(dst.blocks) * gen.tokens_per_block)
        src, dst = replace(src, named=False), replace(dst, named=False)
    prompt = draw(st.one_of(st.none(), st.integers(span.end, span.end + 4)))
    return Job(span, src, dst, prompt, state)


@pytest.mark.slow
@world_settings(EXAMPLES)
@given(world=hybrid_worlds(), data=st.data())
def test_hybrid_plans_write_the_window_s_tokens_and_state_once(world, data) -> None:
    cls, ctx_side, gen_side = world
    ctx, ctx_layouts, gen, gen_layouts = admitted(cls, ctx_side, gen_side)
    truth = Truth(cls)
    sender_dp = data.draw(sender_groups(ctx_side))
    job = data.draw(jobs(ctx_side, gen_side))
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    sender_pools = {
        r: truth.place(ctx_side, layout, r, job.src.placement(ts), states={job.state[0]: REQUEST})
        for r, layout in enumerate(ctx_layouts)
    }
    prompt = job.prompt if job.prompt is not None else job.span.end  # type: ignore[union-attr]
    starts = window_starts(ctx_side, gen_side, cls, prompt)
    # A prompt-only job moves the tokens both lists hold up to the prompt's last token, never
    # past it (issue 35), windowed views or not, whatever the block sizes.
    positions = (
        range(job.span.start, job.span.end)
        if job.span
        else range(max(job.src.first, job.dst.first), prompt)
    )
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        built = build_plan(ctx, receiver, sender_dp_rank=sender_dp)
        plan = built.to_json(period=True)
        before = background(layout)
        out, writes = execute(
            plan, sender_pools, dict(enumerate(ctx_layouts)), layout, job.request(), into=before
        )
        expected = truth.place(
            gen_side, layout, receiver.rank, job.dst.placement(td), positions, before,
            starts=starts, states={job.state[1]: REQUEST},
        )  # fmt: skip
        assert_exact(out, writes, expected, before)
        _check_accounting(plan, truth, gen_side, layout, receiver.rank)


def _check_accounting(plan: dict, truth: Truth, gen_side: Side, layout: Layout, rank: int) -> None:
    """Writers, the recurrent bounce payload and the bounce gate agree with the bytes."""
    assert plan["expected_writers"] == sum(p["sends"] for p in plan["peers"])
    state_only = truth.place(gen_side, layout, rank, {}, states={0: REQUEST})
    state_bytes = sum(int((ids != 0).sum()) for ids in state_only.values())
    assert plan.get("state_bytes", 0) == state_bytes
    if state_bytes and plan["expected_writers"] > 1:
        assert plan["fanin_bounce_safe"] is False


MUTATIONS = ["draft_first", "ssm_head", "ssm_heads", "conv_count", "conv_size", "window", "missing"]


@pytest.mark.slow
@settings(
    max_examples=max(50, EXAMPLES // 4), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(world=hybrid_worlds(), mutation=st.sampled_from(MUTATIONS))
def test_incompatible_hybrid_pairs_are_refused_with_their_code(world, mutation) -> None:
    cls, ctx_side, gen_side = world
    mutated = _mutate(mutation, cls, ctx_side, gen_side)
    if mutated is None:
        return
    gen_cls, ctx_side, gen_side, code, mutated_class = mutated
    ctx, _ = instance(ctx_side, cls, "ctx")
    gen, _ = instance(gen_side, gen_cls, "gen")
    # A rank whose stage holds the mutated class's layers (view ids are class indices).
    candidate = next(
        g for g in gen if mutated_class is None or mutated_class in [v.view_id for v in g.views]
    )
    with pytest.raises(GeometryError) as refused:
        check_registration(candidate, [], ctx)
    assert refused.value.code == code, f"{mutation}: {refused.value.code}: {refused.value.detail}"
    assert (refused.value.stage, refused.value.peer_instance) == ("peer", "ctx")


def _mutate(mutation: str, cls: list[ViewClass], ctx: Side, gen: Side):
    """(generation classes, context side, generation side, expected code, mutated class) or None."""
    gen_cls = list(cls)
    ssm, conv = cls[0], cls[1]
    if conv.kind != "conv" and mutation in ("conv_count", "conv_size"):
        return None  # lightning attention: no conv state to break
    if mutation == "draft_first":
        # State geometry broken too: the draft-layer count must still be what is reported.
        gen_cls[0] = replace(ssm, unit=ssm.unit + 1)
        gen = replace(gen, num_draft_layers=gen.num_draft_layers + 1)
        return gen_cls, ctx, gen, "draft_layers_mismatch", None
    if mutation == "ssm_head":
        gen_cls[0] = replace(ssm, unit=ssm.unit + 1)
        return gen_cls, ctx, gen, "ssm_bytes_per_head_mismatch", 0
    if mutation == "ssm_heads" and ssm.total_heads * 2 % gen.tp_per_dp == 0:
        gen_cls[0] = replace(ssm, total_heads=ssm.total_heads * 2)
        return gen_cls, ctx, gen, "state_bytes_mismatch", 0
    if mutation == "conv_count":
        gen_cls[1] = replace(conv, sections=conv.sections[:2])
        return gen_cls, ctx, gen, "conv_sections_count_mismatch", 1
    if mutation == "conv_size":
        gen_cls[1] = replace(
            conv, sections=(conv.sections[0] + ssm.total_heads, *conv.sections[1:])
        )
        return gen_cls, ctx, gen, "conv_section_mismatch", 1
    windowed = [c for c, v in enumerate(cls) if v.window is not None]
    if mutation == "window" and windowed:
        (c,) = windowed
        ctx, gen = replace(ctx, windows=((c, 4),)), replace(gen, windows=((c, None),))
        return gen_cls, ctx, gen, "sliding_window_mismatch", c
    if mutation == "missing":
        gen_cls[0] = replace(ssm, roles=("ssm_state",))
        return gen_cls, ctx, gen, "view_missing", 0
    return None
