"""The event log of each deployment: what changed, numbered by a per-deployment revision.

Every write that changes what a worker or router sees appends its events in its own transaction,
under the deployment lock (``ranks.lock_deployment``): registrations, expiries, deletions and the
plan invalidations they imply. The lock makes a deployment's revisions visible in order (a
transaction commits before its lock is released), so a reader that has seen revision ``n`` has seen
every revision below it, and ``revision > n`` is a complete catch-up read on any replica. On
PostgreSQL the transaction also sends ``NOTIFY kvroute_events`` with the deployment's name, delivered
at commit to every replica listening (``kvroute.control.events``).

Kinds, all with the same members (``kvroute.wire.Event``): ``rank_registered`` (a new rank, a new
generation, or a rank admitted again after its lease ended), ``rank_expired`` (found by
``note_expiries``, judged on the replica's clock), ``rank_deleted`` (``data.reason``: deleted,
instance_deleted, lease_revoked, reaped) and ``plans_invalidated`` (one per instance whose plans
changed, after its rank events). Renewals change nothing a reader sees and append nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Integer, and_, bindparam, delete, func, insert, or_, select, true, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvroute import wire
from kvroute.store import bulk
from kvroute.store import ranks as repo
from kvroute.store.dialect import dialect_of
from kvroute.store.engine import (
    SessionMaker,
    autocommit_connection,
    engine_of,
    retry_disconnect,
)
from kvroute.store.models import DeploymentRow, Event, RankRow

CHANNEL = "kvroute_events"
KEEP_PER_DEPLOYMENT = 100_000  # events a watcher can resume from; older ones are trimmed
DEPLOYMENTS = DeploymentRow.__table__
EVENTS = Event.__table__
RANKS = RankRow.__table__


@dataclass(frozen=True, slots=True)
class Change:
    """One event before it has a revision."""

    kind: str
    instance: str | None = None
    rank: int | None = None
    generation: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


def rank_changes(
    kind: str, ranks: Sequence[tuple[str, int, int | None]], **data: Any
) -> list[Change]:
    """``kind`` for each (instance, rank, generation), then ``plans_invalidated`` per instance."""
    changes = [
        Change(kind, instance, rank, generation, dict(data)) for instance, rank, generation in ranks
    ]
    for instance in sorted({instance for instance, _, _ in ranks}):
        changes.append(Change("plans_invalidated", instance, data={"reason": kind}))
    return changes


async def append(
    connection: AsyncConnection, deployment: str, changes: Sequence[Change], at: datetime
) -> int | None:
    """Numbers and stores ``changes`` (the caller holds the deployment lock, and the deployment row
    exists); returns the deployment's new revision, or None when there was nothing to append."""
    if not changes:
        return None
    rows = _rows(deployment, changes, at)
    if dialect_of(connection).arrays:
        values = _appending_values(deployment, rows)
        return int((await connection.execute(_appending_statement(), values)).scalar_one())
    counted = {"deployment": deployment, "count": len(changes)}
    revision = (await connection.execute(REVISION_COUNTER, counted)).scalar_one()
    first = revision - len(changes) + 1
    for index, row in enumerate(rows):
        row["revision"] = first + index
    await connection.execute(EVENT_INSERT, rows)
    return int(revision)


# Elsewhere (SQLite): the revision counted up by ``count``, then the rows inserted; built once.
REVISION_COUNTER = (
    update(DEPLOYMENTS)
    .where(DEPLOYMENTS.c.name == bindparam("deployment"))
    .values(revision=DEPLOYMENTS.c.revision + bindparam("count", type_=Integer()))
    .returning(DEPLOYMENTS.c.revision)
)
EVENT_INSERT = EVENTS.insert()


EVENT_COLUMNS = ("deployment", "at", "kind", "instance", "rank", "generation", "data")


def _rows(deployment: str, changes: Sequence[Change], at: datetime) -> list[dict[str, Any]]:
    return [
        {
            "deployment": deployment,
            "at": at,
            "kind": change.kind,
            "instance": change.instance,
            "rank": change.rank,
            "generation": change.generation,
            "data": change.data or None,
        }
        for change in changes
    ]


def appending_values(deployment: str, changes: Sequence[Change], at: datetime) -> dict[str, Any]:
    """The parameters of ``appending_ctes`` that append ``changes``."""
    return _appending_values(deployment, _rows(deployment, changes, at))


def _appending_values(deployment: str, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    values: dict[str, Any] = {"key_deployment": deployment, "count": len(rows)}
    values.update(bulk.arrays(EVENTS, rows, EVENT_COLUMNS, "changes", numbered="position"))
    return values


@functools.cache
def _appending_statement() -> Any:
    """PostgreSQL: ``append`` in one statement; returns the new revision."""
    numbered, stored = appending_ctes()
    return select(numbered.c.revision).add_cte(stored)


def appending_ctes(generations: Any = None) -> tuple[Any, Any]:
    """PostgreSQL: the revision counted up by ``count``, the changes numbered below it and stored,
    and ``NOTIFY kvroute_events`` sent (delivered at commit), as two CTEs that a write can carry in
    its own statement (``numbered`` returns the new revision; parameters from
    ``appending_values``). ``generations``: a selectable of (instance, rank, generation) counted
    earlier in the same statement; a change without a generation takes its rank's from it."""
    numbered = (
        update(DEPLOYMENTS)
        .where(DEPLOYMENTS.c.name == bindparam("key_deployment"))
        .values(revision=DEPLOYMENTS.c.revision + bindparam("count"))
        .returning(DEPLOYMENTS.c.revision, func.pg_notify(CHANNEL, DEPLOYMENTS.c.name))
        .cte("numbered")
    )
    rows = bulk.unnest_rows(EVENTS, EVENT_COLUMNS, "changes", numbered="position")
    columns = bulk.values(EVENTS, rows, EVENT_COLUMNS)
    numbering = numbered.c.revision - bindparam("count") + rows.c.position
    if generations is None:
        chosen = select(*columns, numbering).join_from(rows, numbered, true())
    else:
        at = EVENT_COLUMNS.index("generation")
        columns[at] = func.coalesce(rows.c.generation, generations.c.generation)
        chosen = (
            select(*columns, numbering)
            .join_from(rows, numbered, true())
            .outerjoin(
                generations,
                and_(generations.c.instance == rows.c.instance, generations.c.rank == rows.c.rank),
            )
        )
    # ``numbered`` has one row: one revision for every change
    stored = insert(EVENTS).from_select([*EVENT_COLUMNS, "revision"], chosen)
    return numbered, stored.cte("stored")


def notifies(engine: AsyncEngine) -> bool:
    """Whether other processes' appends are announced (``listen``), or must be polled for."""
    return dialect_of(engine).notifies


async def listen(
    engine: AsyncEngine, on_grown: Callable[[str], None], on_listening: Callable[[], None]
) -> None:
    """Until cancelled, ``on_grown(deployment)`` each time an append to that deployment's log
    commits, in any process (``NOTIFY`` on ``CHANNEL``, sent by ``append``); ``on_listening`` each
    time listening (re)starts, since what committed before it was not announced."""
    await dialect_of(engine).listen(engine, CHANNEL, on_grown, on_listening)


async def current_revision(sessionmaker: SessionMaker, deployment: str) -> int:
    """The deployment's latest revision (0 before its first event or its first rank)."""

    async def attempt() -> int:
        async with autocommit_connection(engine_of(sessionmaker)) as connection:
            value = await connection.scalar(
                select(DEPLOYMENTS.c.revision).where(DEPLOYMENTS.c.name == deployment)
            )
        return int(value or 0)

    return await retry_disconnect(attempt)


async def read_after(
    sessionmaker: SessionMaker, deployment: str, after: int, limit: int
) -> list[wire.Event]:
    """At most ``limit`` events of ``deployment`` after revision ``after``, in order."""

    async def attempt() -> list[wire.Event]:
        async with autocommit_connection(engine_of(sessionmaker)) as connection:
            rows = await connection.execute(
                select(EVENTS)
                .where(EVENTS.c.deployment == deployment, EVENTS.c.revision > after)
                .order_by(EVENTS.c.revision)
                .limit(limit)
            )
            return [_event(row) for row in rows]

    return await retry_disconnect(attempt)


def _event(row: Any) -> wire.Event:
    return wire.Event(
        revision=row.revision,
        deployment=row.deployment,
        kind=row.kind,
        at=row.at,
        instance=row.instance,
        rank=row.rank,
        generation=row.generation,
        data=row.data or None,
    )


async def note_expiries(sessionmaker: SessionMaker, *, now: datetime) -> int:
    """Appends ``rank_expired`` for every lease that ended by ``now`` and was not reported yet
    (each expiry once, across replicas: the rank row records the expiry it reported); returns
    how many."""
    unnoted = (
        RANKS.c.lease_expires_at <= now,
        or_(
            RANKS.c.expiry_noted_at.is_(None),
            RANKS.c.expiry_noted_at != RANKS.c.lease_expires_at,
        ),
    )
    async with autocommit_connection(engine_of(sessionmaker)) as connection:
        deployments = list(
            await connection.scalars(select(RANKS.c.deployment).where(*unnoted).distinct())
        )
    noted = 0
    for deployment in sorted(deployments):
        async with engine_of(sessionmaker).begin() as connection:
            await repo.lock_deployment_connection(connection, deployment)
            rows = await connection.execute(
                update(RANKS)
                .where(RANKS.c.deployment == deployment, *unnoted)
                .values(expiry_noted_at=RANKS.c.lease_expires_at)
                .returning(RANKS.c.instance, RANKS.c.rank, RANKS.c.generation)
            )
            expired = sorted((instance, rank, generation) for instance, rank, generation in rows)
            await append(connection, deployment, rank_changes("rank_expired", expired), now)
            noted += len(expired)
    return noted


async def trim(sessionmaker: SessionMaker, keep: int = KEEP_PER_DEPLOYMENT) -> None:
    """Drops each deployment's events older than its newest ``keep``."""
    newest = (
        select(DEPLOYMENTS.c.revision)
        .where(DEPLOYMENTS.c.name == EVENTS.c.deployment)
        .scalar_subquery()
    )
    async with engine_of(sessionmaker).begin() as connection:
        await connection.execute(delete(EVENTS).where(EVENTS.c.revision <= newest - keep))
