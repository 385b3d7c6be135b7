"""Engine leases: one lease for all the ranks of an engine's process group (etcd's lease model).

An engine grants a lease, registers its ranks with it (``admission`` attaches them and gives them
the lease's expiry), and renews it: one renewal renews every attached rank, and the lease's expiry
expires them all. The fencing rules are a rank's (``kvroute.store.leases``): the lease is judged
at ``max(now, deployments.checked_at)``, an admission that judged it expired fences it, and a fenced
or expired lease never comes back (its id is never handed out again). A rank attached to a live
lease is renewed only while it is itself live and unfenced, so a rank that expired on its own (it
was attached with an older expiry while a renewal committed, or fenced) stays expired: the renewal
answers the ranks it renewed and the engine registers the others again.

Renewals arriving together are renewed together (``control.renewals``, in waves): on PostgreSQL a
wave is one statement in autocommit mode without the deployment lock (each lease row's lock orders
its renewal against an admission fencing the lease); SQLite runs the same steps in one short write
transaction. Each lease is judged at its own clock reading, exactly as alone.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BindParameter, bindparam, delete, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvroute.geometry import RankRegistration
from kvroute.store import events, leases
from kvroute.store import ranks as repo
from kvroute.store.dialect import dialect_of
from kvroute.store.engine import (
    SessionMaker,
    autocommit_connection,
    engine_of,
    reading,
    retry_disconnect,
)
from kvroute.store.errors import LeaseExpired, NotFound
from kvroute.store.models import DeploymentRow, EngineLeaseRow, RankRow, UTCDateTime
from kvroute.store.records import LeaseRecord

LEASES = EngineLeaseRow.__table__
# A deployment's ``checked_at`` (parameter ``deployment``), built once.
CHECKED_AT = select(DeploymentRow.checked_at).where(DeploymentRow.name == bindparam("deployment"))
RANKS = RankRow.__table__


@dataclass(frozen=True, slots=True)
class LeaseTerms:
    """What an admitted rank's lease row says: its expiry, its length and its engine lease."""

    expires_at: datetime
    lease_seconds: int
    engine_lease: str | None = None


def own_terms(reg: RankRegistration, at: datetime) -> LeaseTerms:
    """A rank keeping a lease of its own: ``lease_seconds`` from ``at``."""
    return LeaseTerms(at + timedelta(seconds=reg.lease_seconds), reg.lease_seconds)


def missing(deployment: str, lease_id: str) -> LeaseExpired:
    return LeaseExpired(
        f"engine lease {lease_id!r} of deployment {deployment!r} is unknown or expired; "
        "grant a new lease and register its ranks again"
    )


async def grant(
    sessionmaker: SessionMaker, deployment: str, lease_seconds: int, *, now: datetime
) -> LeaseRecord:
    """A new lease, live until ``max(now, checked_at) + lease_seconds``, keeping no rank yet."""
    lease_id = uuid.uuid4().hex

    async def attempt() -> datetime:
        async with engine_of(sessionmaker).begin() as connection:
            checked = await connection.scalar(CHECKED_AT, {"deployment": deployment})
            expires = max(now, checked or now) + timedelta(seconds=lease_seconds)
            await connection.execute(
                LEASES.insert().values(
                    deployment=deployment,
                    lease_id=lease_id,
                    lease_seconds=lease_seconds,
                    granted_at=now,
                    expires_at=expires,
                    fenced_at=None,
                )
            )
            return expires

    expires = await retry_disconnect(attempt)
    return LeaseRecord(deployment, lease_id, lease_seconds, expires, ())


Renewal = tuple[str, datetime]  # lease id, the clock reading of its renewal
# What a renewal answers: the lease's new expiry, its length and the ranks it renewed.
Renewed = tuple[datetime, int, tuple[tuple[str, int], ...]]


async def renew(
    sessionmaker: SessionMaker, deployment: str, lease_id: str, *, now: datetime
) -> LeaseRecord:
    """Renews the lease and every live, unfenced rank it keeps; raises ``LeaseExpired`` for an
    unknown, expired or fenced lease."""
    renewed = await renew_many(engine_of(sessionmaker), deployment, [(lease_id, now)])
    return record(deployment, lease_id, renewed.get(lease_id))


def record(deployment: str, lease_id: str, renewed: Renewed | None) -> LeaseRecord:
    """The renewal's answer, or ``LeaseExpired`` raised when it did not take."""
    if renewed is None:
        raise missing(deployment, lease_id)
    expires, seconds, ranks = renewed
    return LeaseRecord(deployment, lease_id, seconds, expires, ranks)


async def renew_many(
    engine: AsyncEngine, deployment: str, renewals: Sequence[Renewal]
) -> dict[str, Renewed]:
    """Renews the leases of a wave (``control.renewals``), each judged at its own clock reading
    exactly as alone; a lease left out is unknown, expired or fenced. Each lease at most once."""
    if dialect_of(engine).arrays:
        values = {
            "deployment": deployment,
            "lease_ids": [lease_id for lease_id, _ in renewals],
            "nows": [now for _, now in renewals],
        }
        rows = await retry_disconnect(lambda: _renew_in_one_statement(engine, values))
    else:
        rows = await retry_disconnect(lambda: _renew_in_a_transaction(engine, deployment, renewals))
    found: dict[str, tuple[datetime, int, list[tuple[str, int]]]] = {}
    for lease_id, expires, seconds, instance, rank in rows:
        entry = found.setdefault(lease_id, (expires, seconds, []))
        if instance is not None:
            entry[2].append((instance, rank))
    return {
        lease_id: (expires, seconds, tuple(sorted(ranks)))
        for lease_id, (expires, seconds, ranks) in found.items()
    }


def _renewal() -> Any:
    """The renewal statement for a wave of leases (rows from ``unnest`` of ids and clock
    readings): each lease, then its ranks, judged at its own instant."""
    return (
        text(
            """
            WITH wave AS (
                SELECT * FROM unnest(
                    CAST(:lease_ids AS varchar[]), CAST(:nows AS timestamptz[])
                ) AS wave(lease_id, now)
            ), judged AS (
                SELECT wave.lease_id, greatest(wave.now, coalesce(
                    (SELECT checked_at FROM deployments WHERE name = :deployment),
                    wave.now)) AS at
                FROM wave
            ), lease AS (
                UPDATE engine_leases
                SET expires_at = judged.at + make_interval(0, 0, 0, 0, 0, 0, lease_seconds)
                FROM judged
                WHERE deployment = :deployment AND engine_leases.lease_id = judged.lease_id
                    AND fenced_at IS NULL AND expires_at > judged.at
                RETURNING engine_leases.lease_id, expires_at, lease_seconds, judged.at
            ), renewed AS (
                UPDATE ranks SET lease_expires_at = lease.expires_at
                FROM lease
                WHERE ranks.deployment = :deployment AND ranks.engine_lease = lease.lease_id
                    AND ranks.fenced_at IS NULL AND ranks.lease_expires_at > lease.at
                RETURNING ranks.engine_lease, ranks.instance, ranks.rank
            )
            SELECT lease.lease_id, lease.expires_at, lease.lease_seconds,
                renewed.instance, renewed.rank
            FROM lease LEFT JOIN renewed ON renewed.engine_lease = lease.lease_id
            """
        )
        .bindparams(bindparam("nows", type_=ARRAY(UTCDateTime())))
        .columns(expires_at=UTCDateTime())
    )


RENEWAL = _renewal()


async def _renew_in_one_statement(engine: AsyncEngine, values: dict[str, Any]) -> list[Any]:
    async with autocommit_connection(engine) as connection:
        return list(await connection.execute(RENEWAL, values))


async def _renew_in_a_transaction(
    engine: AsyncEngine, deployment: str, renewals: Sequence[Renewal]
) -> list[Any]:
    """SQLite: the wave in one write transaction (the write lock held from its start, so what it
    reads is what it updates) and a fixed number of statements, each lease as the statement
    above would renew it."""
    ids = [lease_id for lease_id, _ in renewals]
    reading, writing = _sqlite_renewal()
    async with engine.begin() as connection:
        checked = await connection.scalar(CHECKED_AT, {"deployment": deployment})
        rows = await connection.execute(reading, {"deployment": deployment, "lease_ids": ids})
        current = {lease_id: (seconds, expires) for lease_id, seconds, expires in rows}
        judged = {lease_id: max(now, checked or now) for lease_id, now in renewals}
        terms = {
            lease_id: (judged[lease_id], judged[lease_id] + timedelta(seconds=seconds), seconds)
            for lease_id, (seconds, expires) in current.items()
            if expires > judged[lease_id]
        }
        if not terms:
            return []
        await connection.execute(
            writing,
            [
                {"key_deployment": deployment, "id": lease_id, "expires": new}
                for lease_id, (_, new, _) in terms.items()
            ],
        )
        return await _renew_attached(connection, deployment, terms)


@functools.cache
def _sqlite_renewal() -> tuple[Any, Any]:
    """SQLite's read of a wave's leases and its write of their expiries, built once (building
    statements per wave cost the event loop more than running them)."""
    deployment: BindParameter[str] = bindparam("deployment")
    reading = select(LEASES.c.lease_id, LEASES.c.lease_seconds, LEASES.c.expires_at).where(
        LEASES.c.deployment == deployment,
        LEASES.c.lease_id.in_(bindparam("lease_ids", expanding=True)),
        LEASES.c.fenced_at.is_(None),
    )
    writing = (  # "deployment" would name the column in the SET clause
        update(LEASES)
        .where(
            LEASES.c.deployment == bindparam("key_deployment"),
            LEASES.c.lease_id == bindparam("id"),
        )
        .values(expires_at=bindparam("expires"))
    )
    return reading, writing


@functools.cache
def _attached_statement() -> Any:
    """The unfenced ranks of some leases (parameters ``deployment`` and ``lease_ids``)."""
    return select(
        RANKS.c.engine_lease, RANKS.c.instance, RANKS.c.rank, RANKS.c.lease_expires_at
    ).where(
        RANKS.c.deployment == bindparam("deployment"),
        RANKS.c.engine_lease.in_(bindparam("lease_ids", expanding=True)),
        RANKS.c.fenced_at.is_(None),
    )


async def _renew_attached(
    connection: AsyncConnection,
    deployment: str,
    terms: dict[str, tuple[datetime, datetime, int]],
) -> list[Any]:
    """The ranks of the renewed leases (lease -> judged at, new expiry, seconds) that are live at
    their lease's instant and unfenced, renewed; rows as the PostgreSQL statement returns them."""
    attached = await connection.execute(
        _attached_statement(), {"deployment": deployment, "lease_ids": sorted(terms)}
    )
    renewed: dict[str, list[tuple[str, int]]] = {lease_id: [] for lease_id in terms}
    for lease_id, instance, rank, expires in attached:
        if expires > terms[lease_id][0]:
            renewed[lease_id].append((instance, rank))
    expiries = {
        (instance, rank): terms[lease_id][1]
        for lease_id, ranks in renewed.items()
        for instance, rank in ranks
    }
    await leases.write_expiries(connection, deployment, expiries)
    rows: list[Any] = []
    for lease_id, ranks in renewed.items():
        _, expires, seconds = terms[lease_id]
        # A lease renewed with no rank still answers.
        kept: Sequence[tuple[str | None, int | None]] = ranks or [(None, None)]
        rows += [(lease_id, expires, seconds, instance, rank) for instance, rank in kept]
    return rows


async def get(sessionmaker: SessionMaker, deployment: str, lease_id: str) -> LeaseRecord:
    """The lease (live or not, until the reaper removes it) and the ranks attached to it."""
    async with reading(sessionmaker) as session:
        lease = await session.get(EngineLeaseRow, (deployment, lease_id))
        if lease is None:
            raise NotFound(f"engine lease {lease_id!r} of deployment {deployment!r} does not exist")
        rows = await session.execute(
            select(RankRow.instance, RankRow.rank)
            .where(RankRow.deployment == deployment, RankRow.engine_lease == lease_id)
            .order_by(RankRow.instance, RankRow.rank)
        )
        ranks = tuple((instance, rank) for instance, rank in rows)
    return LeaseRecord(deployment, lease_id, lease.lease_seconds, lease.expires_at, ranks)


async def revoke(
    sessionmaker: SessionMaker, deployment: str, lease_id: str, *, now: datetime
) -> tuple[tuple[str, int], ...]:
    """Removes the lease and every rank it keeps (under the deployment lock); returns the ranks."""
    async with sessionmaker.begin() as session:
        await repo.lock_deployment(session, deployment)
        lease = await session.get(EngineLeaseRow, (deployment, lease_id))
        if lease is None:
            raise NotFound(f"engine lease {lease_id!r} of deployment {deployment!r} does not exist")
        kept = (RankRow.deployment == deployment, RankRow.engine_lease == lease_id)
        rows = await session.execute(
            select(RankRow.instance, RankRow.rank, RankRow.generation).where(*kept)
        )
        gone = sorted((instance, rank, generation) for instance, rank, generation in rows)
        await session.execute(delete(RankRow).where(*kept))
        await session.delete(lease)
        await repo.delete_empty_instances(session, deployment)
        changes = events.rank_changes("rank_deleted", gone, reason="lease_revoked")
        await events.append(await session.connection(), deployment, changes, now)
    return tuple((instance, rank) for instance, rank, _ in gone)


async def live_terms(
    connection: AsyncConnection, deployment: str, lease_ids: set[str], at: datetime
) -> dict[str, LeaseTerms]:
    """The leases among ``lease_ids`` live and unfenced at ``at`` (admission, under the lock)."""
    if not lease_ids:
        return {}
    values = {"deployment": deployment, "lease_ids": sorted(lease_ids), "at": at}
    rows = await connection.execute(_live_terms_statement(), values)
    return {lease: LeaseTerms(expires, seconds, lease) for lease, expires, seconds in rows}


@functools.cache
def _live_terms_statement() -> Any:
    """``live_terms``'s read, built once (parameters ``deployment``, ``lease_ids``, ``at``)."""
    return select(LEASES.c.lease_id, LEASES.c.expires_at, LEASES.c.lease_seconds).where(
        LEASES.c.deployment == bindparam("deployment"),
        LEASES.c.lease_id.in_(bindparam("lease_ids", expanding=True)),
        LEASES.c.fenced_at.is_(None),
        LEASES.c.expires_at > bindparam("at", type_=UTCDateTime()),
    )


async def reap_expired(sessionmaker: SessionMaker, *, cutoff: datetime) -> int:
    """Deletes leases that ended before ``cutoff`` (their ranks, which ended no later, are reaped
    by the same round); returns how many."""
    async with sessionmaker.begin() as session:
        result = await session.execute(
            delete(EngineLeaseRow).where(EngineLeaseRow.expires_at < cutoff)
        )
    return int(getattr(result, "rowcount", 0) or 0)
