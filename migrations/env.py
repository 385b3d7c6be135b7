"""Alembic environment for kvroute: async drivers, SQLite-safe batch mode, drift detection.

The URL comes from, in order: the caller (``kvroute.store.migrate`` passes it as the
``database_url`` attribute), ``KVROUTE_DATABASE_URL``, then ``sqlalchemy.url`` in alembic.ini. A
caller that already holds a connection can pass it as the ``connection`` attribute and migrations
run on it (Alembic's connection-sharing recipe). Migrations run through ``run_sync`` on an async
engine, so the same ``sqlite+aiosqlite``/``postgresql+asyncpg`` URL serves the app and Alembic.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.types import TypeDecorator

from kvroute.store.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name)

target_metadata = Base.metadata


def database_url() -> str:
    url = (
        config.attributes.get("database_url")
        or os.environ.get("KVROUTE_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise RuntimeError("no database URL: set KVROUTE_DATABASE_URL or sqlalchemy.url")
    return url


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """Renders kvroute's own column types as their portable implementation.

    Migrations must not import application types: a later change to the model code would then
    silently rewrite history.
    """
    if type_ == "type" and isinstance(obj, TypeDecorator):
        return f"sa.{obj.impl!r}"
    return False


def configure(**options: Any) -> None:
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite can only ALTER by copying tables; a no-op on PostgreSQL
        compare_type=True,
        render_item=render_item,
        **options,
    )


def run_migrations_offline() -> None:
    configure(url=database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    # NullPool: a migration run is one connection, and the engine must not outlive the event loop.
    engine = create_async_engine(database_url(), poolclass=pool.NullPool)
    try:
        if engine.dialect.name == "sqlite":
            # WAL is a property of the file: set here, where nothing else is connected. A server's
            # connection switching a file into WAL while another connection reads it fails with
            # "database is locked" once the busy timeout runs out (CI, once, two engines racing).
            async with engine.connect() as connection:
                await connection.exec_driver_sql("PRAGMA journal_mode=WAL")
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    shared: Connection | None = config.attributes.get("connection")
    if shared is not None:
        do_run_migrations(shared)
    else:
        asyncio.run(run_async_migrations())


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
