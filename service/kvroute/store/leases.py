"""Lease renewal: the heartbeat path, the most frequent write a fleet sends.

A lease is judged at ``max(now, deployments.checked_at)`` and renewed only while it is live there
and the rank is not fenced (``kvroute.store.admission`` fences the ranks an admission judged
expired). A rank kept by an engine lease is renewed only through it (``engine_leases``), so its
expiry stays the lease's. On PostgreSQL that is one conditional UPDATE in autocommit mode, without the deployment
lock: a heartbeat never waits for an admission elsewhere in the deployment (only for one fencing
this very rank, which is then expired anyway). SQLite has a single writer: there the same checks
run in Python between one read and one write of the wave, in one short write transaction.

Heartbeats arriving together are renewed together (``kvroute.control.renewals``): one UPDATE over
the wave's (instance, rank, clock reading) rows and one commit, each row judged exactly as a
statement of its own would judge it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, String, bindparam, column, func, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvroute.store import sqlite_driver
from kvroute.store.dialect import dialect_of
from kvroute.store.engine import autocommit_connection, retry_disconnect
from kvroute.store.models import DeploymentRow, RankRow, UTCDateTime

RANKS = RankRow.__table__

RankKey = tuple[str, int]  # instance, rank
Renewal = tuple[str, int, datetime]  # instance, rank, the clock reading of its heartbeat


async def renew(
    engine: AsyncEngine, deployment: str, instance: str, rank: int, now: datetime
) -> datetime | None:
    """The renewed expiry, or None when the rank is unknown, expired or fenced."""
    renewed = await renew_many(engine, deployment, [(instance, rank, now)])
    return renewed.get((instance, rank))


async def renew_many(
    engine: AsyncEngine, deployment: str, renewals: Sequence[Renewal]
) -> dict[RankKey, datetime]:
    """The renewed expiries of the renewals that took; a key left out is unknown, expired or
    fenced. Each rank at most once per call (``Waves(distinct=...)`` sees to it)."""
    if dialect_of(engine).arrays:
        values = {
            "key_deployment": deployment,
            "instances": [instance for instance, _, _ in renewals],
            "ranks": [rank for _, rank, _ in renewals],
            "nows": [now for _, _, now in renewals],
        }
        return await retry_disconnect(lambda: _renew_in_one_statement(engine, values))
    return await retry_disconnect(lambda: _renew_in_a_transaction(engine, deployment, renewals))


def _renewal() -> Any:
    """The heartbeat statement, built once: one compiled form for every wave size, the wave's
    rows coming from ``unnest`` of three arrays."""
    wave = (
        func.unnest(
            bindparam("instances", type_=ARRAY(String())),
            bindparam("ranks", type_=ARRAY(Integer())),
            bindparam("nows", type_=ARRAY(UTCDateTime())),
        )
        .table_valued(column("instance", String()), column("rank", Integer()), column("now"))
        .render_derived(name="wave")
    )
    checked_at = (
        select(DeploymentRow.checked_at)
        .where(DeploymentRow.name == bindparam("key_deployment"))
        .scalar_subquery()
    )
    judged = func.greatest(wave.c.now, checked_at)
    lease = func.make_interval(0, 0, 0, 0, 0, 0, RANKS.c.lease_seconds)
    return (
        update(RANKS)
        .where(
            RANKS.c.deployment == bindparam("key_deployment"),
            RANKS.c.instance == wave.c.instance,
            RANKS.c.rank == wave.c.rank,
            RANKS.c.fenced_at.is_(None),
            RANKS.c.engine_lease.is_(None),
            RANKS.c.lease_expires_at > judged,
        )
        .values(lease_expires_at=judged + lease)
        .returning(RANKS.c.instance, RANKS.c.rank, RANKS.c.lease_expires_at)
    )


RENEWAL = _renewal()


async def _renew_in_one_statement(
    engine: AsyncEngine, values: dict[str, Any]
) -> dict[RankKey, datetime]:
    async with autocommit_connection(engine) as connection:
        rows = (await connection.execute(RENEWAL, values)).all()
    return {(instance, rank): expires for instance, rank, expires in rows}


async def _renew_in_a_transaction(
    engine: AsyncEngine, deployment: str, renewals: Sequence[Renewal]
) -> dict[RankKey, datetime]:
    """SQLite: the wave's rows read in one statement and written in one ``executemany``, each
    judged at its own clock reading as alone (a wave's ranks are distinct), in one write
    transaction on the driver's own calls (``store.sqlite_driver``: four hops to aiosqlite's
    thread a wave)."""
    async with sqlite_driver.write_wave(engine) as wave:
        found = await wave.live_leases(
            deployment, [(instance, rank) for instance, rank, _ in renewals]
        )
        renewed: dict[RankKey, datetime] = {}
        for instance, rank, now in renewals:
            if (row := found.get((instance, rank))) is None:
                continue
            seconds, expires, checked_at = row
            judged = max(now, checked_at)
            if expires > judged:
                renewed[instance, rank] = judged + timedelta(seconds=seconds)
        await wave.write_expiries(deployment, renewed)
    return renewed


async def write_expiries(
    connection: AsyncConnection, deployment: str, expiries: Mapping[RankKey, datetime]
) -> None:
    """SQLite: the new lease expiry of each rank (``sqlite_driver.EXPIRY``) through SQLAlchemy,
    inside the caller's transaction (an engine lease's ranks)."""
    if expiries:
        rows = sqlite_driver.expiry_rows(deployment, expiries)
        await connection.execute(sqlite_driver.EXPIRY, rows)
