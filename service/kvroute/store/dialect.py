"""The one place the store tells PostgreSQL from SQLite.

Everything a hot write or read does differently on the two databases is a member of ``Dialect``,
found from the engine or connection (``dialect_of``); the modules that write state what they write
once and ask the dialect how:

* ``insert``: an INSERT taking ``on_conflict_do_update`` and ``excluded`` (one API on both);
* ``greatest``: the scalar maximum of two values;
* ``lock_deployment``: serializing one deployment's writers across processes;
* ``arrays``: whether a write's rows may travel as one array per column into a single statement of
  data-modifying CTEs (``store.bulk``), and a read's rows come back grouped into arrays. That is
  PostgreSQL, where every statement is a round trip made while the deployment lock is held; SQLite
  has neither arrays nor data-modifying CTEs, and a statement there costs no round trip, so the
  same rows go as ``executemany`` statements inside the write's transaction;
* ``statistics``: whether the planner needs table statistics kept fresh (``store.statistics``:
  PostgreSQL; SQLite's planner assumes an index equality is selective);
* ``listen``: other processes' notifications that a deployment's event log grew (PostgreSQL's
  ``LISTEN`` on a connection of its own; SQLite has none, its readers poll).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from sqlalchemy import String, bindparam, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

RECONNECT_SECONDS = 1.0  # between attempts to reopen a lost listening connection
# Built once: a statement built per call would have its cache key computed each time (a batch of
# admissions takes the lock once, at tens of microseconds of Python a statement).
_ADVISORY_LOCK = select(
    func.pg_advisory_xact_lock(func.hashtextextended(bindparam("deployment", type_=String()), 0))
)


class Dialect:
    """SQLite: the embedded default (one writer, no round trips, no notifications)."""

    name = "sqlite"
    arrays = False
    statistics = False
    notifies = False

    def insert(self, table: Any) -> Any:
        return sqlite.insert(table)

    def greatest(self, left: Any, right: Any) -> Any:
        return func.max(left, right)  # SQLite's two-argument max() is its scalar greatest

    async def lock_deployment(self, connection: AsyncConnection, deployment: str) -> None:
        """Nothing to take: every writing transaction began with BEGIN IMMEDIATE (``engine``),
        which holds the database's write lock until it ends."""

    async def listen(
        self,
        engine: AsyncEngine,
        channel: str,
        on_notify: Callable[[str], None],
        on_listening: Callable[[], None],
    ) -> None:
        raise NotImplementedError(f"{self.name} has no notifications: poll instead")


class Postgres(Dialect):
    name = "postgresql"
    arrays = True
    statistics = True
    notifies = True

    def insert(self, table: Any) -> Any:
        return postgresql.insert(table)

    def greatest(self, left: Any, right: Any) -> Any:
        return func.greatest(left, right)

    async def lock_deployment(self, connection: AsyncConnection, deployment: str) -> None:
        """A transaction-scoped advisory lock keyed by the name: it works before the deployment
        row exists (a row lock could not cover the first registration)."""
        await connection.execute(_ADVISORY_LOCK, {"deployment": deployment})

    async def listen(
        self,
        engine: AsyncEngine,
        channel: str,
        on_notify: Callable[[str], None],
        on_listening: Callable[[], None],
    ) -> None:
        """Calls ``on_notify(payload)`` for each notification on ``channel`` until cancelled, on
        one connection of its own (a pooled one would be returned between statements); reopens it
        when lost and calls ``on_listening`` each time it listens again, so the caller can catch up
        on what was sent meanwhile."""
        import asyncpg

        url = make_url(engine.url).set(drivername="postgresql")
        dsn = url.render_as_string(hide_password=False)
        while True:
            try:
                await _listen_once(await asyncpg.connect(dsn), channel, on_notify, on_listening)
            except (OSError, asyncpg.PostgresError):
                await asyncio.sleep(RECONNECT_SECONDS)


async def _listen_once(
    connection: Any,
    channel: str,
    on_notify: Callable[[str], None],
    on_listening: Callable[[], None],
) -> None:
    """Listens on ``connection`` (asyncpg's) until it is lost."""
    lost = asyncio.Event()
    try:
        connection.add_termination_listener(lambda _connection: lost.set())
        await connection.add_listener(channel, lambda _c, _pid, _ch, payload: on_notify(payload))
        on_listening()
        await lost.wait()
    finally:
        with contextlib.suppress(Exception):
            await connection.close()


SQLITE = Dialect()
POSTGRES = Postgres()  # also for statements only PostgreSQL runs, built once at import
_DIALECTS: dict[str, Dialect] = {SQLITE.name: SQLITE, POSTGRES.name: POSTGRES}


def dialect_of(bind: AsyncEngine | AsyncConnection) -> Dialect:
    """The dialect of an engine or connection; ``ValueError`` for a database kvroute does not run
    on (``settings.SUPPORTED_DRIVERS`` refuses such URLs before an engine is made)."""
    try:
        return _DIALECTS[bind.dialect.name]
    except KeyError:
        raise ValueError(f"kvroute does not run on {bind.dialect.name}") from None
