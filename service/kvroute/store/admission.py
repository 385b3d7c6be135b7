"""Admission: one registration checked and stored in one transaction, at a cost independent of the
deployment's size.

Inside the deployment lock (``ranks.lock_deployment``) an admission:

1. moves the deployment's ``checked_at`` to ``at = max(now, checked_at)`` (the instant every lease
   is judged at) in the same statement that creates the deployment row if needed;
2. fences every rank of the deployment whose lease ended by ``at``: a fenced rank can never be
   renewed by a heartbeat, because this admission did not check it. The fence statement waits for a
   heartbeat still committing on such a row and then sees the renewal, so the rank is read as live
   below and checked; a heartbeat that comes later finds the fence and fails;
3. reads the live ranks of the candidate's own instance, and one representative per geometry class
   of the live ranks of the opposite role (the first in (instance, rank) order: see
   ``geometry.classes``), with their generations; parsed registrations come from the process-wide
   cache by generation, so only documents never seen before are read and parsed;
4. runs the instance check against the members and the peer check against the class
   representatives, with verdicts memoized by the pair of class digests;
5. writes the rank (renewing its lease only, for an identical document).

Every statement is SQLAlchemy Core on one connection: this is the path a fleet coming up hammers.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, insert, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvroute.geometry import RankRegistration
from kvroute.geometry.classes import VerdictMemo, check_peers_by_class
from kvroute.geometry.instance import check_instance
from kvroute.geometry.validate import check_self
from kvroute.store import ranks as repo
from kvroute.store.engine import SessionMaker, engine_of, retry_disconnect
from kvroute.store.models import Deployment, Generation, Instance, PoolRow, Rank, ViewRow
from kvroute.store.records import RegisterOutcome
from kvroute.store.registrations import RegistrationCache

RANKS = Rank.__table__
Row = tuple[str, int, int]  # instance, rank, generation


async def admit(
    sessionmaker: SessionMaker,
    reg: RankRegistration,
    *,
    now: datetime,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
) -> RegisterOutcome:
    """Admits, renews or re-registers ``reg``; raises its ``GeometryError`` changing nothing."""
    # The document alone (no lock needed to refuse it), and the digests computed before the lock,
    # not under it: milliseconds for the largest documents, so not on the event loop either.
    await asyncio.to_thread(_check_and_digest, reg)
    outcome = await retry_disconnect(
        lambda: _admit(engine_of(sessionmaker), reg, now, registrations, verdicts)
    )
    registrations.remember(reg, outcome.generation)
    return outcome


def _check_and_digest(reg: RankRegistration) -> None:
    check_self(reg)
    _ = reg.class_digest, reg.canonical_digest


async def _admit(
    engine: AsyncEngine,
    reg: RankRegistration,
    now: datetime,
    registrations: RegistrationCache,
    verdicts: VerdictMemo,
) -> RegisterOutcome:
    async with engine.begin() as connection:
        await repo.lock_deployment_connection(connection, reg.deployment)
        at = await _judge_at(connection, reg.deployment, now)
        await _fence_expired(connection, reg.deployment, at)
        members, representatives, existing = await _read_peers(connection, reg, at)
        parsed = await registrations.at(reg.deployment, members + representatives, connection)
        check_instance(reg, parsed[: len(members)])
        check_peers_by_class(reg, parsed[len(members) :], verdicts)
        return await write_admitted(connection, reg, at, existing)


async def _judge_at(connection: AsyncConnection, deployment: str, now: datetime) -> datetime:
    """Creates the deployment or moves its ``checked_at`` forward to ``max(now, checked_at)``."""
    table = Deployment.__table__
    statement = _upsert(connection, table).values(name=deployment, created_at=now, checked_at=now)
    newest = _greatest(connection, table.c.checked_at, statement.excluded.checked_at)
    statement = statement.on_conflict_do_update(
        index_elements=[table.c.name], set_={"checked_at": newest}
    ).returning(table.c.checked_at)
    return (await connection.execute(statement)).scalar_one()


async def _fence_expired(connection: AsyncConnection, deployment: str, at: datetime) -> None:
    await connection.execute(
        update(RANKS)
        .where(
            RANKS.c.deployment == deployment,
            RANKS.c.lease_expires_at <= at,
            RANKS.c.fenced_at.is_(None),
        )
        .values(fenced_at=at)
    )


async def _read_peers(
    connection: AsyncConnection, reg: RankRegistration, at: datetime
) -> tuple[list[Row], list[Row], tuple[int, str] | None]:
    """In one statement: the instance's rows, and the first live rank (instance, rank order) of
    each geometry class of the opposite role.

    Returns the live members of the instance other than ``reg``, the class representatives, and
    ``reg``'s own row as (generation, canonical digest) when it has one (live or not).
    """
    position = func.row_number().over(
        partition_by=RANKS.c.geometry_class, order_by=(RANKS.c.instance, RANKS.c.rank)
    )
    peers = (
        select(
            RANKS.c.instance,
            RANKS.c.rank,
            RANKS.c.generation,
            RANKS.c.lease_expires_at,
            RANKS.c.canonical_sha256,
            position.label("position"),
        )
        .where(
            RANKS.c.deployment == reg.deployment,
            RANKS.c.role == reg.role.opposite.value,
            RANKS.c.lease_expires_at > at,
        )
        .subquery()
    )
    members = select(
        RANKS.c.instance,
        RANKS.c.rank,
        RANKS.c.generation,
        RANKS.c.lease_expires_at,
        RANKS.c.canonical_sha256,
        literal(0).label("position"),
    ).where(RANKS.c.deployment == reg.deployment, RANKS.c.instance == reg.instance)
    representatives = select(peers).where(peers.c.position == 1)
    rows = await connection.execute(
        members.union_all(representatives).order_by("position", "instance", "rank")
    )
    own, classes, existing = [], [], None
    for instance, rank, generation, expires, digest, position in rows:
        if position:
            classes.append((instance, rank, generation))
        elif rank == reg.rank:
            existing = (generation, digest)
        elif expires > at:
            own.append((instance, rank, generation))
    return own, classes, existing


async def write_admitted(
    connection: AsyncConnection,
    reg: RankRegistration,
    at: datetime,
    existing: tuple[int, str] | None,
) -> RegisterOutcome:
    """Stores a rank the caller admitted; ``existing`` is its row's (generation, canonical digest)."""
    expires = at + timedelta(seconds=reg.lease_seconds)
    key = and_(
        RANKS.c.deployment == reg.deployment,
        RANKS.c.instance == reg.instance,
        RANKS.c.rank == reg.rank,
    )
    digest = reg.canonical_digest
    if existing is not None and existing[1] == digest:
        await connection.execute(
            update(RANKS).where(key).values(lease_expires_at=expires, fenced_at=None)
        )
        return RegisterOutcome(existing[0], expires, created=False)
    await _upsert_instance(connection, reg, at)
    generation = await _next_generation(connection, reg)
    document = reg.to_json()
    values = {
        "role": reg.role.value,
        "generation": generation,
        "lease_seconds": reg.lease_seconds,
        "lease_expires_at": expires,
        "registered_at": at,
        "document": document,
        "canonical_sha256": digest,
        "geometry_class": reg.class_digest,
        "fenced_at": None,
    }
    if existing is None:
        rank_key = {"deployment": reg.deployment, "instance": reg.instance, "rank": reg.rank}
        await connection.execute(insert(RANKS).values(**rank_key, **values))
    else:
        await connection.execute(update(RANKS).where(key).values(**values))
        for table in (PoolRow.__table__, ViewRow.__table__):
            await connection.execute(delete(table).where(*_child_key(table, reg)))
    await _insert_children(connection, reg, document)
    return RegisterOutcome(generation, expires, created=existing is None)


async def _upsert_instance(
    connection: AsyncConnection, reg: RankRegistration, at: datetime
) -> None:
    """Creates the instance or re-states its layout (the checks just agreed with every member)."""
    table = Instance.__table__
    layout = {
        "role": reg.role.value,
        "tp_size": reg.tp_size,
        "pp_size": reg.pp_size,
        "attention_dp": reg.attention_dp,
        "dp_size": reg.dp_size,
    }
    statement = _upsert(connection, table).values(
        deployment=reg.deployment, name=reg.instance, created_at=at, **layout
    )
    await connection.execute(
        statement.on_conflict_do_update(
            index_elements=[table.c.deployment, table.c.name], set_=layout
        )
    )


async def _next_generation(connection: AsyncConnection, reg: RankRegistration) -> int:
    """The rank's next generation; numbers are never reused, not even after a delete."""
    table = Generation.__table__
    statement = _upsert(connection, table).values(
        deployment=reg.deployment, instance=reg.instance, rank=reg.rank, generation=1
    )
    statement = statement.on_conflict_do_update(
        index_elements=[table.c.deployment, table.c.instance, table.c.rank],
        set_={"generation": table.c.generation + literal(1)},
    ).returning(table.c.generation)
    return int((await connection.execute(statement)).scalar_one())


async def _insert_children(
    connection: AsyncConnection, reg: RankRegistration, document: dict[str, Any]
) -> None:
    key = {"deployment": reg.deployment, "instance": reg.instance, "rank": reg.rank}
    if pools := [repo.pool_row(key, pool) for pool in document["pools"]]:
        await connection.execute(insert(PoolRow.__table__), pools)
    if views := [repo.view_row(key, view) for view in document["views"]]:
        await connection.execute(insert(ViewRow.__table__), views)


def _child_key(table: Any, reg: RankRegistration) -> tuple[Any, ...]:
    return (
        table.c.deployment == reg.deployment,
        table.c.instance == reg.instance,
        table.c.rank == reg.rank,
    )


def _upsert(connection: AsyncConnection, table: Any) -> Any:
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


def _greatest(connection: AsyncConnection, left: Any, right: Any) -> Any:
    # SQLite's two-argument max() is its scalar greatest; its timestamps are ISO strings.
    if connection.dialect.name == "postgresql":
        return func.greatest(left, right)
    return func.max(left, right)
