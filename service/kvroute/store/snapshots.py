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

from sqlalchemy import ColumnElement, Row, Select, bindparam, func, select
from sqlalchemy.dialects import postgresql

from kvroute.geometry import missing_ranks
from kvroute.store import ranks as repo
from kvroute.store.dialect import dialect_of
from kvroute.store.engine import SessionMaker, autocommit_connection, engine_of, retry_disconnect
from kvroute.store.errors import NotFound
from kvroute.store.models import DeploymentRow, InstanceRow, RankRow


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

    @property
    def missing(self) -> list[int]:
        """Ranks that are not live: never registered, deleted or expired."""
        return missing_ranks(self.expected_ranks, self.live)


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
        sessionmaker, "instances", {"deployment": deployment, "names": list(instances)}, now
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
    states = await _states(sessionmaker, "deployment", {"deployment": deployment}, now)
    if not states:
        async with autocommit_connection(engine_of(sessionmaker)) as connection:
            found = await connection.scalar(
                select(DeploymentRow.name).where(DeploymentRow.name == deployment)
            )
        if found is None:
            raise NotFound(f"deployment {deployment!r} does not exist")
    return [states[name] for name in sorted(states)]


def _query(*where: ColumnElement[bool]) -> Select[*tuple[Any, ...]]:
    """The state query, one row per rank, built once per shape (SQLAlchemy reuses its compiled
    form); leases are judged in Python."""
    return (
        select(
            DeploymentRow.checked_at,
            InstanceRow.name,
            InstanceRow.role,
            InstanceRow.tp_size,
            InstanceRow.pp_size,
            InstanceRow.cp_size,
            RankRow.rank,
            RankRow.generation,
            RankRow.lease_expires_at,
        )
        .join(InstanceRow, InstanceRow.deployment == DeploymentRow.name)
        .outerjoin(
            RankRow,
            (RankRow.deployment == InstanceRow.deployment) & (RankRow.instance == InstanceRow.name),
        )
        .where(DeploymentRow.name == bindparam("deployment"), *where)
    )


def _aggregated(*where: ColumnElement[bool]) -> Select[*tuple[Any, ...]]:
    """The state query on PostgreSQL: one row per instance, leases judged by the database and the
    live ranks, their generations and the expired ranks as arrays (decoded by the driver). A plan
    read of two 32-rank instances then costs two rows instead of sixty-four Python objects."""
    judged_at = func.greatest(DeploymentRow.checked_at, bindparam("now"))
    live = RankRow.lease_expires_at > judged_at
    by_rank = postgresql.aggregate_order_by
    return (
        select(
            InstanceRow.name,
            InstanceRow.role,
            InstanceRow.tp_size,
            InstanceRow.pp_size,
            InstanceRow.cp_size,
            func.array_agg(by_rank(RankRow.rank, RankRow.rank)).filter(live),
            func.array_agg(by_rank(RankRow.generation, RankRow.rank)).filter(live),
            # A rank row's lease is never NULL, so "not live" is exactly "expired"; the outer
            # join's NULL row of an instance without ranks is in neither.
            func.array_agg(by_rank(RankRow.rank, RankRow.rank)).filter(~live),
        )
        .select_from(DeploymentRow)
        .join(InstanceRow, InstanceRow.deployment == DeploymentRow.name)
        .outerjoin(
            RankRow,
            (RankRow.deployment == InstanceRow.deployment) & (RankRow.instance == InstanceRow.name),
        )
        .where(DeploymentRow.name == bindparam("deployment"), *where)
        .group_by(
            InstanceRow.name,
            InstanceRow.role,
            InstanceRow.tp_size,
            InstanceRow.pp_size,
            InstanceRow.cp_size,
            DeploymentRow.checked_at,
        )
    )


_IN = InstanceRow.name.in_(bindparam("names", expanding=True))
_ROWS = {"deployment": _query(), "instances": _query(_IN)}
_GROUPED = {"deployment": _aggregated(), "instances": _aggregated(_IN)}


async def _states(
    sessionmaker: SessionMaker, shape: str, values: dict[str, Any], now: datetime
) -> dict[str, InstanceState]:
    engine = engine_of(sessionmaker)
    grouped = dialect_of(engine).arrays
    query = _GROUPED[shape] if grouped else _ROWS[shape]
    if grouped:
        values = {**values, "now": now}

    async def read() -> Sequence[Row[*tuple[Any, ...]]]:
        async with autocommit_connection(engine) as connection:
            return (await connection.execute(query, values)).all()

    rows = await retry_disconnect(read)
    if grouped:
        return {row[0]: _grouped(values["deployment"], row) for row in rows}
    return _judged(values["deployment"], rows, now)


def _grouped(deployment: str, row: Row[*tuple[Any, ...]]) -> InstanceState:
    name, role, tp_size, pp_size, cp_size, live, generations, expired = row
    return InstanceState(
        deployment,
        name,
        role,
        tp_size,
        pp_size,
        cp_size,
        dict(zip(live or (), generations or (), strict=True)),
        tuple(expired or ()),
    )


def _judged(
    deployment: str, rows: Sequence[Row[*tuple[Any, ...]]], now: datetime
) -> dict[str, InstanceState]:
    """Instance states from one row per rank, each lease judged at ``judged_at_time``."""
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
