"""Property test: context parallelism on either side or both, executed on bytes.

Hypothesis draws the worlds of ``test_plan_ground_truth`` (TP ratios, PP splits, attention DP, head
replication, HND/NHD/replicated and draft views, different block sizes) and adds context parallelism
to each side: 1-4 CP ranks dealt prompt tokens round robin by an interleave that divides the block
size or is a multiple of it. Each CP rank's pools hold its own tokens at its own local positions
(``tests/world.Side.prompt_position``, written out again there), the CP ranks of a side share one
list of local blocks, and a token range is moved to every receiver rank. Where a list lacks a token
some rank needs, the plan must refuse with a gap naming a token that is really missing; otherwise
every receiver byte of the range is written once with the right content and nothing else is touched.
Hybrid worlds (``test_plan_ground_truth_hybrid``'s, without sliding windows, which CP refuses) add
recurrent state split over TP x CP, moved once per job from the CP ranks holding each share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

from kvroute.geometry import TokenGap, TokenRange, build_plan
from tests.executor import Request, execute
from tests.truth import Truth, assert_exact, background, window_starts
from tests.unit.test_plan_ground_truth import (
    BLOCK_TOKENS,
    classes,
    sender_groups,
    side,
    world_settings,
)
from tests.unit.test_plan_ground_truth_hybrid import REQUEST, _state_slot, hybrid_worlds
from tests.world import Side, ViewClass, admitted

EXAMPLES = int(os.environ.get("KVROUTE_CP_PROPERTY_EXAMPLES", "120"))
MAX_PROMPT = 24
CHUNKED = ("contiguous", "zigzag")


def interleaves(tokens: int) -> list[int]:
    """Interleaves that divide the block size or are a multiple of it."""
    return sorted({*(d for d in range(1, tokens + 1) if tokens % d == 0), 2 * tokens})


@st.composite
def cp_side(draw: st.DrawFn, base: Side, force: bool) -> Side:
    """CP on a side; a context side may split prompts in prefill chunks instead of dealing them
    (its prompt length is drawn with the job: ``with_prompt``)."""
    limit = max(1, 32 // base.ranks)
    cp = draw(st.integers(2 if force else 1, max(2 if force else 1, min(4, limit))))
    local_blocks = -(-MAX_PROMPT // base.tokens_per_block)
    layouts = ["interleaved", *CHUNKED] if base.role == "context" and cp > 1 else ["interleaved"]
    return replace(
        base,
        cp_size=cp,
        cp_interleave=draw(st.sampled_from(interleaves(base.tokens_per_block))),
        cp_layout=draw(st.sampled_from(layouts)),
        num_slots=local_blocks + 2,
    )


def with_prompt(draw: st.DrawFn, side: Side, span: TokenRange) -> tuple[Side, int | None]:
    """The side with the job's prompt length (at or past the range's end) where its chunks need
    it, and the prompt length the job names (None: the range's end, for dealt tokens)."""
    if not side.chunked and draw(st.booleans()):
        return side, None
    prompt = draw(st.integers(span.end, MAX_PROMPT))
    return replace(side, prompt_tokens=prompt), prompt


@st.composite
def cp_worlds(draw: st.DrawFn) -> tuple[list[ViewClass], Side, Side]:
    layers = draw(st.integers(1, 4))
    draft_layers = draw(st.integers(0, 1))
    tokens = draw(st.sampled_from(BLOCK_TOKENS))
    gen_tokens = draw(st.one_of(st.just(tokens), st.sampled_from(BLOCK_TOKENS)))
    if draw(st.booleans()):  # MLA: one latent row per token, replicated over TP
        cls = [ViewClass(("latent",), "target", "replicated", 1, 1, draw(st.integers(1, 3)))]
        draft_layers = 0
    else:
        cls = draw(classes(draft_layers))
    ctx = draw(side("context", cls, layers, draft_layers, tokens))
    gen = draw(side("generation", cls, layers, draft_layers, gen_tokens))
    which = draw(st.sampled_from(["context", "generation", "both"]))
    ctx = draw(cp_side(ctx, which != "generation"))
    gen = draw(cp_side(gen, which != "context"))
    return cls, ctx, gen


class Placement:
    """Where each prompt position lives on one side, by brute force over the CP ranks' deals (or
    chunks: then the prompt's positions only)."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.owner: dict[int, tuple[int, int]] = {}  # position -> (cp rank, local position)
        for cp_rank in range(side.cp_size):
            for local in range(4 * MAX_PROMPT):
                position = side.prompt_position(cp_rank, local)
                if not side.chunked or position < side.prompt_tokens:
                    self.owner[position] = (cp_rank, local)

    def held(self, cp_rank: int, span: TokenRange) -> list[int]:
        return [t for t in range(span.start, span.end) if self.owner[t][0] == cp_rank]

    def count(self, cp_rank: int, end: int) -> int:
        return sum(1 for t in range(end) if self.owner[t][0] == cp_rank)

    def first_needed(self, first: int) -> int:
        """The earliest local position any CP rank holds a position from ``first`` on at."""
        return min(local for t, (_, local) in self.owner.items() if t >= first)


@dataclass(frozen=True)
class Lists:
    """One side's shared list of local blocks: slot ids, the first local block, its first token
    (named, or derived by the suffix rule)."""

    blocks: list[int]
    first_block: int
    first: int | None  # the first token named; None: upstream's suffix rule

    def placement(self, tokens: int) -> dict[int, int]:
        return {b: (self.first_block + i) * tokens for i, b in enumerate(self.blocks)}


@st.composite
def cp_list(
    draw: st.DrawFn,
    where: Placement,
    span: TokenRange,
    slots: int | None = None,
    whole: bool = False,
) -> Lists:
    """A list that holds every token of the span on its owner, but for a suffix list that may
    start too late (a chunk of another CP rank sits before its first block) unless ``whole``."""
    side, tokens = where.side, where.side.tokens_per_block
    locals_ = [where.owner[t][1] for t in range(span.start, span.end)]
    need_lo, need_hi = min(locals_) // tokens, max(locals_) // tokens + 1
    if draw(st.booleans()):
        # Suffix rule: the list ends with the last block the CP rank holding most needs.
        most = max(where.count(c, span.end) for c in range(side.cp_size))
        last = -(-most // tokens)
        # The list's first token follows every token at an earlier local position on any CP
        # rank, so only a start at or before the earliest position holding the span covers it.
        latest = where.first_needed(span.start) // tokens if whole else need_lo
        first_block = draw(st.integers(0, latest))
        first = None
    else:
        first = draw(st.integers(0, span.start))
        # A named first token starts the list at the earliest block any CP rank needs from it on.
        first_block = where.first_needed(first) // tokens
        last = max(need_hi, first_block + 1) + draw(st.integers(0, 1))
    ids = draw(st.permutations(range(side.num_slots if slots is None else slots)))
    return Lists(ids[: last - first_block], first_block, first)


def covered(where: Placement, lists: Lists, token: int) -> bool:
    """The list holds ``token`` on its owner: in a listed local block, and not before the list's
    first token (named, or the first from which every CP rank's tokens lie in listed blocks)."""
    tokens = where.side.tokens_per_block
    _, local = where.owner[token]
    start = lists.first
    if start is None:
        low = lists.first_block * tokens
        earlier = [t for t, (_, at) in where.owner.items() if at < low]
        start = max(earlier) + 1 if earlier else 0
    end = (lists.first_block + len(lists.blocks)) * tokens
    return token >= start and lists.first_block * tokens <= local < end


def drawn_job(data: st.DataObject, ctx: Side) -> tuple[int, TokenRange, Side, int | None]:
    """A job's sender DP group, token range and prompt length, and the context side holding the
    prompt its chunks need (``with_prompt``)."""
    sender_dp = data.draw(sender_groups(ctx))
    start = data.draw(st.integers(0, MAX_PROMPT - 1))
    span = TokenRange(start, data.draw(st.integers(start + 1, MAX_PROMPT)))
    ctx, prompt = with_prompt(data.draw, ctx, span)
    event(f"context {ctx.cp_layout}")
    return sender_dp, span, ctx, prompt


def missing(where: Placement, lists: Lists, span: TokenRange, cp_ranks: range) -> set[int]:
    return {
        t
        for t in range(span.start, span.end)
        if where.owner[t][0] in cp_ranks and not covered(where, lists, t)
    }


@pytest.mark.slow
@world_settings(EXAMPLES)
@given(world=cp_worlds(), data=st.data())
def test_cp_plans_write_every_token_once_on_the_rank_holding_it(world, data) -> None:
    cls, ctx_side, gen_side = world
    event(f"cp {ctx_side.cp_size} -> {gen_side.cp_size}")
    ctx, ctx_layouts, gen, gen_layouts = admitted(cls, ctx_side, gen_side)
    truth = Truth(cls)
    sender_dp, span, ctx_side, prompt = drawn_job(data, ctx_side)
    senders, receivers = Placement(ctx_side), Placement(gen_side)
    src = data.draw(cp_list(senders, span))
    dst = data.draw(cp_list(receivers, span))
    if data.draw(st.integers(0, 7)) == 0:  # a list a block short: the range may have a gap
        short = data.draw(st.sampled_from(["src", "dst"]))
        lists = src if short == "src" else dst
        if len(lists.blocks) > 1:
            # A suffix list stays anchored at its end, so it then starts a block later.
            shortened = (
                replace(lists, blocks=lists.blocks[:-1])
                if lists.first is not None
                else replace(lists, blocks=lists.blocks[1:], first_block=lists.first_block + 1)
            )
            src, dst = (shortened, dst) if short == "src" else (src, shortened)
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    sender_pools = {
        r: truth.place(ctx_side, ctx_layouts[r], r, src.placement(ts)) for r in range(len(ctx))
    }
    request = Request(src.blocks, dst.blocks, span, (src.first, dst.first), prompt_tokens=prompt)
    src_missing = missing(senders, src, span, range(ctx_side.cp_size))
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        built = build_plan(ctx, receiver, sender_dp_rank=sender_dp, prompt_tokens=prompt)
        plan = built.to_json()
        views = [view for peer in plan["peers"] for view in peer["views"]]
        assert all("period_fragments" in v and "fragments" not in v for v in views)
        assert plan["fanin_bounce_safe"] is False
        assert plan["expected_writers"] == sum(p["sends"] for p in plan["peers"])
        run = partial(execute, plan, sender_pools, dict(enumerate(ctx_layouts)), layout, request)
        cp_rank = receiver.cp_rank
        dst_missing = missing(receivers, dst, span, range(cp_rank, cp_rank + 1))
        if views and (src_missing or dst_missing):
            with pytest.raises(TokenGap) as gap:
                run()
            wanted = src_missing if gap.value.field == "src_blocks" else dst_missing
            assert gap.value.token in wanted, (gap.value.field, gap.value.token, wanted)
            continue
        before = background(layout)
        out, writes = run(into=before)
        positions = range(span.start, span.end)
        expected = truth.place(
            gen_side, layout, receiver.rank, dst.placement(td), positions, before
        )
        assert_exact(out, writes, expected, before)


@st.composite
def hybrid_cp_worlds(draw: st.DrawFn) -> tuple[list[ViewClass], Side, Side]:
    cls, ctx, gen = draw(hybrid_worlds())
    # State is split over TP x CP: the SSM heads and every conv section (a Gated DeltaNet's key
    # sections hold fewer heads than its value section) must divide by it.
    state = [c.total_heads for c in cls if c.kind == "ssm"]
    state += [size for c in cls if c.kind == "conv" for size in c.sections]
    sides = []
    for base in (ctx, gen):
        cps = [
            cp
            for cp in (1, 2, 3, 4)
            if all(size % (base.tp_per_dp * cp) == 0 for size in state) and base.ranks * cp <= 32
        ]
        if sides and sides[0].cp_size == 1 and len(cps) > 1:
            cps = cps[1:]  # CP on at least one side where the state allows it
        cp = draw(st.sampled_from(cps))
        chunked = base.role == "context" and cp > 1
        sides.append(
            replace(
                base,
                cp_size=cp,
                cp_interleave=draw(st.sampled_from(interleaves(base.tokens_per_block))),
                cp_layout=draw(
                    st.sampled_from(["interleaved", *CHUNKED] if chunked else ["interleaved"])
                ),
                num_slots=-(-MAX_PROMPT // base.tokens_per_block) + 2,
            )
        )
    return cls, sides[0], sides[1]


@pytest.mark.slow
@world_settings(max(10, EXAMPLES // 3))
@given(world=hybrid_cp_worlds(), data=st.data())
def test_cp_hybrid_plans_move_tokens_and_state_shares_once(world, data) -> None:
    cls, ctx_side, gen_side = world
    event(f"cp {ctx_side.cp_size} -> {gen_side.cp_size}")
    ctx, ctx_layouts, gen, gen_layouts = admitted(cls, ctx_side, gen_side)
    truth = Truth(cls)
    sender_dp, span, ctx_side, prompt = drawn_job(data, ctx_side)
    # Block lists use every slot but the last, which a state slot sharing their pool takes.
    src = data.draw(cp_list(Placement(ctx_side), span, ctx_side.num_slots - 1, whole=True))
    dst = data.draw(cp_list(Placement(gen_side), span, gen_side.num_slots - 1, whole=True))
    state = (_state_slot(data.draw, ctx_side), _state_slot(data.draw, gen_side))
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    sender_pools = {
        r: truth.place(ctx_side, layout, r, src.placement(ts), states={state[0]: REQUEST})
        for r, layout in enumerate(ctx_layouts)
    }
    request = Request(src.blocks, dst.blocks, span, (src.first, dst.first), [state], prompt)
    starts = window_starts(ctx_side, gen_side, cls, span.end if prompt is None else prompt)
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        built = build_plan(ctx, receiver, sender_dp_rank=sender_dp, prompt_tokens=prompt)
        plan = built.to_json(period=True)
        assert plan["expected_writers"] == sum(p["sends"] for p in plan["peers"])
        before = background(layout)
        out, writes = execute(
            plan, sender_pools, dict(enumerate(ctx_layouts)), layout, request, into=before
        )
        expected = truth.place(
            gen_side, layout, receiver.rank, dst.placement(td), range(span.start, span.end),
            before, starts=starts, states={state[1]: REQUEST},
        )  # fmt: skip
        assert_exact(out, writes, expected, before)


def suffix_start(where: Placement, lists: Lists) -> int:
    """A suffix list's first token: the first position from which every CP rank's positions lie
    at or after its first local block (by brute force over the placement)."""
    low = lists.first_block * where.side.tokens_per_block
    earlier = [t for t, (_, at) in where.owner.items() if at < low]
    return max(earlier) + 1 if earlier else 0


@st.composite
def prompt_list(draw: st.DrawFn, where: Placement, prompt: int) -> Lists:
    """The prompt's last local blocks (upstream's suffix rule): through the last block the CP
    rank holding the most of the prompt needs, a cached prefix of whole blocks left out."""
    side, tokens = where.side, where.side.tokens_per_block
    last = -(-max(where.count(c, prompt) for c in range(side.cp_size)) // tokens)
    first_block = draw(st.integers(0, last - 1))
    ids = draw(st.permutations(range(side.num_slots)))
    return Lists(ids[: last - first_block], first_block, None)


@pytest.mark.slow
@world_settings(max(10, EXAMPLES // 2))
@given(world=cp_worlds(), data=st.data())
def test_cp_prompt_only_jobs_move_the_tokens_both_lists_hold_up_to_the_prompt(world, data) -> None:
    """Issue 35: a job naming only the prompt length and suffix lists stops at the prompt's last
    token under context parallelism too (it ran on to a multiple of the block size, past the
    prompt, while tokens both lists held after that were left out)."""
    cls, ctx_side, gen_side = world
    prompt = data.draw(st.integers(1, MAX_PROMPT))
    ctx_side = replace(ctx_side, prompt_tokens=prompt) if ctx_side.chunked else ctx_side
    ctx, ctx_layouts, gen, gen_layouts = admitted(cls, ctx_side, gen_side)
    truth = Truth(cls)
    sender_dp = data.draw(sender_groups(ctx_side))
    senders, receivers = Placement(ctx_side), Placement(gen_side)
    src, dst = data.draw(prompt_list(senders, prompt)), data.draw(prompt_list(receivers, prompt))
    start = max(suffix_start(senders, src), suffix_start(receivers, dst))
    assume(start < prompt)  # lists sharing no prompt token are refused by name (tests/transfer)
    ts, td = ctx_side.tokens_per_block, gen_side.tokens_per_block
    sender_pools = {
        r: truth.place(ctx_side, ctx_layouts[r], r, src.placement(ts)) for r in range(len(ctx))
    }
    request = Request(src.blocks, dst.blocks, prompt_tokens=prompt)
    for receiver, layout in zip(gen, gen_layouts, strict=True):
        built = build_plan(ctx, receiver, sender_dp_rank=sender_dp, prompt_tokens=prompt)
        plan = built.to_json()
        before = background(layout)
        out, writes = execute(
            plan, sender_pools, dict(enumerate(ctx_layouts)), layout, request, into=before
        )
        expected = truth.place(
            gen_side, layout, receiver.rank, dst.placement(td), range(start, prompt), before
        )
        assert_exact(out, writes, expected, before)
