"""``kvroute db upgrade|downgrade|current|check``: the schema of KVROUTE_DATABASE_URL."""

from __future__ import annotations

import argparse

from sqlalchemy.engine import make_url

from kvroute.cli.common import CommandError
from kvroute.settings import load_settings


def _db(args: argparse.Namespace) -> int:
    from kvroute.store import migrate

    url = load_settings().database_url
    if args.action in ("upgrade", "downgrade"):
        before = migrate.current(url)
        move = migrate.upgrade if args.action == "upgrade" else migrate.downgrade
        move(url, args.revision)
        print(migration_report(url, before, migrate.current(url), migrate.head()))
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


def migration_report(url: str, before: str | None, after: str | None, head: str) -> str:
    """One line: which database, and from which revision to which (passwords hidden)."""
    where = make_url(url).render_as_string(hide_password=True)

    def name(revision: str | None) -> str:
        if revision is None:
            return "none (empty schema)"
        return f"{revision} (head)" if revision == head else revision

    if before == after:
        return f"{where}: already at {name(after)}; nothing to do"
    return f"{where}: migrated from {name(before)} to {name(after)}"


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
