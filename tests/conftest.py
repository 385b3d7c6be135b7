"""Shared fixtures: one ``database_url`` that runs a test on SQLite and on PostgreSQL.

Both databases are built by the real Alembic migrations, never by ``metadata.create_all``, so every
test also exercises the migrations. SQLite: a temp-file database per test, copied from a template
migrated once per session. PostgreSQL: the ``kvroute_test`` database (created when missing), its
schema rebuilt from scratch once per session and its tables emptied before each test.

Several pytest processes on this machine may share the PostgreSQL database (each helper runs its
own suite), so a PostgreSQL test holds an exclusive file lock for its duration; tests of different
processes interleave but never overlap. Select one backend with ``-m postgres`` / ``-m "not
postgres"``; ``KVROUTE_TEST_POSTGRES_URL`` points the suite at another server or database.

Under pytest-xdist (``scripts/test.sh`` runs the suite that way) each worker has its own database,
the URL's name suffixed with the worker id (``kvroute_test_gw0``), so the workers of one run never
wait for each other's lock; a module's tests run on one worker (``--dist loadfile``: module-scoped
fixtures such as live servers, the browser and owner processes are set up once), modules with slow
tests first.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from kvroute.store import migrate
from kvroute.store.models import Base

LOCK_WAIT_SECONDS = 600.0


def _worker_url(url: str) -> str:
    """``url`` with the pytest-xdist worker id appended to its database name (unchanged without
    xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return url
    parsed = make_url(url)
    return parsed.set(database=f"{parsed.database}_{worker}").render_as_string(hide_password=False)


POSTGRES_URL = _worker_url(
    os.environ.get(
        "KVROUTE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/kvroute_test"
    )
)


REAL_ENGINES = "tests/realpd/"


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, except that every real-engine module is one unit of work: their engines
    run one cluster at a time (``tests/realpd/conftest.py``'s lock), so two workers each holding
    one would leave one of them waiting on the lock instead of running other modules."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RealEnginesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return REAL_ENGINES if scope.startswith(REAL_ENGINES) else scope

    return RealEnginesTogether(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist (only workers collect), modules with slow tests first, each in its own order: with
    ``--dist loadfile`` and ``--no-loadscope-reorder`` they start first and the short ones fill in
    around them. The real-engine modules come last, as one unit: their engines take both cores,
    and tests that time a server's start or a copy (faults, leases, live servers) missed their
    bounds beside them (seen in CI: kvroute not ready in 90 s)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (REAL_ENGINES in item.nodeid, item.path not in slow))


def _asyncpg_dsn(url: str, database: str | None = None) -> str:
    parsed = make_url(url).set(drivername="postgresql")
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.render_as_string(hide_password=False)


@contextmanager
def postgres_lock(url: str) -> Iterator[None]:
    database = make_url(url).database
    path = Path(tempfile.gettempdir()) / f"kvroute-test-{database}.lock"
    with path.open("a") as handle:
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{path} held by another test process for {LOCK_WAIT_SECONDS} s")
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


async def recreate_schema(url: str) -> None:
    """Creates the database if missing and empties its public schema."""
    database = make_url(url).database
    admin = await asyncpg.connect(_asyncpg_dsn(url, "postgres"))
    try:
        exists = await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if not exists:
            await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    connection = await asyncpg.connect(_asyncpg_dsn(url))
    try:
        await connection.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    finally:
        await connection.close()


async def _truncate(url: str) -> None:
    tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
    connection = await asyncpg.connect(_asyncpg_dsn(url))
    try:
        await connection.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    finally:
        await connection.close()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "kvroute.db"
    migrate.upgrade(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The PostgreSQL test database, rebuilt by the migrations once per session."""
    with postgres_lock(POSTGRES_URL):
        asyncio.run(recreate_schema(POSTGRES_URL))
        migrate.upgrade(POSTGRES_URL)
    return POSTGRES_URL


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    """A fresh SQLite database file at the head revision, private to this test."""
    path = tmp_path / "kvroute.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture
def postgres_test_url(postgres_url: str) -> Iterator[str]:
    """The PostgreSQL database at head with empty tables, exclusively held by this test."""
    with postgres_lock(postgres_url):
        if migrate.current(postgres_url) != migrate.head():
            asyncio.run(recreate_schema(postgres_url))  # a test elsewhere left it mid-migration
            migrate.upgrade(postgres_url)
        asyncio.run(_truncate(postgres_url))
        yield postgres_url


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def database_url(request: pytest.FixtureRequest) -> str:
    """An empty kvroute database at the head revision: SQLite and PostgreSQL (same tests)."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_test_url"
    return str(request.getfixturevalue(fixture))
