"""What the fleet benchmark reads off the server and the database besides its own timings: the
CPU of PostgreSQL's backends, a process's resident memory, and the server's admission metrics."""

from __future__ import annotations

import contextlib
import math
import os
import re

import aiohttp
import asyncpg


async def db_cpu(database: str | None) -> dict[int, float] | None:
    """CPU seconds each backend connected to ``database`` has used so far (this machine's
    PostgreSQL: the load generator reads the backends' /proc entries)."""
    if database is None:
        return None
    admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        rows = await admin.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", database)
    finally:
        await admin.close()
    used = {}
    for row in rows:
        with contextlib.suppress(OSError):  # a backend that ended meanwhile
            used[row["pid"]] = cpu_seconds(row["pid"])
    return used


async def since(database: str | None, before: dict[int, float] | None) -> float | None:
    """CPU seconds the database's backends used since ``before`` (new backends: all of theirs)."""
    after = await db_cpu(database)
    if after is None or before is None:
        return None
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> tuple[float, float]:
    """The process's resident memory and its peak, in MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) / 1024  # kB
    return values["VmRSS"], values["VmHWM"]


async def admission_batches(
    session: aiohttp.ClientSession, base: str
) -> tuple[float, float, float]:
    """(batches, registrations answered, seconds) of the fleet's admission so far."""
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    found = {
        name: float(value)
        for name, value in re.findall(
            r"^kvroute_admission_batch_(ranks_count|ranks_sum|seconds_sum)"
            r'\{deployment="fleet"\} (\S+)$',
            text,
            re.MULTILINE,
        )
    }
    batches, answered, seconds = (
        found.get(name, math.nan) for name in ("ranks_count", "ranks_sum", "seconds_sum")
    )
    return batches, answered, seconds
