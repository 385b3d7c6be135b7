"""The ``kvroute`` command line: ``serve``, ``db``, ``plan``, ``describe``, ``check``, ``demo``
and ``proxy``.

Each subcommand module has a registrar that adds its parser and binds a ``run`` callable.
Commands are thin: configuration comes from ``kvroute.settings``, schema work from
``kvroute.store.migrate``, the server from ``kvroute.api``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import kvroute
from kvroute.cli.common import CommandError, Registrar, stderr
from kvroute.cli.db import add_db
from kvroute.cli.demo import add_demo
from kvroute.cli.plan import add_plan
from kvroute.cli.preflight import add_check, add_describe
from kvroute.cli.proxy import add_proxy
from kvroute.cli.serve import add_serve
from kvroute.settings import SettingsError
from kvroute.store.errors import StoreError

COMMANDS: list[Registrar] = [
    add_serve,
    add_db,
    add_plan,
    add_describe,
    add_check,
    add_demo,
    add_proxy,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute", description="KV-cache routing for disaggregated LLM serving"
    )
    parser.add_argument("--version", action="version", version=f"kvroute {kvroute.__version__}")
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
