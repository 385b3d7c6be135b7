"""Read-only snapshots of an instance for planning: generations first, documents only on a miss.

A plan request first reads each rank's generation and lease (a few small columns) so a cached
plan can be answered without loading or parsing a single document; documents are read only for a
cache miss, and then only at the generations that were seen, so a plan never mixes generations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, tuple_

from kvroute.store import ranks as repo
from kvroute.store.engine import SessionMaker, reading
from kvroute.store.errors import NotFound
from kvroute.store.models import Deployment, Instance, Rank


@dataclass(frozen=True, slots=True)
class InstanceState:
    deployment: str
    instance: str
    role: str
    tp_size: int
    pp_size: int
    live: dict[int, int]  # rank -> generation
    expired: tuple[int, ...]

    @property
    def expected_ranks(self) -> int:
        return self.tp_size * self.pp_size


async def instance_state(
    sessionmaker: SessionMaker, deployment: str, instance: str, *, now: datetime
) -> InstanceState:
    """Generations of the instance's live ranks and the numbers of its expired ones."""
    async with reading(sessionmaker) as session:
        owner = await session.get(Deployment, deployment)
        row = await session.get(Instance, (deployment, instance)) if owner is not None else None
        if owner is None or row is None:
            raise NotFound(f"instance {instance!r} of deployment {deployment!r} does not exist")
        at = repo.judged_at(owner, now)
        rows = await session.execute(
            select(Rank.rank, Rank.generation, Rank.lease_expires_at).where(
                Rank.deployment == deployment, Rank.instance == instance
            )
        )
        live, expired = {}, []
        for rank, generation, expires in rows:
            if expires > at:
                live[rank] = generation
            else:
                expired.append(rank)
    return InstanceState(
        deployment, instance, row.role, row.tp_size, row.pp_size, live, tuple(sorted(expired))
    )


async def rank_documents(
    sessionmaker: SessionMaker, deployment: str, wanted: Iterable[tuple[str, int, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    """Documents of (instance, rank, generation) triples; a rank that moved on is absent."""
    keys = list(wanted)
    if not keys:
        return {}
    async with reading(sessionmaker) as session:
        rows = await session.execute(
            select(Rank.instance, Rank.rank, Rank.document).where(
                Rank.deployment == deployment,
                tuple_(Rank.instance, Rank.rank, Rank.generation).in_(keys),
            )
        )
        return {(instance, rank): document for instance, rank, document in rows}
