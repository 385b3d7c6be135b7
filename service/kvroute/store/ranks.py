"""Session-level queries and writes for deployments, instances and ranks.

Every function takes the caller's ``AsyncSession`` and never commits: the registry service decides
what one transaction contains. Writes of one deployment are only correct while the caller holds
:func:`lock_deployment`.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, exists, func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from kvroute.geometry import RankRegistration
from kvroute.store.models import Deployment, Generation, Instance, PoolRow, Rank, ViewRow


async def lock_deployment(session: AsyncSession, deployment: str) -> None:
    """Serializes writers of one deployment across processes until the transaction ends.

    PostgreSQL: a transaction-scoped advisory lock keyed by the name, which works before the
    deployment row exists (a row lock could not cover the first registration). SQLite: the
    transaction already began with BEGIN IMMEDIATE (see ``engine``), which holds the write lock.
    """
    connection = await session.connection()
    if connection.dialect.name == "postgresql":
        key = func.hashtextextended(deployment, 0)
        await session.execute(select(func.pg_advisory_xact_lock(key)))


async def ensure_deployment(session: AsyncSession, name: str, now: datetime) -> Deployment:
    deployment = await session.get(Deployment, name)
    if deployment is None:
        deployment = Deployment(name=name, created_at=now, checked_at=now)
        session.add(deployment)
    return deployment


def judged_at(deployment: Deployment, now: datetime) -> datetime:
    """The instant leases of this deployment are judged at: never before its latest admission."""
    return judged_at_time(deployment.checked_at, now)


def judged_at_time(checked_at: datetime, now: datetime) -> datetime:
    return max(now, checked_at)


async def live_registrations(
    session: AsyncSession,
    deployment: str,
    at: datetime,
    *,
    instance: str | None = None,
    role: str | None = None,
) -> list[tuple[RankRegistration, int]]:
    """Live ranks of a deployment (optionally one instance or one role) with their generations."""
    query = select(Rank.instance, Rank.rank, Rank.document, Rank.generation).where(
        Rank.deployment == deployment, Rank.lease_expires_at > at
    )
    if instance is not None:
        query = query.where(Rank.instance == instance)
    if role is not None:
        query = query.where(Rank.role == role)
    rows = (await session.execute(query.order_by(Rank.instance, Rank.rank))).all()
    # Parsing a large deployment's documents takes milliseconds per rank: not on the event loop.
    return await asyncio.to_thread(_parse_rows, deployment, rows)


def _parse_rows(deployment: str, rows: Sequence[Any]) -> list[tuple[RankRegistration, int]]:
    return [
        (
            RankRegistration.from_json(doc, deployment=deployment, instance=name, rank=number),
            generation,
        )
        for name, number, doc, generation in rows
    ]


async def upsert_instance(session: AsyncSession, reg: RankRegistration, now: datetime) -> None:
    """Creates the instance, or re-states its layout from an admitted rank.

    The layout only changes when no other live rank pinned it: the checks have just refused any
    registration that disagrees with a live rank of the instance.
    """
    row = await session.get(Instance, (reg.deployment, reg.instance))
    if row is None:
        row = Instance(deployment=reg.deployment, name=reg.instance, created_at=now)
        session.add(row)
    row.role = str(reg.role)
    row.tp_size = reg.tp_size
    row.pp_size = reg.pp_size
    row.attention_dp = reg.attention_dp
    row.dp_size = reg.dp_size


async def next_generation(session: AsyncSession, reg: RankRegistration) -> int:
    """Hands out the rank's next generation; numbers are never reused, not even after a delete."""
    counter = await session.get(Generation, (reg.deployment, reg.instance, reg.rank))
    if counter is None:
        counter = Generation(
            deployment=reg.deployment, instance=reg.instance, rank=reg.rank, generation=0
        )
        session.add(counter)
    counter.generation += 1
    return counter.generation


def canonical_digest(reg: RankRegistration) -> str:
    return hashlib.sha256(reg.canonical().encode()).hexdigest()


async def write_rank(
    session: AsyncSession,
    reg: RankRegistration,
    *,
    generation: int,
    at: datetime,
    existing: Rank | None,
) -> Rank:
    """Stores a (new or changed) registration: the rank row and its exploded pools and views."""
    document = reg.to_json()
    if existing is None:
        existing = Rank(deployment=reg.deployment, instance=reg.instance, rank=reg.rank)
        session.add(existing)
    else:
        await delete_children(session, reg.deployment, reg.instance, reg.rank)
    existing.role = str(reg.role)
    existing.generation = generation
    existing.lease_seconds = reg.lease_seconds
    existing.lease_expires_at = at + timedelta(seconds=reg.lease_seconds)
    existing.registered_at = at
    existing.document = document
    existing.canonical_sha256 = canonical_digest(reg)
    await session.flush()  # the rank row must exist before its pools and views reference it
    key = {"deployment": reg.deployment, "instance": reg.instance, "rank": reg.rank}
    if pools := [pool_row(key, pool) for pool in document["pools"]]:
        await session.execute(insert(PoolRow), pools)
    if views := [view_row(key, view) for view in document["views"]]:
        await session.execute(insert(ViewRow), views)
    return existing


async def delete_children(session: AsyncSession, deployment: str, instance: str, rank: int) -> None:
    for table in (PoolRow, ViewRow):
        await session.execute(
            delete(table).where(
                table.deployment == deployment, table.instance == instance, table.rank == rank
            )
        )


def pool_row(key: dict[str, Any], pool: dict[str, Any]) -> dict[str, Any]:
    return {
        **key,
        "pool_id": pool["pool_id"],
        "slot_bytes": pool["slot_bytes"],
        "slot_stride": pool.get("slot_stride", pool["slot_bytes"]),
        "num_slots": pool["num_slots"],
        "memory": pool.get("memory"),
    }


def view_row(key: dict[str, Any], view: dict[str, Any]) -> dict[str, Any]:
    layer_ids: Sequence[int] = [slot["layer"] for slot in view["layers"]]
    return {
        **key,
        "view_id": view["view_id"],
        "pool_id": view["pool_id"],
        "kind": view["kind"],
        "roles": sorted(view["roles"]),
        "owner": view["owner"],
        "num_kv_heads": view.get("num_kv_heads"),
        "total_kv_heads": view.get("total_kv_heads"),
        "buffers_per_layer": view["buffers_per_layer"],
        "bytes_per_layer": view["bytes_per_layer"],
        "num_layers": len(layer_ids),
        "first_layer": min(layer_ids, default=None),
        "last_layer": max(layer_ids, default=None),
        "layers": view["layers"],
    }


async def delete_empty_instances(session: AsyncSession, deployment: str) -> None:
    """Instances exist through their ranks; one whose last rank is gone disappears with it."""
    has_rank = exists().where(
        Rank.deployment == Instance.deployment, Rank.instance == Instance.name
    )
    await session.execute(delete(Instance).where(Instance.deployment == deployment, ~has_rank))
