"""``kvroute serve``: the REST service on the configured database."""

from __future__ import annotations

import argparse
import logging

from kvroute.cli.common import CommandError
from kvroute.cli.variables import settings_epilog
from kvroute.settings import Settings, load_settings

log = logging.getLogger("kvroute.cli")


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvroute.api import create_app
    from kvroute.api.access import configure_logging

    overrides = {
        key: value for key in ("host", "port") if (value := getattr(args, key)) is not None
    }
    settings = load_settings(**overrides)
    configure_logging(log_format=settings.log_format, level=settings.log_level)
    prepare_schema(settings)
    log.info("kvroute listening on %s:%d", settings.host, settings.port)
    web.run_app(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        access_log=None,  # kvroute's access middleware writes the one line per request
        print=None,
        shutdown_timeout=settings.shutdown_timeout_seconds,
    )
    return 0


def prepare_schema(settings: Settings) -> None:
    """Embedded SQLite is upgraded in place; a shared PostgreSQL must be migrated explicitly."""
    from kvroute.store import migrate

    if settings.is_sqlite:
        migrate.upgrade(settings.database_url)
        return
    if not migrate.is_current(settings.database_url):
        raise CommandError(
            f"the database schema is at {migrate.current(settings.database_url) or 'no revision'}, "
            f"not {migrate.head()}: run `kvroute db upgrade` first"
        )


def add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "serve",
        help="run the REST service",
        epilog=settings_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", help="bind address (default: KVROUTE_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (default: KVROUTE_PORT or 8080)")
    parser.set_defaults(run=_serve)
