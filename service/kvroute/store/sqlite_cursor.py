"""SQLite statements in one hop to aiosqlite's thread instead of four.

SQLAlchemy's aiosqlite adapter drives aiosqlite's cursor, and each of its calls is a hop to the
thread that owns the ``sqlite3`` connection and back: the cursor's creation, the statement, its
rows, the cursor's close. Each hop wakes the event loop through its self-pipe and switches
greenlets; an admission batch of 13 statements made about fifty of them, and on SQLite a
registration cost the server twice the CPU it costs on PostgreSQL (issue 34).

``OneHopCursor`` sends one function to that thread per statement: it opens a ``sqlite3`` cursor,
executes, fetches every row (the adapter buffered them all anyway) and closes the cursor there.
What SQLAlchemy then reads (rows, ``description``, ``rowcount``, ``lastrowid``) is what the
four hops returned, and driver errors reach SQLAlchemy's translation exactly as before. Server-side
cursors (``stream``) keep the adapter's own cursor.

The function is queued with aiosqlite's ``Connection._execute``, which every aiosqlite release
SQLAlchemy 2.1 supports has; without it (``one_hop_supported``) the engine keeps the stock adapter.
"""

from __future__ import annotations

import collections
import sqlite3
from collections.abc import Sequence
from typing import Any

import aiosqlite
from sqlalchemy.dialects.sqlite.aiosqlite import (
    AsyncAdapt_aiosqlite_connection,
    AsyncAdapt_aiosqlite_cursor,
    AsyncAdapt_aiosqlite_dbapi,
)
from sqlalchemy.util import EMPTY_DICT
from sqlalchemy.util.concurrency import await_

# (description, rows, rowcount, lastrowid) of one statement, read on aiosqlite's thread
Outcome = tuple[Any, list[Any], int, int | None]


def one_hop_supported() -> bool:
    return callable(getattr(aiosqlite.Connection, "_execute", None))


def dbapi() -> AsyncAdapt_aiosqlite_dbapi:
    """The DBAPI module to hand ``create_engine`` (``module=``) for ``sqlite+aiosqlite``."""
    return OneHopDBAPI(aiosqlite, sqlite3)


def _run(connection: sqlite3.Connection, operation: str, parameters: Any, many: bool) -> Outcome:
    """On aiosqlite's thread: the whole statement, as the adapter's four calls would run it."""
    cursor = connection.cursor()
    try:
        if many:
            cursor.executemany(operation, parameters)
        elif parameters is None:
            cursor.execute(operation)
        else:
            cursor.execute(operation, parameters)
        description = cursor.description
        rows = cursor.fetchall() if description else []
        return description, rows, cursor.rowcount, cursor.lastrowid
    finally:
        cursor.close()


class OneHopCursor(AsyncAdapt_aiosqlite_cursor):
    """A buffered cursor whose statements each cost one hop (see the module)."""

    __slots__ = ("_arraysize", "_outcome")

    def __init__(self, adapt_connection: Any) -> None:
        # No aiosqlite cursor: creating one was a hop of its own.
        self._adapt_connection = adapt_connection
        self._connection = adapt_connection._connection
        self._cursor = None  # type: ignore[assignment]
        self._soft_closed_memoized = EMPTY_DICT
        self._rows = collections.deque()
        self._outcome: Outcome = (None, [], -1, None)
        self._arraysize = 1  # sqlite3's default: what ``fetchmany()`` without a size takes

    @property
    def description(self) -> Any:
        return self._outcome[0]

    @property
    def rowcount(self) -> int:
        return self._outcome[2]

    @property
    def lastrowid(self) -> Any:
        return self._outcome[3]

    @property
    def arraysize(self) -> int:
        return self._arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._arraysize = value

    def execute(self, operation: Any, parameters: Any = None) -> None:
        self._hop(operation, parameters, many=False)

    def executemany(self, operation: Any, seq_of_parameters: Sequence[Any]) -> None:
        self._hop(operation, seq_of_parameters, many=True)

    def _hop(self, operation: Any, parameters: Any, *, many: bool) -> None:
        try:
            self._outcome = await_(self._queued(operation, parameters, many))
        except Exception as error:
            self._adapt_connection._handle_exception(error)
        self._rows = collections.deque(self._outcome[1])

    async def _queued(self, operation: Any, parameters: Any, many: bool) -> Outcome:
        driver = self._connection
        async with self._adapt_connection._execute_mutex:
            outcome: Outcome = await driver._execute(
                _run, driver._conn, operation, parameters, many
            )
            return outcome

    async def _async_soft_close(self) -> None:
        """Nothing to close: the cursor was closed where it ran."""

    def close(self) -> None:
        self._rows.clear()


class OneHopConnection(AsyncAdapt_aiosqlite_connection):
    __slots__ = ()
    _cursor_cls = OneHopCursor


class OneHopDBAPI(AsyncAdapt_aiosqlite_dbapi):
    def connect(self, *arg: Any, **kw: Any) -> AsyncAdapt_aiosqlite_connection:
        connection = super().connect(*arg, **kw)
        # The same slots, so the adapter built above becomes one whose cursors take one hop.
        connection.__class__ = OneHopConnection
        return connection
