"""SQLite's hottest write on the driver's own calls: a heartbeat wave in four hops.

Every call through SQLAlchemy's aiosqlite adapter is three or four hops to aiosqlite's thread and
back (a cursor, the statement, its rows, the cursor's close), each a wake-up of the event loop
through its self-pipe, and the statement is built and looked up in the compiled cache first. A
heartbeat wave (BEGIN IMMEDIATE, one read, one ``executemany``, COMMIT) cost about a dozen hops:
1.8 ms of the event loop's time for a wave of one heartbeat, 2.5 ms for sixteen, most of a
heartbeat's cost on SQLite. aiosqlite's own ``execute``, ``execute_fetchall``, ``executemany``
and ``commit`` are one hop each: 0.4 and 0.9 ms (``bench/sqlite_waves.py``).

Only the wave goes this way; every other statement stays SQLAlchemy Core. The wave's timestamps
travel through the column type's own processors, so they are stored and compared exactly as
SQLAlchemy stores them, and a driver error is raised as SQLAlchemy's ``DBAPIError`` (what
``store.faults`` sorts into busy or unavailable, and ``retry_disconnect`` retries).
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.store.models import DeploymentRow, RankRow
from kvroute.store.ranks import rank_update

RANKS = RankRow.__table__
DEPLOYMENTS = DeploymentRow.__table__
# A rank's new lease expiry, written for many ranks in one ``executemany``: a heartbeat wave's
# (``Wave``, as SQLite text on the driver's calls) and an engine lease's ranks
# (``leases.write_expiries``, through SQLAlchemy).
EXPIRY = rank_update(lease_expires_at=bindparam("expires"))


EXPIRY_ORDER = ("expires", "key_deployment", "key_instance", "key_rank")  # SQLite's, positional


def expiry_rows(
    deployment: str, expiries: Mapping[tuple[str, int], datetime]
) -> list[dict[str, Any]]:
    """``EXPIRY``'s parameters, a row per rank."""
    return [
        {"key_deployment": deployment, "key_instance": instance, "key_rank": rank, "expires": at}
        for (instance, rank), at in expiries.items()
    ]


class Wave:
    """One write transaction of the writer connection, driven through aiosqlite's own calls."""

    def __init__(self, driver: Any, engine: AsyncEngine) -> None:
        self._driver = driver  # aiosqlite.Connection
        dialect = engine.dialect
        stamp = RANKS.c.lease_expires_at.type.dialect_impl(dialect)
        self._to_row: Callable[[Any], Any] = stamp.bind_processor(dialect) or _same
        self._from_row: Callable[[Any], Any] = stamp.result_processor(dialect, None) or _same

    async def live_leases(
        self, deployment: str, keys: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, datetime, datetime]]:
        """(lease seconds, expiry, the deployment's ``checked_at``) of each of ``keys`` a heartbeat
        may renew: known, not fenced, not kept by an engine lease. Read by primary key (instance
        IN, rank IN) and judged here: with the fence and the engine lease in the WHERE clause,
        SQLite's planner walked the (deployment, engine_lease) index, every rank of the
        deployment without an engine lease."""
        wanted = set(keys)
        instances = sorted({instance for instance, _ in wanted})
        ranks = sorted({rank for _, rank in wanted})
        rows = await self._call(
            self._driver.execute_fetchall,
            f"SELECT r.instance, r.rank, r.lease_seconds, r.lease_expires_at, d.checked_at, "
            f"r.fenced_at IS NULL AND r.engine_lease IS NULL "
            f"FROM {RANKS.name} AS r JOIN {DEPLOYMENTS.name} AS d ON d.name = r.deployment "
            f"WHERE r.deployment = ? AND r.instance IN ({_marks(instances)}) "
            f"AND r.rank IN ({_marks(ranks)})",
            [deployment, *instances, *ranks],
        )
        return {
            (instance, rank): (seconds, self._from_row(expires), self._from_row(checked_at))
            for instance, rank, seconds, expires, checked_at, own in rows
            if own and (instance, rank) in wanted
        }

    async def write_expiries(
        self, deployment: str, expiries: dict[tuple[str, int], datetime]
    ) -> None:
        """The new lease expiry of each rank: ``EXPIRY`` in one ``executemany``."""
        if not expiries:
            return
        rows = [
            (self._to_row(at), deployment, instance, rank)
            for (instance, rank), at in expiries.items()
        ]
        await self._call(self._driver.executemany, _expiry_text(), rows)

    async def _call(self, method: Callable[..., Any], statement: str, parameters: Any) -> Any:
        try:
            return await method(statement, parameters)
        except sqlite3.Error as error:
            raise _wrapped(statement, parameters, error) from error


@asynccontextmanager
async def write_wave(engine: AsyncEngine) -> AsyncIterator[Wave]:
    """The writer connection inside BEGIN IMMEDIATE, committed when the block ends, rolled back
    when it raises."""
    async with engine.connect() as connection:
        raw = await connection.get_raw_connection()
        driver = raw.driver_connection
        assert driver is not None, "the pool handed out a closed connection"
        try:
            await driver.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise _wrapped("BEGIN IMMEDIATE", (), error) from error
        try:
            yield Wave(driver, engine)
        except BaseException:
            await driver.rollback()
            raise
        try:
            await driver.commit()
        except sqlite3.Error as error:
            await driver.rollback()
            raise _wrapped("COMMIT", (), error) from error


@functools.cache
def _expiry_text() -> str:
    """``EXPIRY`` as SQLite text, whose positional parameters ``Wave.write_expiries`` binds in
    ``EXPIRY_ORDER`` (checked here, once)."""
    compiled = EXPIRY.compile(dialect=sqlite.dialect())
    if tuple(compiled.positiontup or ()) != EXPIRY_ORDER:
        raise AssertionError(f"EXPIRY binds {compiled.positiontup}, not {EXPIRY_ORDER}")
    return compiled.string


def _same(value: Any) -> Any:
    return value


def _marks(values: Sequence[Any]) -> str:
    return ", ".join("?" * len(values))


def _wrapped(statement: str, parameters: Any, error: sqlite3.Error) -> DBAPIError:
    wrapped = DBAPIError.instance(statement, parameters, error, sqlite3.Error)
    assert isinstance(wrapped, DBAPIError)
    return wrapped
