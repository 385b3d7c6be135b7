"""The bounded log of refused registrations, so admins can see what was turned away and why.

A refusal leaves no trace in the peer tables; this log is the only place it is remembered, and it
keeps only the newest entries so a misconfigured worker retrying in a loop cannot grow the database.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from kvroute import wire
from kvroute.geometry import GeometryError
from kvroute.store.models import RejectionRow

DEFAULT_LOG_SIZE = 1000


async def insert_rejection(
    session: AsyncSession,
    error: GeometryError,
    *,
    deployment: str,
    instance: str,
    rank: int,
    at: datetime,
) -> None:
    session.add(
        RejectionRow(
            at=at,
            deployment=deployment,
            instance=instance,
            rank=rank,
            stage=error.stage,
            code=error.code,
            field=error.field,
            detail=error.detail,
            problem=error.to_problem(),
        )
    )
    await session.flush()


async def trim_rejections(session: AsyncSession, keep: int) -> None:
    """Deletes all but the ``keep`` newest entries (ids grow with insertion order)."""
    oldest_kept = (
        select(RejectionRow.id).order_by(RejectionRow.id.desc()).offset(keep - 1).limit(1)
    ).scalar_subquery()
    await session.execute(delete(RejectionRow).where(RejectionRow.id < oldest_kept))


async def select_rejections(session: AsyncSession, limit: int) -> list[wire.Rejection]:
    """The newest ``limit`` entries, newest first."""
    rows = await session.scalars(select(RejectionRow).order_by(RejectionRow.id.desc()).limit(limit))
    return [
        wire.Rejection(
            id=row.id,
            at=row.at,
            deployment=row.deployment,
            instance=row.instance,
            rank=row.rank,
            stage=row.stage,
            code=row.code,
            field=row.field,
            detail=row.detail,
            problem=row.problem,
        )
        for row in rows
    ]
