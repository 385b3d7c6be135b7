"""A rank's host memory as digests and the canary read it: per KV cache group, with its own blocks.

vLLM gives each KV cache group its own block table (full attention, each sliding-window group,
each recurrent-state group), so a request is digested group by group: the group's views
(``RankCache.group_views``) read through the group's block list, a window from its first held
token on (``kv_rows.window_firsts``: the rank's own window on a producer, what the pair moves on a
consumer), a state group as one request state in the slot its list ends with (the slot the pulls
move, ``kv_state``). The per-group digests merge into one, keyed by view roles and layer, so the
two sides compare whatever their grouping.

The canary lives in vLLM's null block (block 0), which every group shares, and vLLM 0.34's
planner lays groups over the same bytes ("groups alias from byte 0"): block 0 holds one group's
pattern where groups overlap. ``canary_views`` picks, by a rule of the registration alone (so a
consumer can apply it to the producer's documents), the views whose block-0 regions overlap no
view picked before them: attention before state, then by view id. A consumer checks (and pulls)
the views it holds of the layers every producer rank wrote, less those overlapping on its side.
The rest is left to the sampled digests, and said so once in the log.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvroute.client.integrity import check_canary, write_canary
from kvroute.client.kv_digest import Grid, KvDigest, Mismatch, kv_digest
from kvroute.client.kv_rows import RequestKv, RowKey, roles_of, window_firsts
from kvroute.client.nixl_descs import PoolAddress
from kvroute.geometry import RankRegistration, View

log = logging.getLogger(f"vllm.{__name__}")
NULL_BLOCK = 0  # vLLM's BlockPool hands it to no request: the canary's block on both sides

LayerKey = tuple[str, str, int]  # (owner, roles, layer): one layer of one view, named alike


def host_pools(addresses: Mapping[int, PoolAddress]) -> dict[int, np.ndarray]:
    """Flat uint8 arrays over a rank's registered pools (host memory)."""
    return {
        pool: np.ctypeslib.as_array(
            (ctypes.c_uint8 * (at.slot_stride * at.num_slots)).from_address(at.base)
        )
        for pool, at in addresses.items()
    }


def only(reg: RankRegistration, views: Iterable[int]) -> RankRegistration:
    """The rank with only ``views``: what the client's readers then read, and nothing else."""
    wanted = set(views)
    return replace(reg, views=tuple(view for view in reg.views if view.view_id in wanted))


def _state_slot(reg: RankRegistration) -> int | None:
    """The canary's state slot: the null block of a state group (the pulls move a group's last)."""
    return NULL_BLOCK if any(view.is_state for view in reg.views) else None


def layer_keys(view: View) -> set[LayerKey]:
    return {(view.owner.value, roles_of(view), layer) for layer in view.layer_ids}


def _regions(view: View) -> list[tuple[int, int, int]]:
    """(pool, first byte, end byte) of the view's layers in a pool's slot 0."""
    return [(view.pool_id, at.offset, at.offset + view.bytes_per_layer) for at in view.layers]


def canary_views(reg: RankRegistration, candidates: Iterable[int] | None = None) -> list[View]:
    """The views whose block-0 regions overlap no view picked before: attention (of the rank's
    block size: the canary is one such block) before state, then by view id."""
    allowed = None if candidates is None else set(candidates)
    taken: list[tuple[int, int, int]] = []
    picked = []
    for view in sorted(reg.views, key=lambda v: (v.is_state, v.view_id)):
        if allowed is not None and view.view_id not in allowed:
            continue
        if not view.is_state and reg.tokens(view) != reg.tokens_per_block:
            continue
        regions = _regions(view)
        if any(p == q and a < d and c < b for p, a, b in regions for q, c, d in taken):
            continue
        taken += regions
        picked.append(view)
    return picked


@dataclass(frozen=True)
class Canary:
    """What a consumer rank checks of one producer's canary: its views, and the producer's ranks
    (the windows' pair)."""

    views: frozenset[int]
    peers: tuple[RankRegistration, ...]


@dataclass(frozen=True)
class RankMemory:
    """What a rank digests: its registration, its pools, and its KV cache groups' views."""

    reg: RankRegistration
    pools: dict[int, np.ndarray]
    groups: dict[int, RankRegistration] = field(default_factory=dict)  # group -> its views
    state_groups: frozenset[int] = frozenset()

    @classmethod
    def of(
        cls,
        document: Mapping[str, Any],
        where: tuple[str, str, int],
        addresses: Mapping[int, PoolAddress],
        mem_type: str,
        group_views: Mapping[int, set[int]],
        state_groups: Iterable[int] = (),
    ) -> RankMemory | None:
        """None where digests cannot read (device memory): said once in the log."""
        deployment, instance, rank = where
        if mem_type != "DRAM":
            log.warning("kvroute: KV digests and the canary read host memory; %s rank %d (%s) "
                        "pulls sampled requests unchecked", instance, rank, mem_type)  # fmt: skip
            return None
        reg = RankRegistration.from_json(
            document, deployment=deployment, instance=instance, rank=rank
        )
        groups = {group: only(reg, views) for group, views in group_views.items()}
        memory = cls(reg, host_pools(addresses), groups, frozenset(state_groups))
        memory._say_uncovered()
        return memory

    def _say_uncovered(self) -> None:
        covered = canary_views(self.reg)
        left = [view.label() for view in self.reg.views if view not in covered]
        if left:
            log.info("kvroute: %s's canary leaves out %s (their null-block bytes are another "
                     "group's: vLLM lays KV cache groups over the same memory); sampled digests "
                     "cover them", self.reg.label(), ", ".join(left))  # fmt: skip

    def digest(
        self,
        blocks: Sequence[Sequence[int]],
        tokens: range,
        chunk: int,
        prompt_tokens: int,
        peers: Sequence[RankRegistration] = (),
        grid: Grid | None = None,
        gridded: Collection[RowKey] | None = None,
    ) -> KvDigest:
        """Digests of ``tokens`` of a request whose groups hold ``blocks`` (a list per group, by
        group id): ``peers`` the other side's ranks on a consumer (windows: what the pair moves),
        none on a producer (its own window). ``grid`` and ``gridded``: ``kv_digest``'s (a consumer
        passes the producer digest's)."""
        digest = KvDigest((tokens.start, tokens.stop), chunk, grid=grid)
        for group, reg in sorted(self.groups.items()):
            held = blocks[group]
            if group in self.state_groups:
                state = RequestKv(reg, self.pools, [], tokens, state_slot=held[-1])
                digest.merge(kv_digest(state, chunk, grid=grid))
                continue
            own = RequestKv(reg, self.pools, held, tokens, window_firsts(reg, prompt_tokens, peers))
            digest.merge(kv_digest(own, chunk, grid=grid, gridded=gridded))
        return digest

    def write_canary(self) -> None:
        """The producer's canary: the pattern of ``canary_views`` in the null block."""
        reg = only(self.reg, (view.view_id for view in canary_views(self.reg)))
        tokens = range(self.reg.tokens_per_block)
        write_canary(RequestKv(reg, self.pools, [NULL_BLOCK], tokens, state_slot=_state_slot(reg)))

    def canary_for(self, documents: Mapping[int, Mapping[str, Any]], instance: str) -> Canary:
        """The views this rank pulls and checks of ``instance``'s canary (``documents``: its
        ranks' registrations): of the layers every producer rank that holds them wrote."""
        peers = tuple(
            RankRegistration.from_json(doc, deployment=self.reg.deployment, instance=instance,
                                       rank=rank)
            for rank, doc in sorted(documents.items())
        )  # fmt: skip
        written = set().union(*(layer_keys(v) for peer in peers for v in canary_views(peer)))
        held = set().union(*(layer_keys(v) for peer in peers for v in peer.views))
        candidates = [
            view.view_id
            for view in self.reg.views
            if layer_keys(view) & held and layer_keys(view) & held <= written
        ]
        views = frozenset(view.view_id for view in canary_views(self.reg, candidates))
        return Canary(views, peers)

    def check_canary(self, canary: Canary, tokens: int) -> Mismatch | None:
        """The first wrong element of the canary pulled into the null block (None: all right)."""
        reg = only(self.reg, canary.views)
        firsts = window_firsts(reg, tokens, canary.peers)
        kv = RequestKv(reg, self.pools, [NULL_BLOCK], range(tokens), firsts, _state_slot(reg))
        return check_canary(kv)
