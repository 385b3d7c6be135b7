"""A rank's KV memory as digests and the canary read it: per KV cache group, with its own blocks.

vLLM gives each KV cache group its own block table (full attention, each sliding-window group,
each recurrent-state group), so a request is digested group by group: the group's views
(``RankCache.group_views``) read through the group's block list, a window from its first held
token on (``kv_rows.window_firsts``: the rank's own window on a producer, what the pair moves on a
consumer), a state group as one request state in the slot its list ends with (the slot the pulls
move, ``kv_state``). The per-group digests merge into one, keyed by view roles and layer, so the
two sides compare whatever their grouping.

The canary (``canary``) lives in vLLM's null block, which every group shares: a consumer checks
it in rounds of views that do not overlap there.

Host memory (a CPU engine's cache) is read in place; device memory (a GPU engine's) through the
slots each use stages on the host (``client.pool_access``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.client.kv_digest import Grid, KvDigest, Mismatch, kv_digest
from kvroute.client.kv_rows import RequestKv, RowKey, window_firsts
from kvroute.client.nixl_descs import PoolAddress
from kvroute.client.pool_access import PoolAccess, pool_access
from kvroute.engines.vllm.canary import (
    NULL_BLOCK,
    Canary,
    canary_for,
    clear_null_block,
    only,
    whole_block,
    write_null_block,
)
from kvroute.geometry import RankRegistration

log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class RankMemory:
    """What a rank digests: its registration, its pools, and its KV cache groups' views."""

    reg: RankRegistration
    pools: PoolAccess
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
        """Host memory (``DRAM``) in place, device memory (``VRAM``) staged; None where the
        device's memory cannot be reached (said once in the log: sampled requests are then pulled
        unchecked and no canary is written or checked)."""
        deployment, instance, rank = where
        try:
            pools = pool_access(addresses, mem_type)
        except Exception as error:  # no torch, no CUDA: the connector still moves KV
            log.warning("kvroute: KV digests and the canary cannot read %s rank %d's %s (%s); it "
                        "pulls sampled requests unchecked", instance, rank, mem_type, error)  # fmt: skip
            return None
        reg = RankRegistration.from_json(
            document, deployment=deployment, instance=instance, rank=rank
        )
        return cls.over(reg, pools, group_views, state_groups)

    @classmethod
    def over(
        cls,
        reg: RankRegistration,
        pools: PoolAccess,
        group_views: Mapping[int, set[int]],
        state_groups: Iterable[int] = (),
    ) -> RankMemory:
        groups = {group: only(reg, views) for group, views in group_views.items()}
        memory = cls(reg, pools, groups, frozenset(state_groups))
        memory._say_uncovered()
        return memory

    def _say_uncovered(self) -> None:
        left = [view.label() for view in self.reg.views if not whole_block(self.reg, view)]
        if left:
            log.info("kvroute: %s's canary leaves out %s (blocks of another token count than the "
                     "rank's: the canary is one block); sampled digests cover them",
                     self.reg.label(), ", ".join(left))  # fmt: skip

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
        staged = self.pools.stage(block for group in self.groups for block in blocks[group])
        for group, reg in sorted(self.groups.items()):
            held = staged.blocks(blocks[group])
            if group in self.state_groups:
                state = RequestKv(reg, staged.pools, [], tokens, state_slot=held[-1])
                digest.merge(kv_digest(state, chunk, grid=grid))
                continue
            firsts = window_firsts(reg, prompt_tokens, peers)
            own = RequestKv(reg, staged.pools, held, tokens, firsts)
            digest.merge(kv_digest(own, chunk, grid=grid, gridded=gridded))
        return digest

    def write_canary(self) -> None:
        """The producer's canary image in the null block (``canary.write_null_block``)."""
        staged = self.pools.stage([NULL_BLOCK])
        write_null_block(self.reg, staged.pools)
        self.pools.write_back(staged)

    def canary_for(self, documents: Mapping[int, Mapping[str, Any]], instance: str) -> Canary:
        """What this rank checks of ``instance``'s canary (``documents``: its ranks')."""
        return canary_for(self.reg, documents, instance)

    def clear(self, canary: Canary) -> None:
        """Zeroes the null block under the canary's round, before its pull."""
        staged = self.pools.stage([NULL_BLOCK])
        clear_null_block(only(self.reg, canary.views), staged.pools)
        self.pools.write_back(staged)

    def check_canary(self, canary: Canary) -> Mismatch | None:
        """The first wrong element of the canary's round pulled into the null block."""
        return canary.check(self.reg, self.pools.stage([NULL_BLOCK]).pools)
