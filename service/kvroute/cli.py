"""The ``kvroute`` command line: ``serve`` and ``db upgrade|downgrade|current|check``.

Each subcommand is a registrar function that adds its parser and binds a ``run`` callable;
later subcommands (``plan``, ``demo``, ``bench``) join by appending to ``COMMANDS``.
Commands are thin: configuration comes from ``kvroute.settings``, schema work from
``kvroute.store.migrate``, the server from ``kvroute.api``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from rich.console import Console

from kvroute.cli_demo import add_demo
from kvroute.cli_plan import add_plan
from kvroute.settings import Settings, SettingsError, load_settings
from kvroute.store.errors import StoreError

Run = Callable[[argparse.Namespace], int]
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

log = logging.getLogger("kvroute.cli")
stderr = Console(stderr=True, highlight=False)


class CommandError(Exception):
    """A failure the user can fix; printed without a traceback, exit status 2."""


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
    parser = commands.add_parser("serve", help="run the REST service")
    parser.add_argument("--host", help="bind address (default: KVROUTE_HOST or 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (default: KVROUTE_PORT or 8080)")
    parser.set_defaults(run=_serve)


def _db(args: argparse.Namespace) -> int:
    from kvroute.store import migrate

    url = load_settings().database_url
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision)
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision)
    elif args.action == "current":
        print(migrate.current(url) or "none")
    else:
        if not migrate.is_current(url):
            raise CommandError(
                f"the database is not at head {migrate.head()}; run `kvroute db upgrade`"
            )
        migrate.check(url)
        print(f"ok: at head {migrate.head()}, no drift")
    return 0


def add_db(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("db", help="manage the database schema (KVROUTE_DATABASE_URL)")
    actions = parser.add_subparsers(dest="action", required=True)
    upgrade = actions.add_parser("upgrade", help="migrate to a revision (default: head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    downgrade = actions.add_parser("downgrade", help="migrate down to a revision (e.g. base)")
    downgrade.add_argument("revision")
    actions.add_parser("current", help="print the database's revision")
    actions.add_parser("check", help="fail unless at head and the models match the schema")
    parser.set_defaults(run=_db)


COMMANDS: list[Registrar] = [add_serve, add_db, add_plan, add_demo]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="KV-cache routing for disaggregated LLM serving"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (SettingsError, CommandError) as exc:
        stderr.print(f"kvroute: {exc}", markup=False, soft_wrap=True)
        return 2
    except StoreError as exc:  # e.g. schema drift: a finding, not a crash
        stderr.print(f"kvroute: {exc}", markup=False, soft_wrap=True)
        return 1
