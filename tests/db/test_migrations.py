"""The migrations build exactly the models' schema, both ways, on both databases."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, inspect, text
from sqlalchemy.ext.asyncio import AsyncConnection

from kvroute.store import migrate
from kvroute.store import ranks as repo
from kvroute.store.engine import create_engine
from kvroute.store.models import Base, PoolRow
from tests.conftest import postgres_lock, recreate_schema
from tests.db.test_class_migration import store_old_ranks
from tests.world import Side, ViewClass, instance

REPO_ROOT = Path(__file__).resolve().parents[2]
KVROUTE_TABLES = {table.name for table in Base.metadata.sorted_tables}


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without any table; PostgreSQL is put back at head afterwards for other tests."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
        return
    url = str(request.getfixturevalue("postgres_url"))
    with postgres_lock(url):
        asyncio.run(recreate_schema(url))
        try:
            yield url
        finally:
            asyncio.run(recreate_schema(url))
            migrate.upgrade(url)


def table_names(url: str) -> set[str]:
    async def names() -> set[str]:
        engine = create_engine(url)
        try:
            async with engine.connect() as connection:
                found = await connection.run_sync(lambda sync: inspect(sync).get_table_names())
        finally:
            await engine.dispose()
        return set(found)

    return asyncio.run(names())


def test_upgrade_downgrade_upgrade_round_trip(empty_database_url: str) -> None:
    url = empty_database_url
    assert migrate.current(url) is None

    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head()
    assert table_names(url) == KVROUTE_TABLES | {"alembic_version"}
    migrate.check(url)

    migrate.downgrade(url, "base")
    assert migrate.current(url) is None
    assert table_names(url) <= {"alembic_version"}

    migrate.upgrade(url)
    assert migrate.is_current(url)
    migrate.check(url)


def test_check_finds_no_drift_at_head(database_url: str) -> None:
    migrate.check(database_url)


def test_check_reports_drift(empty_database_url: str) -> None:
    migrate.upgrade(empty_database_url)

    async def drop_index() -> None:
        engine = create_engine(empty_database_url)
        try:
            async with engine.begin() as connection:
                await connection.execute(text("DROP INDEX ix_rejections_at"))
        finally:
            await engine.dispose()

    asyncio.run(drop_index())
    with pytest.raises(migrate.SchemaDrift, match="ix_rejections_at"):
        migrate.check(empty_database_url)


def test_history_has_exactly_one_head() -> None:
    assert len(migrate.heads()) == 1


def test_revision_files_are_date_prefixed() -> None:
    names = [path.name for path in (REPO_ROOT / "migrations" / "versions").glob("*.py")]
    assert names
    assert all(name[:4].isdigit() and name[4] == "_" for name in names), names


async def test_migrations_run_from_inside_an_event_loop(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'loop.db'}"
    migrate.upgrade(url)  # Alembic's env starts its own loop: this must not clash with ours
    assert await asyncio.to_thread(migrate.current, url) == migrate.head()


def test_scripts_found_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert migrate.migrations_dir() == REPO_ROOT / "migrations"


def test_alembic_cli_from_repo_root_uses_kvroute_database_url(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    environment = {**os.environ, "KVROUTE_DATABASE_URL": url}
    alembic = [sys.executable, "-m", "alembic"]
    subprocess.run(
        [*alembic, "upgrade", "head"], cwd=REPO_ROOT, env=environment, check=True, timeout=60
    )
    assert migrate.current(url) == migrate.head()
    result = subprocess.run(
        [*alembic, "check"],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


BEFORE_DOCUMENTS = "9d3b6f1e2a47"  # the last revision with documents in ``ranks``


def test_documents_move_out_of_ranks_and_back_unchanged(empty_database_url: str) -> None:
    """Upgrading across 6a2f9c4e8b13 keeps every rank's document exactly (same JSON text, keys in
    their order), and its pools and views; downgrading puts the documents back into ``ranks``."""
    url = empty_database_url
    kv = [ViewClass(("key", "value"), "target", "hnd", 8, 2, 16)]
    ranks = instance(Side("context", tp_size=2, layers_per_stage=(4,)), kv, "ctx")[0]
    stored = {reg.rank: reg.to_json() for reg in ranks}
    stored[0] = {**stored[0], "note": "é ✓", "zeta": 1.5, "alpha": [None, True]}  # order, unicode
    migrate.upgrade(url, BEFORE_DOCUMENTS)
    asyncio.run(store_old_ranks(url, ranks, "class", documents=stored))
    asyncio.run(_add_pools(url, ranks))

    migrate.upgrade(url)
    assert asyncio.run(_documents(url, "rank_documents")) == _texts(stored)
    assert asyncio.run(_count(url, "pools")) == len(ranks)
    migrate.check(url)

    migrate.downgrade(url, BEFORE_DOCUMENTS)
    assert asyncio.run(_documents(url, "ranks")) == _texts(stored)
    assert asyncio.run(_count(url, "pools")) == len(ranks)


def _texts(documents: dict[int, dict[str, Any]]) -> dict[int, str]:
    return {rank: json.dumps(document) for rank, document in documents.items()}


async def _documents(url: str, table: str) -> dict[int, str]:
    """Each rank's document as JSON text in the order the database hands back its keys."""
    async with _connected(url) as connection:
        rows = await connection.execute(text(f"SELECT rank, document FROM {table}"))
        found = rows.all()
    return {
        rank: json.dumps(json.loads(document) if isinstance(document, str) else document)
        for rank, document in found
    }


async def _add_pools(url: str, ranks: list[Any]) -> None:
    async with _connected(url) as connection:
        for reg in ranks:
            for pool in reg.to_json()["pools"]:
                row = repo.pool_row(
                    {"deployment": "world", "instance": "ctx", "rank": reg.rank}, pool
                )
                await connection.execute(insert(PoolRow.__table__).values(**row))
        await connection.commit()


async def _count(url: str, table: str) -> int:
    async with _connected(url) as connection:
        return int((await connection.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())


@contextlib.asynccontextmanager
async def _connected(url: str) -> AsyncIterator[AsyncConnection]:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            yield connection
    finally:
        await engine.dispose()
