"""What every ``kvroute`` subcommand shares: the user-error type and the stderr console."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rich.console import Console

Run = Callable[[argparse.Namespace], int]
Registrar = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]

stderr = Console(stderr=True, highlight=False)


class CommandError(Exception):
    """A failure the user can fix; printed without a traceback, exit status 2."""
