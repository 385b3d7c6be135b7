"""What every ``kvroute`` subcommand shares: the user-error type, the stderr console, and the one-line
explanations of the everyday ways a database cannot be used."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from sqlalchemy.engine import make_url

Run = Callable[[argparse.Namespace], int]
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

stderr = Console(stderr=True, highlight=False)


class CommandError(Exception):
    """A failure the user can fix; printed without a traceback, exit status 2."""


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turns an unreachable, missing or inaccessible database into one ``CommandError`` line."""
    _check_sqlite_directory(url)
    try:
        yield
    except CommandError:
        raise
    except Exception as error:
        message = explain_database_failure(url, error)
        if message is None:
            raise
        raise CommandError(message) from None


def _check_sqlite_directory(url: str) -> None:
    """A SQLite file can only be created in a writable directory; say so before the driver fails."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return
    directory = Path(parsed.database).parent
    if not directory.is_dir():
        raise CommandError(
            f"the directory {directory} of the SQLite database does not exist: create it or set "
            "KVROUTE_DATABASE_URL"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CommandError(
            f"the directory {directory} of the SQLite database is not writable by this user: "
            "fix its permissions or set KVROUTE_DATABASE_URL"
        )


def explain_database_failure(url: str, error: BaseException) -> str | None:
    """What is wrong and what to do, or None when ``error`` is not about reaching the database."""
    from kvroute.store.faults import database_fault

    parsed = make_url(url)
    fault = database_fault(error)
    if parsed.get_backend_name() == "sqlite":
        if fault is None:
            return None
        return (
            f"cannot open the SQLite database {parsed.database}: {fault.detail}; check that it "
            "is a SQLite file this user can write, or set KVROUTE_DATABASE_URL"
        )
    where = f"PostgreSQL at {parsed.host or 'localhost'}:{parsed.port or 5432}"
    shown = parsed.render_as_string(hide_password=True)
    if fault is None:
        return None
    if fault.sqlstate == "3D000":
        return (
            f"database {parsed.database!r} does not exist on {where}: create it (createdb "
            f"{parsed.database}) or point KVROUTE_DATABASE_URL at another one"
        )
    if fault.sqlstate is not None and fault.sqlstate.startswith("28"):
        return (
            f"{where} refused user {parsed.username!r}: fix the credentials in KVROUTE_DATABASE_URL"
        )
    if fault.busy:
        return f"{where} did not answer in time ({fault.detail}); is it overloaded or hung?"
    return (
        f"cannot reach {where} ({fault.detail}); is it running, and is "
        f"KVROUTE_DATABASE_URL={shown} right?"
    )
