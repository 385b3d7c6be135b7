"""Store-test fixtures: an engine and sessionmaker on the parametrised ``database_url``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.store.engine import SessionMaker, create_engine, dispose, make_sessionmaker
from kvroute.store.models import Base


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url)
    yield engine
    await dispose(engine)


@pytest.fixture
def sessionmaker(engine: AsyncEngine) -> SessionMaker:
    return make_sessionmaker(engine)


async def dump_tables(engine: AsyncEngine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every kvroute table, in a stable order: a snapshot to compare."""
    snapshot: dict[str, list[tuple[Any, ...]]] = {}
    async with engine.connect() as connection:
        for table in Base.metadata.sorted_tables:
            rows = await connection.execute(select(table))
            snapshot[table.name] = sorted((tuple(row) for row in rows), key=repr)
    return snapshot
