"""Writing admitted ranks: a whole batch of admissions in a fixed number of statements.

The caller holds the deployment lock and has checked every rank. Each kind of write (lease
renewals, instance rows, generation counters, rank rows, their pools and views) is one
``executemany``, so a batch of sixteen admissions costs the round trips of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from kvroute.geometry import RankRegistration
from kvroute.store import ranks as repo
from kvroute.store.models import Generation, Instance, PoolRow, Rank, ViewRow
from kvroute.store.records import RegisterOutcome

RANKS = Rank.__table__
INSTANCES = Instance.__table__
GENERATIONS = Generation.__table__


@dataclass(frozen=True, slots=True)
class Existing:
    """A candidate's own row before the batch: its generation and canonical digest."""

    generation: int
    canonical_sha256: str


async def write_admitted(
    connection: AsyncConnection,
    admitted: Sequence[tuple[RankRegistration, Existing | None]],
    at: datetime,
) -> list[RegisterOutcome]:
    """Stores checked ranks (in order); an identical document only renews its lease."""
    renewed = [
        old is not None and old.canonical_sha256 == reg.canonical_digest for reg, old in admitted
    ]
    changed = [pair for pair, same in zip(admitted, renewed, strict=True) if not same]
    await _renew(
        connection, [reg for (reg, _), same in zip(admitted, renewed, strict=True) if same], at
    )
    generations = await _next_generations(connection, [reg for reg, _ in changed])
    if changed:
        await _upsert_instances(connection, [reg for reg, _ in changed], at)
        await _store_ranks(connection, changed, generations, at)
    outcomes = []
    for (reg, old), same in zip(admitted, renewed, strict=True):
        expires = at + timedelta(seconds=reg.lease_seconds)
        generation = old.generation if same and old else generations[reg.key]
        outcomes.append(RegisterOutcome(generation, expires, created=old is None))
    return outcomes


async def _renew(
    connection: AsyncConnection, regs: Sequence[RankRegistration], at: datetime
) -> None:
    if not regs:
        return
    statement = (
        update(RANKS)
        .where(
            RANKS.c.deployment == bindparam("key_deployment"),
            RANKS.c.instance == bindparam("key_instance"),
            RANKS.c.rank == bindparam("key_rank"),
        )
        .values(lease_expires_at=bindparam("expires"), fenced_at=None)
    )
    await connection.execute(
        statement,
        [
            {**_key(reg, "key_"), "expires": at + timedelta(seconds=reg.lease_seconds)}
            for reg in regs
        ],
    )


async def _next_generations(
    connection: AsyncConnection, regs: Sequence[RankRegistration]
) -> dict[tuple[str, int], int]:
    """Each rank's next generation; numbers are never reused, not even after a delete."""
    if not regs:
        return {}
    keys = [(reg.deployment, reg.instance, reg.rank) for reg in regs]
    rows = await connection.execute(
        select(GENERATIONS.c.instance, GENERATIONS.c.rank, GENERATIONS.c.generation).where(
            tuple_(GENERATIONS.c.deployment, GENERATIONS.c.instance, GENERATIONS.c.rank).in_(keys)
        )
    )
    last = {(instance, rank): generation for instance, rank, generation in rows}
    following = {reg.key: last.get(reg.key, 0) + 1 for reg in regs}
    statement = upsert(connection, GENERATIONS)
    await connection.execute(
        statement.on_conflict_do_update(
            index_elements=[GENERATIONS.c.deployment, GENERATIONS.c.instance, GENERATIONS.c.rank],
            set_={"generation": statement.excluded.generation},
        ),
        [{**_key(reg), "generation": following[reg.key]} for reg in regs],
    )
    return following


async def _upsert_instances(
    connection: AsyncConnection, regs: Sequence[RankRegistration], at: datetime
) -> None:
    """Creates the instances or re-states their layouts (the checks agreed with every member)."""
    layouts = {reg.instance: _layout(reg) for reg in regs}  # one row per instance, the last wins
    statement = upsert(connection, INSTANCES)
    await connection.execute(
        statement.on_conflict_do_update(
            index_elements=[INSTANCES.c.deployment, INSTANCES.c.name],
            set_={name: statement.excluded[name] for name in next(iter(layouts.values()))},
        ),
        [
            {"deployment": regs[0].deployment, "name": name, "created_at": at, **layout}
            for name, layout in layouts.items()
        ],
    )


async def _store_ranks(
    connection: AsyncConnection,
    changed: Sequence[tuple[RankRegistration, Existing | None]],
    generations: dict[tuple[str, int], int],
    at: datetime,
) -> None:
    documents = {reg.key: reg.to_json() for reg, _ in changed}
    rows = [
        {**_key(reg), **_rank_values(reg, documents[reg.key], generations[reg.key], at)}
        for reg, _ in changed
    ]
    replaced = [reg for reg, old in changed if old is not None]
    if replaced:
        keys = [(reg.deployment, reg.instance, reg.rank) for reg in replaced]
        # Pools and views go with their rank row (ON DELETE CASCADE).
        await connection.execute(
            delete(RANKS).where(
                tuple_(RANKS.c.deployment, RANKS.c.instance, RANKS.c.rank).in_(keys)
            )
        )
    await connection.execute(insert(RANKS), rows)
    pools = [
        repo.pool_row(_key(reg), pool) for reg, _ in changed for pool in documents[reg.key]["pools"]
    ]
    views = [
        repo.view_row(_key(reg), view) for reg, _ in changed for view in documents[reg.key]["views"]
    ]
    if pools:
        await connection.execute(insert(PoolRow.__table__), pools)
    if views:
        await connection.execute(insert(ViewRow.__table__), views)


def _rank_values(
    reg: RankRegistration, document: dict[str, Any], generation: int, at: datetime
) -> dict[str, Any]:
    return {
        "role": reg.role.value,
        "generation": generation,
        "lease_seconds": reg.lease_seconds,
        "lease_expires_at": at + timedelta(seconds=reg.lease_seconds),
        "registered_at": at,
        "document": document,
        "canonical_sha256": reg.canonical_digest,
        "geometry_class": reg.class_digest,
        "fenced_at": None,
    }


def _layout(reg: RankRegistration) -> dict[str, Any]:
    return {
        "role": reg.role.value,
        "tp_size": reg.tp_size,
        "pp_size": reg.pp_size,
        "cp_size": reg.cp_size,
        "attention_dp": reg.attention_dp,
        "dp_size": reg.dp_size,
    }


def _key(reg: RankRegistration, prefix: str = "") -> dict[str, Any]:
    return {
        f"{prefix}deployment": reg.deployment,
        f"{prefix}instance": reg.instance,
        f"{prefix}rank": reg.rank,
    }


def upsert(connection: AsyncConnection, table: Any) -> Any:
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


def greatest(connection: AsyncConnection, left: Any, right: Any) -> Any:
    """``greatest(left, right)``; SQLite's two-argument max() is its scalar greatest."""
    if connection.dialect.name == "postgresql":
        return func.greatest(left, right)
    return func.max(left, right)
