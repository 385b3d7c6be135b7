"""Where a profiled server spent its time: the top frames of py-spy's collapsed stacks.

``scale_bench.py --profile DIR`` writes one file of collapsed stacks per server
(``frame;frame;... count``, a frame being ``function (path:line)``). This prints, per file, the
share of samples that had each function on the stack (inclusive) and at the top (self), the
largest first, with paths shortened to the package they belong to:

    python bench/profile_summary.py DIR/baseline-0.txt DIR/postgres-0.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tables import figures_table

FRAME = re.compile(r"^(?P<function>.*?) \((?P<path>.*?)(?::\d+)?\)$")
PACKAGE_ROOTS = ("site-packages/", "service/", "lib/python3.11/")


def frame_name(frame: str) -> str:
    """``render (…/site-packages/sqlalchemy/orm/loading.py:123)`` -> ``sqlalchemy.orm.loading.render``."""
    match = FRAME.match(frame)
    if match is None:
        return frame
    path = match["path"]
    for root in PACKAGE_ROOTS:
        if root in path:
            path = path.rsplit(root, 1)[1]
            break
    module = path.removesuffix(".py").replace("/", ".")
    return f"{module}.{match['function']}"


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(frame_name(frame) for frame in stack.split(";"))] += int(count)
    return stacks


def shares(stacks: Counter[tuple[str, ...]]) -> tuple[int, Counter[str], Counter[str]]:
    """Total samples, and per function the samples it was on the stack for and on top for."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for frames, count in stacks.items():
        for function in set(frames):
            inclusive[function] += count
        own[frames[-1]] += count
    return sum(stacks.values()), inclusive, own


def summary(path: Path, top: int) -> Table:
    total, inclusive, own = shares(read_stacks(path))
    table = figures_table(f"{path.name}: {total:,} samples", ("function",), ("on stack", "self"))
    interesting = [name for name, _ in inclusive.most_common() if not _is_plumbing(name)]
    for name in interesting[:top]:
        table.add_row(name, f"{inclusive[name] / total:.1%}", f"{own[name] / total:.1%}")
    return table


PLUMBING = (
    "asyncio.",
    "<frozen runpy>.",
    "threading.",
    "<module>",
    "kvroute.__main__",
    "kvroute.cli.",
    "aiohttp.web.",
    "aiohttp.web_app.",
    "aiohttp.web_protocol.",
    "aiohttp.web_middlewares.",
    "kvroute.api.errors.error_boundary",
)


def _is_plumbing(name: str) -> bool:
    """Frames under every request (the interpreter's entry, the server, the middleware chain)
    say nothing about where the time went."""
    return name.startswith(PLUMBING) or name.endswith("_middleware")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    console = Console()
    for path in args.files:
        console.print(summary(path, args.top))


if __name__ == "__main__":
    main()
