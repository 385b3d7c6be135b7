"""Database failures, sorted into the two a client can act on, with the cause named for the log.

*Busy*: the database answered too slowly (a statement or lock timeout, a client-side timeout on a
frozen server, no free pooled connection, SQLite's busy wait running out under lock starvation);
retrying shortly is likely to work. *Unavailable*: it could not be reached or the connection broke
(refused, reset, cut, the database missing, authentication failed). Anything else a driver raises
(an integrity or syntax error) is a bug, and is not sorted here.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

# SQLSTATEs (PostgreSQL appendix A) of a database that is too slow rather than gone.
BUSY_SQLSTATES = {
    "57014": "statement timeout",
    "55P03": "lock timeout",
    "53300": "too many connections",
    "40P01": "deadlock detected",
}
# Classes and codes of a database that cannot be used at all.
UNAVAILABLE_SQLSTATE_PREFIXES = {
    "08": "connection failure",
    "57P": "server shutting down or starting",
    "3D": "database does not exist",
    "28": "authentication failed",
}
# What a unit of work may raise when the database is in trouble (``database_fault`` sorts them;
# it declines a driver error that is not an outage).
DATABASE_ERRORS: tuple[type[Exception], ...] = (
    DBAPIError,
    PoolTimeoutError,
    TimeoutError,
    OSError,
)
SQLITE_BUSY_MESSAGES = ("database is locked", "database table is locked")
# Socket errors of an unreachable server (other OSErrors, e.g. a missing file, are bugs).
NETWORK_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EHOSTDOWN,
        errno.ENETDOWN,
        errno.ETIMEDOUT,
        errno.EPIPE,
    }
)


@dataclass(frozen=True, slots=True)
class DatabaseFault:
    busy: bool
    phrase: str  # what happened, in a few words
    detail: str  # the driver's own words: its error type and the first line of its message
    sqlstate: str | None = None  # PostgreSQL's error code, when the server sent one

    @property
    def cause(self) -> str:
        """For the log: ``statement timeout (QueryCanceledError: canceling statement ...)``."""
        return f"{self.phrase} ({self.detail})"


def database_fault(error: BaseException) -> DatabaseFault | None:
    """Busy or unavailable, or None when ``error`` is not a database outage."""
    for link in _chain(error):
        fault = _classify(link)
        if fault is not None:
            return fault
    return None


def _classify(error: BaseException) -> DatabaseFault | None:
    if isinstance(error, PoolTimeoutError):
        return DatabaseFault(True, "no pooled connection free within the timeout", _detail(error))
    if isinstance(error, TimeoutError):
        return DatabaseFault(True, "no answer within the timeout", _detail(error))
    sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    if isinstance(sqlstate, str):
        if sqlstate in BUSY_SQLSTATES:
            return DatabaseFault(True, BUSY_SQLSTATES[sqlstate], _detail(error), sqlstate)
        for prefix, phrase in UNAVAILABLE_SQLSTATE_PREFIXES.items():
            if sqlstate.startswith(prefix):
                return DatabaseFault(False, phrase, _detail(error), sqlstate)
    if isinstance(error, DBAPIError):
        return _classify_dbapi(error)
    if isinstance(error, ConnectionError | socket.gaierror) or (
        isinstance(error, OSError) and error.errno in NETWORK_ERRNOS
    ):
        return DatabaseFault(False, "cannot reach the database", _detail(error))
    return None


def _classify_dbapi(error: DBAPIError) -> DatabaseFault | None:
    message = str(error.orig or error).lower()
    if any(text in message for text in SQLITE_BUSY_MESSAGES):
        return DatabaseFault(True, "SQLite lock wait exceeded the busy timeout", _detail(error))
    if error.connection_invalidated or isinstance(error, InterfaceError):
        return DatabaseFault(False, "connection lost", _detail(error))
    if isinstance(error, OperationalError):
        return DatabaseFault(False, "database failure", _detail(error))
    return None  # the wrapped driver error may still say more (see database_fault's chain)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error, what a DBAPIError wraps, and its causes, each once."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        link = pending.pop(0)
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        orig = getattr(link, "orig", None)
        pending += [orig if isinstance(orig, BaseException) else None]
        pending += [link.__cause__, link.__context__]


def _detail(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
