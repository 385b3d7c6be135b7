"""Session-level queries and writes for deployments, instances and ranks.

Every function takes the caller's ``AsyncSession`` and never commits: the registry service decides
what one transaction contains. Writes of one deployment are only correct while the caller holds
:func:`lock_deployment`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Update, bindparam, delete, exists, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from kvroute.store.dialect import dialect_of
from kvroute.store.models import InstanceRow, KvPathRow, RankRow


async def lock_deployment(session: AsyncSession, deployment: str) -> None:
    """Serializes writers of one deployment across processes until the transaction ends.

    PostgreSQL: a transaction-scoped advisory lock keyed by the name, which works before the
    deployment row exists (a row lock could not cover the first registration). SQLite: the
    transaction already began with BEGIN IMMEDIATE (see ``engine``), which holds the write lock.
    """
    await lock_deployment_connection(await session.connection(), deployment)


async def lock_deployment_connection(connection: AsyncConnection, deployment: str) -> None:
    """``lock_deployment`` for Core work on a connection inside its transaction."""
    await dialect_of(connection).lock_deployment(connection, deployment)


def rank_update(**values: Any) -> Update:
    """An UPDATE of one rank's row per parameter set, keyed by ``key_deployment``,
    ``key_instance`` and ``key_rank`` (run as an ``executemany`` over many ranks)."""
    return (
        update(RankRow.__table__)
        .where(
            RankRow.deployment == bindparam("key_deployment"),
            RankRow.instance == bindparam("key_instance"),
            RankRow.rank == bindparam("key_rank"),
        )
        .values(**values)
    )


def judged_at_time(checked_at: datetime, now: datetime) -> datetime:
    return max(now, checked_at)


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
        RankRow.deployment == InstanceRow.deployment, RankRow.instance == InstanceRow.name
    )
    await session.execute(
        delete(InstanceRow).where(InstanceRow.deployment == deployment, ~has_rank)
    )
    await forget_paths(session, deployment)


async def forget_paths(session: AsyncSession, deployment: str) -> None:
    """Drops the KV paths (``kv_paths``) whose producer or consumer instance is gone: an instance
    deleted for good would otherwise leave them behind, stale, in every answer. One that comes
    back is a new registration, whose paths are attested again."""

    def gone(name: Any) -> Any:
        return ~exists().where(InstanceRow.deployment == deployment, InstanceRow.name == name)

    paths = KvPathRow.deployment == deployment
    await session.execute(
        delete(KvPathRow).where(paths, gone(KvPathRow.producer) | gone(KvPathRow.consumer))
    )
