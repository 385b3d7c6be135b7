"""Watching leases for operators: rank counts per instance, and which leases just ended.

Read-only and approximate by design: they judge leases against the caller's clock (not a
deployment's last admission, as admissions do), which is what a metric or a log line needs.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import case, func, select

from kvroute.store.engine import SessionMaker, reading
from kvroute.store.models import RankRow
from kvroute.store.records import RankName


async def rank_counts(
    sessionmaker: SessionMaker, *, now: datetime
) -> dict[tuple[str, str], tuple[int, int]]:
    """(deployment, instance) -> (live, expired) ranks; an instance without ranks is absent."""
    live = func.sum(case((RankRow.lease_expires_at > now, 1), else_=0))
    async with reading(sessionmaker) as session:
        rows = await session.execute(
            select(RankRow.deployment, RankRow.instance, live, func.count()).group_by(
                RankRow.deployment, RankRow.instance
            )
        )
        return {
            (deployment, instance): (int(alive), int(total) - int(alive))
            for deployment, instance, alive, total in rows
        }


async def expired_between(
    sessionmaker: SessionMaker, *, after: datetime, until: datetime
) -> list[tuple[RankName, datetime]]:
    """Ranks whose lease ended in ``(after, until]``, with when, oldest first.

    Consecutive windows report every expiry once (a rank that renews and expires again is
    reported again); a rank re-registered before a window is read is not reported.
    """
    window = (RankRow.lease_expires_at > after, RankRow.lease_expires_at <= until)
    async with reading(sessionmaker) as session:
        rows = await session.execute(
            select(RankRow.deployment, RankRow.instance, RankRow.rank, RankRow.lease_expires_at)
            .where(*window)
            .order_by(RankRow.lease_expires_at, RankRow.deployment, RankRow.instance, RankRow.rank)
        )
        return [
            (RankName(deployment, instance, rank), ended)
            for deployment, instance, rank, ended in rows
        ]
