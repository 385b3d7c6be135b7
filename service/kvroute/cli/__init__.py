"""The ``kvroute`` command line; the entry point is ``kvroute.cli:main``.

The command belongs to the server install (``kvroute[server]``); a worker host installs only
the client set. There, ``kvroute`` says which extra to install in one line instead of an import
traceback: the subcommands are imported only once the server's libraries are known to be there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

# Top-level modules of the ``server`` extra's distributions (``uvloop`` is imported only when
# ``kvroute serve`` starts its loop, which names the missing module itself).
SERVER_MODULES = frozenset(
    {
        "alembic",
        "aiosqlite",
        "asyncpg",
        "cachetools",
        "jsonschema_rs",
        "openapi_core",
        "prometheus_client",
        "pydantic",
        "pydantic_settings",
        "rich",
        "sqlalchemy",
        "uvloop",
        "yaml",
    }
)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from kvroute.cli.main import main as run
    except ModuleNotFoundError as missing:
        if (missing.name or "").partition(".")[0] not in SERVER_MODULES:
            raise
        print(
            f"kvroute: the kvroute command needs the server dependencies (no module named "
            f"{missing.name!r}): pip install 'kvroute[server]'",
            file=sys.stderr,
        )
        return 2
    return run(argv)
