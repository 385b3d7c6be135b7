"""Upgrading recomputes stored geometry classes: ranks stored with the previous definition (their
whole document less position) get their face's digest, so differently laid out ranks share one."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import insert, select

from kvroute.store import migrate
from kvroute.store.engine import create_engine
from kvroute.store.models import DeploymentRow, InstanceRow, RankRow
from tests.world import Side, ViewClass, instance

BEFORE = "b7e2c4d1f9a0"


def test_upgrade_gives_stored_ranks_their_face_class(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'classes.db'}"
    kv = [ViewClass(("key", "value"), "target", "hnd", 8, 2, 16)]
    side = Side("context", tp_size=2, layers_per_stage=(4,))
    ranks = instance(side, kv, "ctx")[0] + [
        replace(reg, rank=reg.rank + 2) for reg in instance(replace(side, seed=5), kv, "ctx")[0]
    ]
    assert len({reg.views[0].offsets[0] for reg in ranks}) > 1  # laid out differently
    migrate.upgrade(url, BEFORE)
    asyncio.run(store_old_ranks(url, ranks, "stale"))
    migrate.upgrade(url)
    assert asyncio.run(_classes(url)) == {reg.rank: ranks[0].class_digest for reg in ranks}


# ``ranks`` as revisions before 6a2f9c4e8b13 have it (the document in the row), less what later
# revisions added: what the models say now is not what an old database holds.
OLD_RANKS = sa.table(
    "ranks",
    *(sa.column(name) for name in ("deployment", "instance", "rank", "role", "generation")),
    *(sa.column(name) for name in ("lease_seconds", "canonical_sha256", "geometry_class")),
    sa.column("lease_expires_at", RankRow.__table__.c.lease_expires_at.type),
    sa.column("registered_at", RankRow.__table__.c.registered_at.type),
    sa.column("document", sa.JSON),
)


async def store_old_ranks(
    url: str, ranks: list, geometry_class: str, documents: dict[int, dict] | None = None
) -> None:
    """Ranks of instance ``ctx`` of deployment ``world``, stored at an old revision, each with its
    own document or the one ``documents`` gives its rank."""
    now = datetime.now(UTC)
    engine = create_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                insert(DeploymentRow.__table__).values(name="world", created_at=now, checked_at=now)
            )
            await connection.execute(
                insert(InstanceRow.__table__).values(
                    deployment="world",
                    name="ctx",
                    role="context",
                    tp_size=2,
                    pp_size=1,
                    attention_dp=False,
                    dp_size=1,
                    created_at=now,
                )
            )
            for reg in ranks:
                await connection.execute(
                    insert(OLD_RANKS).values(
                        deployment="world",
                        instance="ctx",
                        rank=reg.rank,
                        role="context",
                        generation=1,
                        lease_seconds=30,
                        lease_expires_at=now,
                        registered_at=now,
                        document=(documents or {}).get(reg.rank, reg.to_json()),
                        canonical_sha256=reg.canonical_digest,
                        geometry_class=geometry_class,
                    )
                )
    finally:
        await engine.dispose()


async def _classes(url: str) -> dict[int, str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            table = RankRow.__table__
            rows = await connection.execute(select(table.c.rank, table.c.geometry_class))
            return dict(rows.all())
    finally:
        await engine.dispose()
