"""Property test: logical-order KV digests agree across layouts, block sizes and TP splits, and one
flipped byte anywhere is a mismatch naming its layer, head, K/V and token.

Both sides' pools are filled from tests/truth.py's logical tensor (each logical byte id hashed to a
byte), laid out by tests/world.py with independent TP/PP/attention-DP, block sizes, hnd/nhd,
interiors and replicated views; neither is derived from kvroute's code.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.client.kv_digest import Grid, KvDigest, Mismatch, kv_digest
from kvroute.client.kv_rows import REPLICATED_HEAD, RequestKv, RowKey, place_rows, read_rows
from kvroute.geometry import RankRegistration
from tests.truth import Truth
from tests.unit.test_plan_ground_truth import MAX_PROMPT, worlds
from tests.unit.test_plan_ground_truth_interior import tiled_worlds
from tests.world import Side, ViewClass, instance


def as_bytes(ids: np.ndarray) -> np.ndarray:
    """A byte per logical id (equal ids, equal bytes): the id's top byte after a multiplicative mix."""
    mixed = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return (mixed >> np.uint64(56)).astype(np.uint8)


class Filled:
    """One side's ranks, each with its pools holding the first ``MAX_PROMPT`` tokens of one request
    in shuffled blocks: logical ids (int64) and their bytes."""

    def __init__(self, side: Side, classes: list[ViewClass], name: str, seed: int) -> None:
        self.regs, self.layouts = instance(side, classes, name)
        rng = np.random.default_rng(seed)
        count = -(-MAX_PROMPT // side.tokens_per_block)
        self.blocks = [list(rng.permutation(side.num_slots)[:count]) for _ in self.regs]
        truth = Truth(classes)
        self.ids = [
            truth.fill(side, layout, rank, blocks, list(range(count)))
            for rank, (layout, blocks) in enumerate(zip(self.layouts, self.blocks, strict=True))
        ]
        self.pools = [{p: as_bytes(a) for p, a in ids.items()} for ids in self.ids]

    def digest(self, rank: int, tokens: range, chunk: int) -> KvDigest:
        return kv_digest(
            RequestKv(self.regs[rank], self.pools[rank], self.blocks[rank], tokens), chunk
        )

    def merged(self, tokens: range, chunk: int) -> KvDigest:
        merged = KvDigest((tokens.start, tokens.stop), chunk)
        for rank in range(len(self.regs)):
            merged.merge(self.digest(rank, tokens, chunk))
        return merged


def token_ranges() -> st.SearchStrategy[range]:
    return st.tuples(st.integers(0, MAX_PROMPT - 1), st.integers(1, MAX_PROMPT)).map(
        lambda ab: range(min(ab[0], ab[1] - 1), max(ab[1], ab[0] + 1))
    )


def _check_world(world: tuple[list[ViewClass], Side, Side], data: st.DataObject) -> None:
    classes, ctx, gen = world
    tokens = data.draw(token_ranges(), label="tokens")
    chunk = data.draw(st.sampled_from([1, 3, 256]), label="chunk")
    producer = Filled(ctx, classes, "ctx", 1)
    consumer = Filled(gen, classes, "gen", 2)
    sent = producer.merged(tokens, chunk)
    for rank in range(len(consumer.regs)):
        got = consumer.digest(rank, tokens, chunk)
        # A series one side leaves out (heads it cannot name) is not compared.
        assert sent.first_mismatch(got) is None
    _flip_one(classes, producer, consumer, data, tokens, sent)


def _flip_one(
    classes: list[ViewClass],
    producer: Filled,
    consumer: Filled,
    data: st.DataObject,
    tokens: range,
    sent: KvDigest,
) -> None:
    """Flips one byte of a received row and checks the mismatch names it (chunks of one token)."""
    rank = data.draw(st.integers(0, len(consumer.regs) - 1), label="rank")
    reg, pools = consumer.regs[rank], consumer.pools[rank]
    held = read_rows(RequestKv(reg, pools, consumer.blocks[rank], tokens))
    keys = [key for key, _ in held if key in sent.rows]
    if not keys:
        return
    key = data.draw(st.sampled_from(keys), label="key")
    token = data.draw(st.sampled_from(list(tokens)), label="token")
    pool, offset = _byte_of(classes, consumer.ids[rank], key, token, data)
    pools[pool][offset] ^= 0x01
    found = producer.merged(tokens, 1).first_mismatch(consumer.digest(rank, tokens, 1))
    assert found is not None
    assert (found.key, found.tokens) == (key, (token, token + 1)), found.describe()


def _byte_of(
    classes: list[ViewClass],
    ids: dict[int, np.ndarray],
    key: RowKey,
    token: int,
    data: st.DataObject,
) -> tuple[int, int]:
    """(pool, offset) of one byte of ``key``'s row at ``token``, found by its logical id."""
    c = next(
        c
        for c, cls in enumerate(classes)
        if cls.owner == key.owner and ",".join(sorted(cls.roles)) == key.roles
    )
    k = data.draw(st.integers(0, classes[c].unit - 1), label="byte")
    head = 0 if key.head == REPLICATED_HEAD else key.head
    want = Truth(classes).logical_id(c, token, key.layer, key.buffer, head, np.array(k))
    for pool, array in ids.items():
        found = np.flatnonzero(array == want)
        if len(found):
            return pool, int(found[0])
    raise AssertionError(f"no byte of {key.label()} token {token}")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), data=st.data())
def test_digests_agree_across_layouts_and_name_a_flipped_byte(
    world: tuple[list[ViewClass], Side, Side], data: st.DataObject
) -> None:
    _check_world(world, data)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=tiled_worlds(), data=st.data())
def test_digests_agree_across_interiors(
    world: tuple[list[ViewClass], Side, Side], data: st.DataObject
) -> None:
    _check_world(world, data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), data=st.data())
def test_place_rows_is_the_inverse_of_read_rows(
    world: tuple[list[ViewClass], Side, Side], data: st.DataObject
) -> None:
    classes, ctx, _ = world
    filled = Filled(ctx, classes, "ctx", 3)
    rank = data.draw(st.integers(0, len(filled.regs) - 1))
    reg: RankRegistration = filled.regs[rank]
    tokens = range(0, len(filled.blocks[rank]) * ctx.tokens_per_block)
    rows = dict(read_rows(RequestKv(reg, filled.pools[rank], filled.blocks[rank], tokens)))
    blank = RequestKv(
        reg,
        {p: np.zeros_like(a) for p, a in filled.pools[rank].items()},
        filled.blocks[rank],
        tokens,
    )
    place_rows(blank, rows)
    again = dict(read_rows(blank))
    assert again.keys() == rows.keys()
    for key, want in rows.items():
        np.testing.assert_array_equal(again[key], want, err_msg=key.label())


def test_a_grid_counts_its_edges_back_from_the_anchor_whatever_the_start() -> None:
    grid = Grid(8, 80)
    # Row index ranges (from each start), i.e. prompt positions 45-48, 48-56, ... and 50-56, ...
    assert grid.cuts(range(45, 80)) == [(0, 3), (3, 11), (11, 19), (19, 27), (27, 35)]
    assert grid.cuts(range(50, 77)) == [(0, 6), (6, 14), (14, 22), (22, 27)]
    assert grid.cuts(range(48, 56)) == [(0, 8)]
    assert grid.cuts(range(79, 80)) == [(0, 1)]


def test_a_chunk_the_producer_did_not_cut_alike_is_refused_not_skipped() -> None:
    """A consumer that received tokens 0-290 against a producer's digests of 0-300 (256-token
    chunks) would compare only the first chunk: its last 34 tokens would pass unchecked."""
    key = RowKey("target", "key,value", 0, 0, 0)
    sent = KvDigest((0, 300), 256, rows={key: [1, 2]})
    assert sent.first_mismatch(KvDigest((0, 300), 256, rows={key: [1, 2]})) is None
    assert sent.first_mismatch(KvDigest((0, 300), 256, rows={key: [1, 3]})) == Mismatch(
        key, (256, 300)
    )
    with pytest.raises(ValueError, match="tokens 256-290 are a chunk of the consumer's"):
        sent.first_mismatch(KvDigest((0, 290), 256, rows={key: [1, 9]}))
    # A series that starts later on the consumer's side (a window) leaves its first span alone.
    late = KvDigest((0, 300), 256, rows={key: [7, 2]}, firsts={key: 100})
    assert sent.first_mismatch(late) is None
