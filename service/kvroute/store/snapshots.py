"""Read-only snapshots of an instance for planning: generations first, documents only on a miss.

A plan request first reads each rank's generation and lease (a few small columns) so a cached
plan can be answered without loading or parsing a single document; documents are read only for a
cache miss, and then only at the generations that were seen, so a plan never mixes generations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Row, Select, bindparam, select

from kvroute.store import ranks as repo
from kvroute.store.engine import SessionMaker, autocommit_connection, engine_of, retry_disconnect
from kvroute.store.errors import NotFound
from kvroute.store.models import Deployment, Instance, Rank


@dataclass(frozen=True, slots=True)
class InstanceState:
    deployment: str
    instance: str
    role: str
    tp_size: int
    pp_size: int
    cp_size: int
    live: dict[int, int]  # rank -> generation
    expired: tuple[int, ...]

    @property
    def expected_ranks(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size


async def instance_states(
    sessionmaker: SessionMaker,
    deployment: str,
    instances: Sequence[str],
    *,
    now: datetime,
    missing_ok: bool = False,
) -> dict[str, InstanceState]:
    """Generations of the instances' live ranks and the numbers of their expired ones.

    One joined statement for any number of instances: this runs on every plan read, cache hits
    included.
    """
    states = await _states(
        sessionmaker, _INSTANCES, {"deployment": deployment, "names": list(instances)}, now
    )
    missing = [name for name in instances if name not in states]
    if missing_ok:
        return states
    if missing:
        raise NotFound(f"instance {missing[0]!r} of deployment {deployment!r} does not exist")
    return {name: states[name] for name in instances}


async def deployment_states(
    sessionmaker: SessionMaker, deployment: str, *, now: datetime
) -> list[InstanceState]:
    """Every instance of a deployment, by name; ``NotFound`` for an unknown deployment."""
    states = await _states(sessionmaker, _DEPLOYMENT, {"deployment": deployment}, now)
    if not states:
        async with autocommit_connection(engine_of(sessionmaker)) as connection:
            found = await connection.scalar(
                select(Deployment.name).where(Deployment.name == deployment)
            )
        if found is None:
            raise NotFound(f"deployment {deployment!r} does not exist")
    return [states[name] for name in sorted(states)]


def _query(*where: ColumnElement[bool]) -> Select[Any]:
    """The state query, built once per shape: SQLAlchemy reuses its compiled form."""
    return (
        select(
            Deployment.checked_at,
            Instance.name,
            Instance.role,
            Instance.tp_size,
            Instance.pp_size,
            Instance.cp_size,
            Rank.rank,
            Rank.generation,
            Rank.lease_expires_at,
        )
        .join(Instance, Instance.deployment == Deployment.name)
        .outerjoin(
            Rank, (Rank.deployment == Instance.deployment) & (Rank.instance == Instance.name)
        )
        .where(Deployment.name == bindparam("deployment"), *where)
    )


_DEPLOYMENT = _query()
_INSTANCES = _query(Instance.name.in_(bindparam("names", expanding=True)))


async def _states(
    sessionmaker: SessionMaker, query: Select[Any], values: dict[str, Any], now: datetime
) -> dict[str, InstanceState]:
    deployment = values["deployment"]

    async def read() -> Sequence[Row[Any]]:
        async with autocommit_connection(engine_of(sessionmaker)) as connection:
            return (await connection.execute(query, values)).all()

    rows = await retry_disconnect(read)
    layouts: dict[str, tuple[str, int, int, int]] = {}
    live: dict[str, dict[int, int]] = {}
    expired: dict[str, list[int]] = {}
    for checked_at, name, role, tp_size, pp_size, cp_size, rank, generation, expires in rows:
        layouts[name] = (role, tp_size, pp_size, cp_size)
        live.setdefault(name, {})
        expired.setdefault(name, [])
        if rank is None:
            continue
        if expires > repo.judged_at_time(checked_at, now):
            live[name][rank] = generation
        else:
            expired[name].append(rank)
    return {
        name: InstanceState(
            deployment,
            name,
            *layout,
            dict(sorted(live[name].items())),
            tuple(sorted(expired[name])),
        )
        for name, layout in layouts.items()
    }


async def instance_state(
    sessionmaker: SessionMaker, deployment: str, instance: str, *, now: datetime
) -> InstanceState:
    return (await instance_states(sessionmaker, deployment, [instance], now=now))[instance]
