"""The rank registry's units of work, one transaction each (admission itself: ``admission``).

``kvroute.control`` calls these with the app's sessionmaker (``Registry`` the writes, ``Inventory``
the reads); the functions own their transactions and return plain records
(``kvroute.store.records``, ``kvroute.wire``). Two rules make the registry safe to run as
several kvroute processes over one database:

* Writers of a deployment serialize on a database lock (``ranks.lock_deployment``) before reading
  the peers they check against, so two incompatible ranks registering at once cannot both pass.
* Only live ranks are peers, and an expired rank never comes back through a heartbeat: while it was
  expired an incompatible rank may have been admitted, so it must register again and be checked.
  Leases are judged no earlier than the deployment's latest admission (``DeploymentRow.checked_at``),
  so a late heartbeat carrying an older clock reading cannot slip under that rule either.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, case, delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from kvroute import wire
from kvroute.geometry import GeometryError
from kvroute.store import events, leases
from kvroute.store import ranks as repo
from kvroute.store.engine import (
    SessionMaker,
    affected_rows,
    autocommit_connection,
    engine_of,
    reading,
)
from kvroute.store.errors import HeldByEngineLease, LeaseExpired, NotFound
from kvroute.store.models import DeploymentRow, InstanceRow, RankDocumentRow, RankRow
from kvroute.store.records import RankName, lease_state
from kvroute.store.rejections import (
    DEFAULT_LOG_SIZE,
    insert_rejection,
    select_rejections,
    trim_rejections,
)

INSTANCE_SUMMARY_FIELDS = tuple(field.name for field in dataclasses.fields(wire.InstanceSummary))


def _rank_is(deployment: str, instance: str, rank: int) -> ColumnElement[bool]:
    """One rank's row, by its key."""
    return and_(
        RankRow.deployment == deployment, RankRow.instance == instance, RankRow.rank == rank
    )


def _not_registered(deployment: str, instance: str, rank: int) -> NotFound:
    return NotFound(f"rank {rank} of instance {instance!r} in {deployment!r} is not registered")


async def record_rejection(
    sessionmaker: SessionMaker,
    error: GeometryError,
    *,
    deployment: str,
    instance: str,
    rank: int,
    now: datetime,
    keep: int = DEFAULT_LOG_SIZE,
) -> None:
    """Logs a refusal in its own transaction."""
    async with sessionmaker.begin() as session:
        await insert_rejection(
            session, error, deployment=deployment, instance=instance, rank=rank, at=now
        )
        await trim_rejections(session, keep)


async def list_rejections(
    sessionmaker: SessionMaker, limit: int = DEFAULT_LOG_SIZE
) -> list[wire.Rejection]:
    """The newest ``limit`` refusals, newest first."""
    async with reading(sessionmaker) as session:
        return await select_rejections(session, limit)


async def heartbeat(
    sessionmaker: SessionMaker, deployment: str, instance: str, rank: int, *, now: datetime
) -> datetime:
    """Renews a live rank's lease by its ``lease_seconds`` and returns the new expiry.

    One conditional UPDATE, without the deployment lock: it renews only an unfenced rank whose lease
    is live at ``max(now, checked_at)``, so it never waits for an admission and never revives a rank
    an admission skipped (see ``kvroute.store.admission``). Raises ``NotFound`` for an unknown rank
    and ``LeaseExpired`` (a ``NotFound``) for an expired or fenced one, whatever the grace period:
    the worker must register again.
    """
    renewed = await leases.renew(engine_of(sessionmaker), deployment, instance, rank, now)
    if renewed is not None:
        return renewed
    raise await heartbeat_refusal(sessionmaker, deployment, instance, rank, now=now)


async def heartbeat_refusal(
    sessionmaker: SessionMaker, deployment: str, instance: str, rank: int, *, now: datetime
) -> NotFound | HeldByEngineLease:
    """Why a renewal did not take: the rank is unknown (``NotFound``), its lease ended
    (``LeaseExpired``), or an engine lease keeps it (``HeldByEngineLease``)."""
    async with autocommit_connection(engine_of(sessionmaker)) as connection:
        row = (
            await connection.execute(
                select(RankRow.lease_expires_at, RankRow.engine_lease, RankRow.fenced_at).where(
                    _rank_is(deployment, instance, rank)
                )
            )
        ).first()
    if row is None:
        return _not_registered(deployment, instance, rank)
    found = row.lease_expires_at
    if row.engine_lease is not None and row.fenced_at is None and found > now:
        return HeldByEngineLease(
            f"rank {rank} of instance {instance!r} in {deployment!r} is kept by engine lease "
            f"{row.engine_lease!r}; renew that lease instead"
        )
    return LeaseExpired(
        f"the lease of rank {rank} of instance {instance!r} in {deployment!r} expired at "
        f"{found.isoformat()}; register the rank again"
    )


async def get_rank(
    sessionmaker: SessionMaker, deployment: str, instance: str, rank: int, *, now: datetime
) -> wire.Rank:
    async with reading(sessionmaker) as session:
        found = (
            await session.execute(
                select(RankRow, RankDocumentRow.document)
                .join_from(RankRow, RankDocumentRow)
                .where(_rank_is(deployment, instance, rank))
            )
        ).first()
    if found is None:
        raise _not_registered(deployment, instance, rank)
    row, document = found
    return wire.Rank(
        deployment=row.deployment,
        instance=row.instance,
        rank=row.rank,
        role=row.role,
        generation=row.generation,
        state=lease_state(row.lease_expires_at, now),
        lease_seconds=row.lease_seconds,
        lease_expires_at=row.lease_expires_at,
        registered_at=row.registered_at,
        document=document,
    )


async def delete_rank(
    sessionmaker: SessionMaker,
    deployment: str,
    instance: str,
    rank: int,
    *,
    now: datetime | None = None,
) -> None:
    """Removes a rank (its pools and views cascade); an instance left without ranks goes too."""
    async with sessionmaker.begin() as session:
        await repo.lock_deployment(session, deployment)
        deleted = await session.scalar(
            delete(RankRow)
            .where(_rank_is(deployment, instance, rank))
            .returning(RankRow.generation)
        )
        if deleted is None:
            raise _not_registered(deployment, instance, rank)
        await repo.delete_empty_instances(session, deployment)
        changes = events.rank_changes("rank_deleted", [(instance, rank, deleted)], reason="deleted")
        await events.append(await session.connection(), deployment, changes, now or _now())


async def delete_instance(
    sessionmaker: SessionMaker, deployment: str, instance: str, *, now: datetime | None = None
) -> None:
    """Removes an instance with all its ranks, pools and views."""
    async with sessionmaker.begin() as session:
        await repo.lock_deployment(session, deployment)
        ranks = await session.execute(
            select(RankRow.rank, RankRow.generation)
            .where(RankRow.deployment == deployment, RankRow.instance == instance)
            .order_by(RankRow.rank)
        )
        gone = [(instance, rank, generation) for rank, generation in ranks]
        deleted = await affected_rows(
            session,
            delete(InstanceRow).where(
                InstanceRow.deployment == deployment, InstanceRow.name == instance
            ),
        )
        if deleted == 0:
            raise NotFound(f"instance {instance!r} of deployment {deployment!r} does not exist")
        await repo.forget_paths(session, deployment)
        changes = events.rank_changes("rank_deleted", gone, reason="instance_deleted")
        await events.append(await session.connection(), deployment, changes, now or _now())


def _now() -> datetime:
    return datetime.now(UTC)


async def count_live_ranks(sessionmaker: SessionMaker, *, now: datetime) -> int:
    async with reading(sessionmaker) as session:
        count = await session.scalar(
            select(func.count()).select_from(RankRow).where(RankRow.lease_expires_at > now)
        )
    return count or 0


async def reap_expired(
    sessionmaker: SessionMaker, *, now: datetime, grace: timedelta
) -> list[RankName]:
    """Deletes ranks whose lease ended more than ``grace`` ago; returns them, in order.

    One transaction per deployment, under its lock, so reaping never races a registration that
    is re-creating the same instance (and the ranks read are exactly the ranks deleted).
    """
    cutoff = now - grace
    async with reading(sessionmaker) as session:
        deployments = list(
            await session.scalars(
                select(RankRow.deployment).where(RankRow.lease_expires_at < cutoff).distinct()
            )
        )
    reaped: list[RankName] = []
    for deployment in sorted(deployments):
        async with sessionmaker.begin() as session:
            await repo.lock_deployment(session, deployment)
            doomed = (RankRow.deployment == deployment, RankRow.lease_expires_at < cutoff)
            rows = await session.execute(
                select(RankRow.instance, RankRow.rank, RankRow.generation).where(*doomed)
            )
            gone = sorted((instance, rank, generation) for instance, rank, generation in rows)
            reaped += [RankName(deployment, instance, rank) for instance, rank, _ in gone]
            await session.execute(delete(RankRow).where(*doomed))
            await repo.delete_empty_instances(session, deployment)
            changes = events.rank_changes("rank_deleted", gone, reason="reaped")
            await events.append(await session.connection(), deployment, changes, now)
    return reaped


async def list_deployments(
    sessionmaker: SessionMaker, *, now: datetime
) -> list[wire.DeploymentSummary]:
    """Every deployment with its instance count and live/expired rank counts, by name."""
    async with reading(sessionmaker) as session:
        deployments = list(
            await session.scalars(select(DeploymentRow).order_by(DeploymentRow.name))
        )
        instances = await session.execute(
            select(InstanceRow.deployment, func.count()).group_by(InstanceRow.deployment)
        )
        per_deployment: dict[str, int] = {name: count for name, count in instances}
        counts = await _rank_counts(session, now, RankRow.deployment)
    return [
        wire.DeploymentSummary(
            name=row.name,
            created_at=row.created_at,
            instances=per_deployment.get(row.name, 0),
            live_ranks=counts.get(row.name, (0, 0))[0],
            expired_ranks=counts.get(row.name, (0, 0))[1],
        )
        for row in deployments
    ]


async def get_deployment(
    sessionmaker: SessionMaker, name: str, *, now: datetime
) -> wire.Deployment:
    """A deployment with a summary (role, layout, rank counts) of each of its instances."""
    async with reading(sessionmaker) as session:
        row = await session.get(DeploymentRow, name)
        if row is None:
            raise NotFound(f"deployment {name!r} does not exist")
        instances = await _instance_summaries(session, name, now)
    return wire.Deployment(
        name=row.name,
        created_at=row.created_at,
        live_ranks=sum(item.live_ranks for item in instances),
        expired_ranks=sum(item.expired_ranks for item in instances),
        instances=tuple(instances),
        pairing=_pairing(row.pairing),
    )


def _pairing(stored: dict[str, Any] | None) -> wire.Pairing | None:
    if stored is None:
        return None
    return wire.Pairing(require=tuple(stored["require"]), prefer=tuple(stored["prefer"]))


async def list_instances(
    sessionmaker: SessionMaker, deployment: str, *, now: datetime
) -> list[wire.InstanceSummary]:
    async with reading(sessionmaker) as session:
        if await session.get(DeploymentRow, deployment) is None:
            raise NotFound(f"deployment {deployment!r} does not exist")
        return await _instance_summaries(session, deployment, now)


async def get_instance(
    sessionmaker: SessionMaker, deployment: str, instance: str, *, now: datetime
) -> wire.Instance:
    """An instance's layout and each of its ranks with generation and lease state."""
    async with reading(sessionmaker) as session:
        row = await session.get(InstanceRow, (deployment, instance))
        if row is None:
            raise NotFound(f"instance {instance!r} of deployment {deployment!r} does not exist")
        ranks = list(
            await session.scalars(
                select(RankRow)
                .where(RankRow.deployment == deployment, RankRow.instance == instance)
                .order_by(RankRow.rank)
            )
        )
    summaries = tuple(
        wire.RankSummary(
            rank=rank.rank,
            role=rank.role,
            generation=rank.generation,
            state=lease_state(rank.lease_expires_at, now),
            registered_at=rank.registered_at,
            lease_expires_at=rank.lease_expires_at,
        )
        for rank in ranks
    )
    live = sum(summary.state == "live" for summary in summaries)
    summary = _instance_summary(row, live, len(summaries) - live)
    return wire.Instance(
        **{name: getattr(summary, name) for name in INSTANCE_SUMMARY_FIELDS},
        deployment=deployment,
        ranks=summaries,
    )


async def _instance_summaries(
    session: AsyncSession, deployment: str, now: datetime
) -> list[wire.InstanceSummary]:
    rows = await session.scalars(
        select(InstanceRow).where(InstanceRow.deployment == deployment).order_by(InstanceRow.name)
    )
    counts = await _rank_counts(session, now, RankRow.instance, RankRow.deployment == deployment)
    return [_instance_summary(row, *counts.get(row.name, (0, 0))) for row in rows]


def _instance_summary(row: InstanceRow, live: int, expired: int) -> wire.InstanceSummary:
    return wire.InstanceSummary(
        name=row.name,
        role=row.role,
        tp_size=row.tp_size,
        pp_size=row.pp_size,
        attention_dp=row.attention_dp,
        dp_size=row.dp_size,
        created_at=row.created_at,
        live_ranks=live,
        expired_ranks=expired,
        cp_size=row.cp_size,
    )


async def _rank_counts(
    session: AsyncSession,
    now: datetime,
    key: InstrumentedAttribute[str],
    *where: ColumnElement[bool],
) -> dict[str, tuple[int, int]]:
    """(live, expired) rank counts grouped by ``key``."""
    live = func.sum(case((RankRow.lease_expires_at > now, 1), else_=0))
    rows = await session.execute(select(key, live, func.count()).where(*where).group_by(key))
    return {name: (int(alive), total - int(alive)) for name, alive, total in rows}
