"""Property tests for hybrid models: digests and the canary over sliding windows and recurrent state.

Hypothesis draws tests/unit/test_plan_ground_truth_hybrid.py's hybrid deployments (SSM heads, conv
sections of Mamba2 / Gated DeltaNet / KDA, replicated per-request state, full and windowed
attention, windows that differ per side, independent TP/PP/attention-DP, block sizes and pools on
each side). Each side's pools are filled from tests/truth.py's logical tensor: the producer holds
its own window of a prompt (``window_starts`` of the side with itself), the consumer what the pair
moves (``window_starts`` of the pair), garbage before, and both the request's state in one slot.
Neither side is laid out or windowed by kvroute's code.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.client.integrity import (
    canary_tokens,
    check_canary,
    reserved_blocks,
    reserved_state_slot,
    write_canary,
)
from kvroute.client.kv_digest import Grid, KvDigest, Mismatch, kv_digest
from kvroute.client.kv_rows import (
    REPLICATED_HEAD,
    RequestKv,
    RowKey,
    covered_views,
    read_rows,
    window_firsts,
)
from kvroute.client.kv_state import StateKey, place_state, read_state
from kvroute.geometry import TokenRange, build_plan
from tests.executor import Request, execute
from tests.truth import Truth, background, window_starts
from tests.unit.test_kv_digest import as_bytes
from tests.unit.test_plan_ground_truth import MAX_PROMPT
from tests.unit.test_plan_ground_truth_hybrid import REQUEST, hybrid_worlds
from tests.world import Side, ViewClass, admitted, per_rank_heads

World = tuple[list[ViewClass], Side, Side]
RADIX = 96  # docs/integrity.md: a conv section of S bytes is compared in gcd(S, 96) parts


class Held:
    """One side's ranks holding a ``prompt``-token request in shuffled blocks (each windowed class
    from ``starts`` on, garbage before) and its state in the last slot: logical ids and bytes."""

    def __init__(
        self,
        side: Side,
        regs: list,
        layouts: list,
        classes: list[ViewClass],
        seed: int,
        prompt: int,
    ) -> None:
        self.regs, self.layouts, self.side = regs, layouts, side
        rng = np.random.default_rng(seed)
        tpb = side.tokens_per_block
        count = -(-MAX_PROMPT // tpb)
        self.slot = side.num_slots - 1
        self.blocks = [list(rng.permutation(self.slot)[:count]) for _ in regs]
        self.truth = Truth(classes)
        self.starts: dict[int, int] = {}
        self.ids: list[dict[int, np.ndarray]] = []
        self.pools: list[dict[int, np.ndarray]] = []
        self.prompt = prompt

    def fill(self, starts: dict[int, int]) -> Held:
        self.starts = starts
        tpb = self.side.tokens_per_block
        for rank, (layout, blocks) in enumerate(zip(self.layouts, self.blocks, strict=True)):
            placement = {block: i * tpb for i, block in enumerate(blocks)}
            ids = self.truth.place(
                self.side, layout, rank, placement, range(0, self.prompt), background(layout),
                starts=starts, states={self.slot: REQUEST},
            )  # fmt: skip
            self.ids.append(ids)
            self.pools.append({p: as_bytes(a) for p, a in ids.items()})
        return self

    def digest(
        self,
        rank: int,
        chunk: int,
        peers: list | None = None,
        sent: KvDigest | None = None,
        grid: Grid | None = None,
    ) -> KvDigest:
        """The rank's digests: a producer's on ``grid``, a consumer's (``peers``) on the grid of
        the producer's (``sent``)."""
        reg = self.regs[rank]
        firsts = window_firsts(reg, self.prompt, peers or [])
        gridded = None
        if sent is not None:
            grid, gridded = sent.grid, sent.gridded
        kv = RequestKv(
            reg, self.pools[rank], self.blocks[rank], range(self.prompt), firsts, self.slot
        )
        return kv_digest(kv, chunk, grid=grid, gridded=gridded)

    def merged(self, chunk: int, grid: Grid | None = None) -> KvDigest:
        merged = KvDigest((0, self.prompt), chunk, grid=grid)
        for rank in range(len(self.regs)):
            merged.merge(self.digest(rank, chunk, grid=grid))
        return merged


def _sides(world: World, prompt: int) -> tuple[Held, Held]:
    classes, ctx, gen = world
    senders, sender_layouts, receivers, receiver_layouts = admitted(classes, ctx, gen)
    producer = Held(ctx, senders, sender_layouts, classes, 1, prompt)
    consumer = Held(gen, receivers, receiver_layouts, classes, 2, prompt)
    producer.fill(window_starts(ctx, ctx, classes, prompt))
    consumer.fill(window_starts(ctx, gen, classes, prompt))
    return producer, consumer


def _ambiguous(side: Side, cls: ViewClass) -> bool:
    """A sharded class whose ranks hold one head each, replicated over TP, without a declared
    total: its global head is ambiguous (docs/integrity.md)."""
    return (
        cls.kind in ("hnd", "nhd")
        and side.tp_per_dp > 1
        and not side.declare_totals
        and per_rank_heads(cls, side) == 1
    )


def _expected_first(held: Held, c: int) -> int:
    start = held.starts[c]
    return held.prompt if start >= held.prompt else start


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=hybrid_worlds(), data=st.data())
def test_windows_and_state_digest_alike_and_a_flipped_byte_is_named(
    world: World, data: st.DataObject
) -> None:
    prompt = data.draw(st.integers(1, MAX_PROMPT), label="prompt")
    chunk = data.draw(st.sampled_from([1, 3, 256]), label="chunk")
    producer, consumer = _sides(world, prompt)
    # The windows' first tokens are the geometry's own, and agree with the truth's rule.
    for held, peers in ((producer, []), (consumer, producer.regs)):
        for reg in held.regs:
            firsts = window_firsts(reg, prompt, peers)
            covered = {v.view_id for v in covered_views(reg)}
            want = {c: _expected_first(held, c) for c in covered if c in held.starts}
            if peers:  # what the producer cannot name the heads of is compared nowhere
                want.update({c: prompt for c in covered if _ambiguous(producer.side, world[0][c])})
            assert firsts == want
    sent = producer.merged(chunk)
    for rank in range(len(consumer.regs)):
        got = consumer.digest(rank, chunk, producer.regs)
        assert sent.first_mismatch(got) is None
        assert got.states.keys() <= sent.states.keys()
        if chunk == 1:  # every token the consumer received is compared
            for key in got.rows.keys() & sent.rows.keys():
                assert got.spans(key).keys() <= sent.spans(key).keys(), key.label()
    _flip_one(world[0], producer, consumer, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=hybrid_worlds(), data=st.data())
def test_windows_on_a_grid_are_compared_but_for_less_than_a_step(
    world: World, data: st.DataObject
) -> None:
    """On a ``Grid`` every series of the producer's windowed views is compared from the later of
    the two sides' starts, but for the span straddling it (fewer than ``step`` tokens), to the
    prompt's end; every other series as without one (from the later start's chunk boundary)."""
    prompt = data.draw(st.integers(1, MAX_PROMPT), label="prompt")
    chunk = data.draw(st.sampled_from([3, 256]), label="chunk")
    grid = Grid(data.draw(st.integers(1, 9), label="step"), prompt)
    producer, consumer = _sides(world, prompt)
    sent = KvDigest.from_json(producer.merged(chunk, grid).to_json())  # as kvroute stores it
    for rank in range(len(consumer.regs)):
        got = consumer.digest(rank, chunk, producer.regs, sent)
        assert sent.first_mismatch(got) is None
        assert got.gridded <= sent.gridded
        for key in got.rows.keys() & sent.rows.keys():
            compared = got.spans(key).keys() & sent.spans(key).keys()
            covered = {token for a, b in compared for token in range(a, b)}
            mine, theirs = got.first(key), sent.first(key)
            later = max(mine, theirs)
            step = grid.step if key in sent.gridded else chunk
            edge = (
                later + (prompt - later) % step if key in sent.gridded else -(-later // step) * step
            )
            start = later if mine == theirs else edge
            assert covered == set(range(start, prompt)), key.label()
            if key in sent.gridded:
                assert start - later < grid.step
    _flip_one(world[0], producer, consumer, data, grid)


def _flip_one(
    classes: list[ViewClass],
    producer: Held,
    consumer: Held,
    data: st.DataObject,
    grid: Grid | None = None,
) -> None:
    """Flips one received byte of a window's token or of the state slot; the mismatch names it
    (on a ``grid``, a windowed token's span: the token itself without one)."""
    rank = data.draw(st.integers(0, len(consumer.regs) - 1), label="rank")
    sent = producer.merged(1, grid)
    got = consumer.digest(rank, 1, producer.regs, sent)
    keys: list[RowKey | StateKey] = [k for k in sorted(got.rows) if k in sent.rows and got.rows[k]]
    keys += [k for k in sorted(got.states) if k in sent.states]
    if not keys:
        return
    key = data.draw(st.sampled_from(keys), label="key")
    ids = consumer.ids[rank]
    if isinstance(key, StateKey):
        want, _ = _state_id(classes, consumer.truth, key, data)
        expected = Mismatch(key)
    else:
        shared = sorted(got.spans(key).keys() & sent.spans(key).keys())
        if not shared:
            return
        span = data.draw(st.sampled_from(shared), label="span")
        token = data.draw(st.integers(span[0], span[1] - 1), label="token")
        want = _row_id(classes, consumer.truth, key, token, data)
        expected = Mismatch(key, span)
    pool, offset = _where(ids, want)
    consumer.pools[rank][pool][offset] ^= 0x01
    found = sent.first_mismatch(consumer.digest(rank, 1, producer.regs, sent))
    assert found == expected, None if found is None else found.describe()


def _row_id(
    classes: list[ViewClass], truth: Truth, key: RowKey, token: int, data: st.DataObject
) -> int:
    c = next(
        c
        for c, cls in enumerate(classes)
        if not cls.is_state
        and cls.owner == key.owner
        and ",".join(sorted(cls.roles)) == key.roles
        and (cls.layers is None or key.layer in cls.layers)
    )
    k = data.draw(st.integers(0, classes[c].unit - 1), label="byte")
    head = 0 if key.head == REPLICATED_HEAD else key.head
    return int(truth.logical_id(c, token, key.layer, key.buffer, head, np.array(k)))


def _state_id(
    classes: list[ViewClass], truth: Truth, key: StateKey, data: st.DataObject
) -> tuple[int, int]:
    """(logical id, byte in the unit) of one byte of a state unit, named as tests/truth.py names
    state bytes."""
    c = next(
        c
        for c, cls in enumerate(classes)
        if cls.is_state and cls.owner == key.owner and ",".join(sorted(cls.roles)) == key.roles
    )
    cls = classes[c]
    if cls.kind == "ssm":
        k = data.draw(st.integers(0, cls.unit - 1), label="byte")
        return int(truth.logical_id(c, REQUEST, key.layer, 0, key.unit, np.array(k))), k
    if cls.kind == "conv":
        size = cls.sections[key.section] // math.gcd(cls.sections[key.section], RADIX)
        k = data.draw(st.integers(key.unit * size, (key.unit + 1) * size - 1), label="byte")
        byte = k - key.unit * size
        return int(truth.logical_id(c, REQUEST, key.layer, key.section, 0, np.array(k))), byte
    k = data.draw(st.integers(0, cls.unit - 1), label="byte")
    return int(truth.logical_id(c, REQUEST, key.layer, 0, 0, np.array(k))), k


def _where(ids: dict[int, np.ndarray], want: int) -> tuple[int, int]:
    for pool, array in ids.items():
        found = np.flatnonzero(array == want)
        if len(found):
            return pool, int(found[0])
    raise AssertionError(f"no byte with logical id {want}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=hybrid_worlds(), data=st.data())
def test_place_state_is_the_inverse_of_read_state(world: World, data: st.DataObject) -> None:
    classes, ctx, gen = world
    senders, sender_layouts, _, _ = admitted(classes, ctx, gen)
    producer = Held(ctx, senders, sender_layouts, classes, 1, MAX_PROMPT).fill({})
    rank = data.draw(st.integers(0, len(producer.regs) - 1))
    reg, pools = producer.regs[rank], producer.pools[rank]
    state = {key: data.copy() for key, data in read_state(reg, pools, producer.slot)}
    blank = {p: np.zeros_like(a) for p, a in pools.items()}
    place_state(reg, blank, producer.slot, state)
    again = dict(read_state(reg, blank, producer.slot))
    assert again.keys() == state.keys()
    for key, want in state.items():
        np.testing.assert_array_equal(again[key], want, err_msg=key.label())
    # The units are the slot's state bytes, each once: none left out, none twice, nothing else.
    marks = {p: np.zeros_like(a) for p, a in pools.items()}
    place_state(reg, marks, producer.slot, {key: np.ones_like(want) for key, want in state.items()})
    truth = producer.truth.place(
        producer.side, producer.layouts[rank], rank, {}, states={producer.slot: REQUEST}
    )
    for pool, mark in marks.items():
        np.testing.assert_array_equal(mark, (truth[pool] != 0).astype(np.uint8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=hybrid_worlds(), data=st.data())
def test_the_canary_crosses_the_plan_and_names_a_flipped_window_or_state_byte(
    world: World, data: st.DataObject
) -> None:
    """The producer writes the canary (blocks and a state slot kept back) through its layout; the
    real plan moves it as one job (the canary's tokens as the prompt, the state slot pair); each
    consumer rank checks the window's tokens and its state units, then one flipped byte."""
    classes, ctx, gen = world
    tokens = range(math.lcm(ctx.tokens_per_block, gen.tokens_per_block))
    ctx, gen = (
        replace(side, num_slots=max(side.num_slots, len(tokens) // side.tokens_per_block + 2))
        for side in (ctx, gen)
    )
    senders, sender_layouts, receivers, receiver_layouts = admitted(classes, ctx, gen)
    with_blocks = [
        next((r for r in regs if covered_views(r)), None) for regs in (senders, receivers)
    ]
    if None not in with_blocks:
        assert canary_tokens(*with_blocks) == tokens
    src, dst = (
        list(range(side.num_slots - len(tokens) // side.tokens_per_block, side.num_slots))
        for side in (ctx, gen)
    )
    for regs, blocks in ((senders, src), (receivers, dst)):
        assert all(reserved_blocks(reg, tokens) in ([], blocks) for reg in regs)
    src_slot = _state_slot(senders, tokens)
    sender_pools = {}
    for rank, (reg, layout) in enumerate(zip(senders, sender_layouts, strict=True)):
        pools = {p: as_bytes(a) for p, a in background(layout).items()}
        write_canary(
            RequestKv(reg, pools, src, tokens, state_slot=reserved_state_slot(reg, tokens))
        )
        sender_pools[rank] = pools
    dst_slot = _state_slot(receivers, tokens)
    request = Request(src, dst, TokenRange(0, len(tokens)), (0, 0), [(src_slot, dst_slot)],
                      len(tokens))  # fmt: skip
    rank = data.draw(st.integers(0, len(receivers) - 1), label="rank")
    reg, layout = receivers[rank], receiver_layouts[rank]
    plan = build_plan(senders, reg, sender_dp_rank=0).to_json(period=True)
    received = {p: as_bytes(a) for p, a in background(layout).items()}
    out, _ = execute(plan, sender_pools, dict(enumerate(sender_layouts)), layout, request,
                     into=received)  # fmt: skip
    firsts = window_firsts(reg, len(tokens), senders)
    received_kv = RequestKv(reg, out, dst, tokens, firsts, dst_slot)
    assert check_canary(received_kv) is None
    # One flipped byte of what the pair moved: found by its logical id in the truth's layout.
    truth = Truth(classes)
    ids = truth.place(gen, layout, rank, {b: i * gen.tokens_per_block for i, b in enumerate(dst)},
                      states={dst_slot: REQUEST})  # fmt: skip
    rows = list(read_rows(received_kv))
    keys: list[RowKey | StateKey] = [key for key, held in rows if len(held)]
    keys += [key for key, _ in read_state(reg, out, dst_slot)]
    if not keys:
        return
    key = data.draw(st.sampled_from(keys), label="key")
    if isinstance(key, StateKey):
        want, byte = _state_id(classes, truth, key, data)
        expected = Mismatch(key, byte=byte)
    else:
        held = dict(rows)[key]
        token = data.draw(st.integers(len(tokens) - len(held), len(tokens) - 1), label="token")
        want, expected = (
            _row_id(classes, truth, key, token, data),
            Mismatch(key, (token, token + 1)),
        )
    pool, offset = _where(ids, want)
    out[pool][offset] ^= 0x10
    found = check_canary(received_kv)
    assert found == expected, None if found is None else found.describe()


def _state_slot(regs: list, tokens: range) -> int:
    """The side's canary state slot (ranks without state views keep none)."""
    slots = {slot for reg in regs if (slot := reserved_state_slot(reg, tokens)) is not None}
    assert len(slots) <= 1
    return slots.pop() if slots else 0
