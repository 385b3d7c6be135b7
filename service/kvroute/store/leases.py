"""Lease renewal: the heartbeat path, the most frequent write a fleet sends.

A lease is judged at ``max(now, deployments.checked_at)`` and renewed only while it is live there
and the rank is not fenced (``kvroute.store.admission`` fences the ranks an admission judged
expired). On PostgreSQL that is one conditional UPDATE in autocommit mode, without the deployment
lock: a heartbeat never waits for an admission elsewhere in the deployment (only for one fencing
this very rank, which is then expired anyway). SQLite has a single writer: there the same check and
write run in one short write transaction.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, bindparam, func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.store.engine import autocommit_connection, retry_disconnect
from kvroute.store.models import Deployment, Rank, UTCDateTime

RANKS = Rank.__table__


async def renew(
    engine: AsyncEngine, deployment: str, instance: str, rank: int, now: datetime
) -> datetime | None:
    """The renewed expiry, or None when the rank is unknown, expired or fenced."""
    if engine.dialect.name == "postgresql":
        values = {
            "key_deployment": deployment,
            "key_instance": instance,
            "key_rank": rank,
            "now": now,
        }
        return await retry_disconnect(lambda: _renew_in_one_statement(engine, values))
    key = and_(RANKS.c.deployment == deployment, RANKS.c.instance == instance, RANKS.c.rank == rank)
    return await retry_disconnect(lambda: _renew_in_a_transaction(engine, deployment, key, now))


def _renewal() -> Any:
    """The heartbeat statement, built once: SQLAlchemy then reuses its compiled form."""
    checked_at = (
        select(Deployment.checked_at)
        .where(Deployment.name == bindparam("key_deployment"))
        .scalar_subquery()
    )
    judged = func.greatest(bindparam("now", type_=UTCDateTime()), checked_at)
    lease = func.make_interval(0, 0, 0, 0, 0, 0, RANKS.c.lease_seconds)
    return (
        update(RANKS)
        .where(
            RANKS.c.deployment == bindparam("key_deployment"),
            RANKS.c.instance == bindparam("key_instance"),
            RANKS.c.rank == bindparam("key_rank"),
            RANKS.c.fenced_at.is_(None),
            RANKS.c.lease_expires_at > judged,
        )
        .values(lease_expires_at=judged + lease)
        .returning(RANKS.c.lease_expires_at)
    )


RENEWAL = _renewal()


async def _renew_in_one_statement(engine: AsyncEngine, values: dict[str, Any]) -> datetime | None:
    async with autocommit_connection(engine) as connection:
        return (await connection.execute(RENEWAL, values)).scalar_one_or_none()


async def _renew_in_a_transaction(
    engine: AsyncEngine, deployment: str, key: object, now: datetime
) -> datetime | None:
    async with engine.begin() as connection:
        row = (
            await connection.execute(
                select(RANKS.c.lease_seconds, RANKS.c.lease_expires_at, Deployment.checked_at)
                .join(Deployment.__table__, Deployment.name == RANKS.c.deployment)
                .where(key, RANKS.c.fenced_at.is_(None))
            )
        ).first()
        if row is None:
            return None
        judged = max(now, row.checked_at)
        if row.lease_expires_at <= judged:
            return None
        renewed = judged + timedelta(seconds=row.lease_seconds)
        await connection.execute(update(RANKS).where(key).values(lease_expires_at=renewed))
        return renewed
