"""Closing the pools of ranks that are gone, as soon as this process can tell.

A pool stays open while jobs use it (``transfer.opened``); once its rank is deleted, re-registered or
expired, nothing will ever open it again, so its mapping and descriptors are released (at once where
idle, else as its last job ends). This process learns of deletes and re-registrations it serves
itself right away; what other replicas served, and leases that ran out, it learns on each lease
reaper round, from one small generations read per deployment with open pools.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from kvroute.store.engine import SessionMaker
from kvroute.store.snapshots import instance_states
from kvroute.transfer.opened import PoolMemoryCache, PoolOwner


class PoolSweep:
    def __init__(self, sessionmaker: SessionMaker, memories: PoolMemoryCache) -> None:
        self._sessionmaker = sessionmaker
        self._memories = memories

    def deleted(self, deployment: str, instance: str, rank: int | None = None) -> None:
        """A rank (every rank of the instance when None) was deleted here."""
        self._memories.retire(deployment, instance, rank)

    def registered(self, deployment: str, instance: str, rank: int, generation: int) -> None:
        """A rank registered here at ``generation``: pools of its earlier generations go."""
        self._memories.supersede(PoolOwner(deployment, instance, rank, generation))

    async def sweep(self, *, now: datetime) -> int:
        """Retires the pools whose rank no longer lives at the generation they were opened at;
        returns how many rank generations were retired."""
        by_deployment: dict[str, list[PoolOwner]] = defaultdict(list)
        for owner in self._memories.owners():
            by_deployment[owner.deployment].append(owner)
        retired = 0
        for deployment, owners in sorted(by_deployment.items()):
            instances = sorted({owner.instance for owner in owners})
            states = await instance_states(
                self._sessionmaker, deployment, instances, now=now, missing_ok=True
            )
            for owner in owners:
                state = states.get(owner.instance)
                if state is None or state.live.get(owner.rank) != owner.generation:
                    self._memories.retire_owner(owner)
                    retired += 1
        return retired
