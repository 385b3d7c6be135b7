"""A database that is too slow answers 503 ``database_busy``, one that is gone ``database_unavailable``.

The registration lock is held by another connection (SQLite's write lock, PostgreSQL's advisory
lock of the deployment) so the database stays up but the registration cannot get in: a bounded
wait, then 503 with ``Retry-After`` and a log line that names the cause. Frozen and cut servers are
``tests/faults``' subject (a TCP proxy in front of PostgreSQL).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from kvroute.api import create_app
from kvroute.settings import Settings
from tests.api.conftest import WORKER, rank_path, register
from tests.api.documents import rank_document
from tests.conftest import _asyncpg_dsn

UNREACHABLE_DATABASE = "postgresql+asyncpg://postgres@127.0.0.1:1/kvroute"
SHORT_WAITS = {
    "sqlite_busy_timeout_seconds": 0.3,
    "database_lock_timeout_seconds": 0.3,
    "database_statement_timeout_seconds": 2.0,
}


@contextmanager
def sqlite_write_lock(url: str) -> Iterator[None]:
    connection = sqlite3.connect(make_url(url).database, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        yield
        connection.execute("ROLLBACK")
    finally:
        connection.close()


@asynccontextmanager
async def postgres_deployment_lock(url: str, deployment: str) -> AsyncIterator[None]:
    connection = await asyncpg.connect(_asyncpg_dsn(url))
    try:
        transaction = connection.transaction()
        await transaction.start()
        await connection.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", deployment
        )
        yield
        await transaction.rollback()
    finally:
        await connection.close()


@asynccontextmanager
async def registration_lock_held(url: str) -> AsyncIterator[None]:
    if make_url(url).get_backend_name() == "sqlite":
        with sqlite_write_lock(url):
            yield
    else:
        async with postgres_deployment_lock(url, "llama"):
            yield


async def test_a_registration_starved_of_its_lock_is_503_database_busy(
    make_client, database_url, caplog
):
    client = await make_client(**SHORT_WAITS)
    async with registration_lock_held(database_url):
        with caplog.at_level(logging.WARNING, logger="kvroute.api.errors"):
            response = await client.put(rank_path("ctx0", 0), json=rank_document(), headers=WORKER)
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert (await response.json(content_type=None))["code"] == "database_busy"
    sqlite = make_url(database_url).get_backend_name() == "sqlite"
    cause = "SQLite lock wait exceeded the busy timeout" if sqlite else "lock timeout"
    assert any(f"database busy: {cause}" in record.getMessage() for record in caplog.records)
    # The lock is free again: the same request goes through on the same process.
    status, _ = await register(client, "ctx0", 0, rank_document())
    assert status == 201


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_sqlite_heartbeat_starved_of_the_write_lock_is_503_database_busy(
    make_client, database_url, caplog
):
    """The heartbeat wave runs on the driver's own calls (``store.sqlite_driver``): its lock wait
    still answers 503 ``database_busy``, and the lease is renewed once the lock is free."""
    client = await make_client(**SHORT_WAITS)
    assert (await register(client, "ctx0", 0, rank_document()))[0] == 201
    heartbeat = rank_path("ctx0", 0) + "/heartbeat"
    with sqlite_write_lock(database_url):
        with caplog.at_level(logging.WARNING, logger="kvroute.api.errors"):
            response = await client.post(heartbeat, headers=WORKER)
        assert response.status == 503
        assert response.headers["Retry-After"] == "1"
        assert (await response.json(content_type=None))["code"] == "database_busy"
    cause = "database busy: SQLite lock wait exceeded the busy timeout"
    assert any(cause in record.getMessage() for record in caplog.records)
    renewed = await client.post(heartbeat, headers=WORKER)
    assert renewed.status == 200, await renewed.text()


async def test_an_unreachable_database_is_503_unavailable_with_retry_after(aiohttp_client, caplog):
    settings = Settings(database_url=UNREACHABLE_DATABASE, readiness_timeout_seconds=2)
    client = await aiohttp_client(create_app(settings))
    with caplog.at_level(logging.WARNING, logger="kvroute.api.errors"):
        response = await client.put(rank_path("ctx0", 0), json=rank_document())
    assert response.status == 503
    assert response.headers["Retry-After"] == "2"
    assert (await response.json(content_type=None))["code"] == "database_unavailable"
    assert any(
        "database unavailable: cannot reach the database (ConnectionRefusedError" in r.getMessage()
        for r in caplog.records
    )
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert ready.headers["Retry-After"] == "1"


async def test_every_503_carries_retry_after(client):
    await client.app.shutdown()  # draining: mutations are refused
    refused = await client.put(rank_path("ctx0", 0), json=rank_document(), headers=WORKER)
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    ready = await client.get("/readyz")
    assert (ready.status, ready.headers["Retry-After"]) == (503, "1")
