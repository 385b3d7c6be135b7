"""Planner statistics for the tables a fleet grows, kept fresh by kvroute itself (PostgreSQL).

Without statistics PostgreSQL plans with default selectivities: ``engine_lease IS NULL`` matches
half a percent of a deployment's ranks, and so does ``deployment = $1``. A heartbeat wave then
hashed every rank of the deployment (an estimated one row) instead of probing the wave's keys, and
admission's probes walked whole deployments: each cost grew with the fleet. Autovacuum would
analyze the tables, but only once a minute at best, after a bring-up of thousands of ranks has
already run on the empty table's plans, and not at all where it is switched off.

So each lease-reaper round (``KVROUTE_REAPER_INTERVAL_SECONDS``) analyzes each of these tables
whose rows changed, since it was last analyzed by anyone, by more than ``THRESHOLD_ROWS`` plus
``SCALE`` times its size: about once per doubling while a fleet comes up (a few tens of
milliseconds of a background statement at 8,192 ranks, taking no lock a registration or a
heartbeat waits for), then never while the fleet only renews its leases. The counts come from
PostgreSQL's own statistics views, so replicas share them and do not analyze twice.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.store.dialect import dialect_of
from kvroute.store.engine import autocommit_connection
from kvroute.store.models import (
    EngineLeaseRow,
    Event,
    Generation,
    InstanceRow,
    PoolRow,
    RankDocumentRow,
    RankRow,
    ViewRow,
)

TABLES = tuple(
    row.__tablename__
    for row in (
        RankRow,
        RankDocumentRow,
        PoolRow,
        ViewRow,
        InstanceRow,
        Generation,
        EngineLeaseRow,
        Event,
    )
)
THRESHOLD_ROWS = 200
SCALE = 0.5

_STALE = text(
    """
    SELECT s.relname
    FROM pg_stat_user_tables AS s JOIN pg_class AS c ON c.oid = s.relid
    WHERE s.schemaname = current_schema() AND s.relname = ANY(:tables)
      AND s.n_mod_since_analyze > :threshold + :scale * greatest(c.reltuples, 0)
    ORDER BY s.relname
    """
)


async def refresh(engine: AsyncEngine) -> list[str]:
    """Analyzes the tables whose statistics are stale (see the module); returns their names.
    Nothing on SQLite, whose planner assumes an index equality is selective."""
    if not dialect_of(engine).statistics:
        return []
    async with autocommit_connection(engine) as connection:
        values = {"tables": list(TABLES), "threshold": THRESHOLD_ROWS, "scale": SCALE}
        stale = list(await connection.scalars(_STALE, values))
        for table in stale:  # names from TABLES only: quoting a known identifier
            await connection.execute(text(f'ANALYZE "{table}"'))
    return stale
