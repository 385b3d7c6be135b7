"""The connector's canary: every view of a producer's null block, checked in rounds.

vLLM's block pool keeps block 0 as its null block, given to no request, so it is where the canary
lives on both sides. vLLM 0.34's planner lays KV cache groups over the same bytes ("groups alias
from byte 0"), so block 0 cannot hold an independent pattern per view. The producer therefore
writes one image: every view's block-0 region filled with ``integrity.filler`` (a mix of pool and
offset), then the pattern of ``canary_views`` (the views whose regions overlap none picked before
them) on top, through its layout. Any view's block-0 bytes are then known from the producer's
registrations alone: a consumer replays the same image on scratch memory (``_replayed``) and reads
what each producer view holds there, in logical order (``Expected``).

A consumer checks in rounds, because its own views alias too: each round is a set of its views
whose block-0 regions do not overlap (``rounds``), zeroed, pulled with the real plan and NIXL,
and read through its own layout against the replayed image; the next round starts once the check
has read. The first wrong element fails the path. A view whose blocks hold another token count
than the rank's is left out (the canary is one block) and said so in the log; digests cover it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvroute.client.integrity import check_canary, filler, write_canary
from kvroute.client.kv_digest import Mismatch
from kvroute.client.kv_rows import RequestKv, RowKey, read_rows, roles_of, window_firsts
from kvroute.client.kv_state import StateKey, read_state
from kvroute.geometry import RankRegistration, View

NULL_BLOCK = 0  # vLLM's BlockPool hands it to no request: the canary's block on both sides

LayerKey = tuple[str, str, int]  # (owner, roles, layer): one layer of one view, named alike


def only(reg: RankRegistration, views: Iterable[int]) -> RankRegistration:
    """The rank with only ``views``: what the client's readers then read, and nothing else."""
    wanted = set(views)
    return replace(reg, views=tuple(view for view in reg.views if view.view_id in wanted))


def layer_keys(view: View) -> set[LayerKey]:
    return {(view.owner.value, roles_of(view), layer) for layer in view.layer_ids}


def regions(view: View) -> list[tuple[int, int, int]]:
    """(pool, first byte, end byte) of the view's layers in a pool's slot 0."""
    return [(view.pool_id, at.offset, at.offset + view.bytes_per_layer) for at in view.layers]


def whole_block(reg: RankRegistration, view: View) -> bool:
    """Whether one block of the view holds the canary's tokens: state, or the rank's block size."""
    return view.is_state or reg.tokens(view) == reg.tokens_per_block


def canary_views(reg: RankRegistration, candidates: Iterable[int] | None = None) -> list[View]:
    """The views whose block-0 regions overlap no view picked before: attention (of the rank's
    block size: the canary is one such block) before state, then by view id."""
    allowed = None if candidates is None else set(candidates)
    taken: list[tuple[int, int, int]] = []
    picked = []
    for view in sorted(reg.views, key=lambda v: (v.is_state, v.view_id)):
        if (allowed is not None and view.view_id not in allowed) or not whole_block(reg, view):
            continue
        mine = regions(view)
        if any(p == q and a < d and c < b for p, a, b in mine for q, c, d in taken):
            continue
        taken += mine
        picked.append(view)
    return picked


def rounds(reg: RankRegistration, candidates: Iterable[int]) -> tuple[frozenset[int], ...]:
    """``candidates`` in rounds whose block-0 regions do not overlap (``canary_views`` over what
    the rounds before left)."""
    left, found = set(candidates), []
    while picked := canary_views(reg, left):
        found.append(frozenset(view.view_id for view in picked))
        left -= found[-1]
    return tuple(found)


def _state_slot(reg: RankRegistration) -> int | None:
    return NULL_BLOCK if any(view.is_state for view in reg.views) else None


def write_null_block(reg: RankRegistration, pools: Mapping[int, np.ndarray]) -> None:
    """The producer's canary image in block 0 (slot 0 of every pool): filler under every view,
    the pattern of ``canary_views`` over it."""
    for view in reg.views:
        for pool, first, end in regions(view):
            pools[pool][first:end] = filler(pool, first, end)
    picked = only(reg, (view.view_id for view in canary_views(reg)))
    tokens = range(reg.tokens_per_block)
    write_canary(RequestKv(picked, pools, [NULL_BLOCK], tokens, state_slot=_state_slot(picked)))


def clear_null_block(reg: RankRegistration, pools: Mapping[int, np.ndarray]) -> None:
    """Zeroes ``reg``'s views in block 0 before a round's pull: what an earlier round left there
    must not pass for what this one should have moved."""
    for view in reg.views:
        for pool, first, end in regions(view):
            pools[pool][first:end] = 0


def _replayed(reg: RankRegistration) -> tuple[RankRegistration, dict[int, np.ndarray]]:
    """The producer rank's block-0 image on scratch memory: its pools cut to one slot."""
    one = replace(reg, pools=tuple(replace(pool, num_slots=1) for pool in reg.pools))
    ends = {pool: end for view in reg.views for pool, _, end in regions(view)}
    pools = {
        pool.pool_id: np.zeros(max(pool.slot_stride, ends.get(pool.pool_id, 0)), dtype=np.uint8)
        for pool in one.pools
    }
    write_null_block(one, pools)
    return one, pools


@dataclass
class Expected:
    """What the consumer's block 0 must hold after a round, by logical series: each producer
    rank's replayed image read through its registration. A series two producer ranks hold
    differently (not one that replication makes equal) is not checked."""

    rows_by_key: dict[RowKey, np.ndarray] = field(default_factory=dict)
    state_by_key: dict[StateKey, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, peers: Iterable[RankRegistration], tokens: int) -> Expected:
        rows: dict[RowKey, np.ndarray] = {}
        state: dict[StateKey, np.ndarray] = {}
        for peer in peers:
            reg, pools = _replayed(peer)
            held = only(reg, (view.view_id for view in reg.views if whole_block(reg, view)))
            found = read_rows(RequestKv(held, pools, [NULL_BLOCK], range(tokens)))
            _merge(rows, ((key, data.copy()) for key, data in found))
            if (slot := _state_slot(reg)) is not None:
                _merge(state, ((key, data.copy()) for key, data in read_state(reg, pools, slot)))
        return cls(rows, state)

    def rows(self, key: RowKey, held: np.ndarray, width: int) -> np.ndarray | None:
        found = self.rows_by_key.get(key)  # rows of positions 0, 1, ...: the block's tokens
        return None if found is None else found[held]

    def state(self, key: StateKey, size: int) -> np.ndarray | None:
        return self.state_by_key.get(key)


_AMBIGUOUS = np.empty(0, dtype=np.uint8)


def _merge(into: dict[Any, np.ndarray], found: Iterable[tuple[Any, np.ndarray]]) -> None:
    for key, data in found:
        if key in into and not np.array_equal(into[key], data):
            into[key] = _AMBIGUOUS
        else:
            into.setdefault(key, data)
    for key in [key for key, data in into.items() if data is _AMBIGUOUS]:
        del into[key]


@dataclass
class Canary:
    """One producer instance's canary as a consumer rank checks it: its view rounds, the
    producer's ranks, the tokens of block 0 both sides hold, and the round being checked."""

    instance: str
    rounds: tuple[frozenset[int], ...]
    peers: tuple[RankRegistration, ...]
    tokens: int
    round: int = 0
    expected: Expected | None = None  # replayed on the first check (off the engine's step)

    @property
    def views(self) -> frozenset[int]:
        return self.rounds[self.round]

    @property
    def last(self) -> bool:
        return self.round == len(self.rounds) - 1

    def following(self) -> Canary:
        return replace(self, round=self.round + 1)

    def check(self, reg: RankRegistration, pools: Mapping[int, np.ndarray]) -> Mismatch | None:
        """The first wrong element of this round's views in block 0 (None: all right)."""
        if self.expected is None:
            self.expected = Expected.of(self.peers, self.tokens)
        mine = only(reg, self.views)
        firsts = window_firsts(mine, self.tokens, self.peers)
        kv = RequestKv(mine, pools, [NULL_BLOCK], range(self.tokens), firsts, _state_slot(mine))
        return check_canary(kv, self.expected)


def canary_for(
    reg: RankRegistration, documents: Mapping[int, Mapping[str, Any]], instance: str
) -> Canary:
    """What ``reg`` checks of ``instance``'s canary (``documents``: its ranks' registrations):
    its views of layers some producer rank holds, where every producer view of those layers holds
    the canary's tokens in one block."""
    peers = tuple(
        RankRegistration.from_json(doc, deployment=reg.deployment, instance=instance, rank=rank)
        for rank, doc in sorted(documents.items())
    )
    tokens = min(reg.tokens_per_block, *(peer.tokens_per_block for peer in peers))
    held = set().union(*(layer_keys(v) for peer in peers for v in peer.views))
    blocked = set().union(
        *(layer_keys(v) for peer in peers for v in peer.views if whole_block(peer, v))
    )
    candidates = [
        view.view_id
        for view in reg.views
        if layer_keys(view) & held and layer_keys(view) & held <= blocked
    ]
    return Canary(instance, rounds(reg, candidates), peers, tokens)
