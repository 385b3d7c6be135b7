"""Issue 34: what one registration, renewal and matrix cost as the fleet grows, as ratios against
the smallest fleet measured in the same invocation.

``scale_bench.py --sizes 1024,8192`` registers scale_bench's fleet (16-rank instances: context
TP8 x PP2 and generation TP4 x PP4, interleaved) at each size, on a fresh database each, once per
configuration (``--configs postgres,sqlite``), lease mode (``--lease-modes per-rank,engine``: every
rank its own lease, or an engine lease per 8 ranks granted beforehand, untimed) and ``--layouts``
(``random``: every rank lays out its slot its own way). Every rank is registered by a PUT of its
own. Then, per run:

* renewals: 8,000 heartbeats of random ranks (per-rank) or renewals of random engine leases;
* the compatibility matrix, first and repeated, on the replica that admitted the fleet;
* a fresh replica (a second ``kvroute serve`` on the same database, started after registration):
  its first matrix, which reads and parses every live rank's document;
* the server's resident memory (RSS, and its peak) once all of that is done.

One table per configuration and lease mode, a column per size, and each larger size's ratio to
the smallest. The targets are issue 34's, for 8,192 ranks on a 2-core machine shared with the load
generator: registration <= 10 s with the last quarter's p50 within 1.3x of the first's, >= 3,000
ranks kept live per second (a heartbeat keeps one, an engine lease's renewal its 8), matrix <= 100
ms, a fresh replica's first matrix <= 1 s.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from sqlalchemy.engine import make_url

import server_readings
from kvroute.live import LiveServer
from tables import figures_table

RENEWALS = 8000
RANKS_PER_INSTANCE = 16  # scale_bench's fleet
MATRIX_PATH = "/v1/deployments/fleet/compatibility"


@dataclass
class SizeRun:
    """What one fleet size measured."""

    ranks: int
    register: Any = None  # scale_bench.Phase
    renewals: Any = None
    ranks_per_renewal: int = 1  # an engine lease keeps fleet_phases.RANKS_PER_LEASE ranks
    # PostgreSQL's CPU seconds (the bench database's backends) per phase; None on SQLite.
    register_db_cpu: float | None = None
    renewals_db_cpu: float | None = None
    matrix_first: float = 0.0
    matrix_repeated: list[float] = field(default_factory=list)
    fresh_matrix: float = 0.0
    rss_mib: float = 0.0
    peak_rss_mib: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and the end
    # From the server's /metrics after registration (nan where it has no such metric): admission
    # batches, registrations they answered, and seconds they took.
    batches: tuple[float, float, float] = (math.nan, math.nan, math.nan)


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--sizes",
        help="fleet sizes in ranks, comma-separated (e.g. 1024,8192): issue 34's run, ratios "
        "against the first size; with --configs postgres,sqlite, --lease-modes, --layouts",
    )


def run(bench: Any, args: Any) -> None:
    sizes = [int(size) for size in args.sizes.split(",")]
    configs = [c for c in args.configs.split(",") if c in ("postgres", "sqlite")]
    for config in configs:
        for mode in args.lease_modes.split(","):
            for layouts in args.layouts.split(","):
                title = f"{config}, {mode} leases, {layouts} layouts"
                if args.baseline:
                    _against_baseline(bench, args, (config, mode, layouts), sizes, title)
                    continue
                runs = [_one_size(bench, args, config, mode, layouts, size) for size in sizes]
                report(title, runs)


def _against_baseline(
    bench: Any, args: Any, run_: tuple[str, str, str], sizes: list[int], title: str
) -> None:
    """``--baseline``: at each size the baseline tree, then this one, back to back (the machine's
    load drifts over minutes); a table per tree, then this tree's figures over the baseline's."""
    config, mode, layouts = run_
    old_config = "baseline" if config == "postgres" else f"baseline-{config}"
    baseline, current = [], []
    for size in sizes:
        baseline.append(_one_size(bench, args, old_config, mode, layouts, size))
        current.append(_one_size(bench, args, config, mode, layouts, size))
    report(f"baseline ({args.baseline}), {title}", baseline)
    report(title, current)
    for old, new in zip(baseline, current, strict=True):
        report_pair(f"{new.ranks:,} ranks: this tree over the baseline", old, new)


def _one_size(bench: Any, args: Any, config: str, mode: str, layouts: str, size: int) -> SizeRun:
    tree = args.baseline if config.startswith("baseline") else bench.SERVICE
    with (
        tempfile.TemporaryDirectory() as workdir,
        bench.servers(config, Path(workdir), args.baseline) as running,
    ):
        label = f"{config}-{mode}-{layouts}-{size}"
        with bench.profiled(running, args.profile, label):
            result = SizeRun(size)
            started_load = os.getloadavg()[0]
            asyncio.run(_measure(bench, running[0].url, args, (config, mode, layouts), result))
            result.fresh_matrix = _fresh_replica_matrix(
                bench, running[0], (Path(workdir), tree), (args.profile, f"{label}-fresh")
            )
            result.rss_mib, result.peak_rss_mib = server_readings.rss_mib(running[0].process.pid)
            result.load = (started_load, os.getloadavg()[0])
    return result


async def _measure(
    bench: Any, base: str, args: Any, run_: tuple[str, str, str], result: SizeRun
) -> None:
    """Registration, renewals and the matrix; ``run_`` is (configuration, lease mode, layouts)."""
    import fleet_phases

    config, mode, layouts = run_
    rng = random.Random(args.seed)
    ranks = bench.fleet(max(1, result.ranks // (2 * RANKS_PER_INSTANCE)))
    result.ranks = len(ranks)
    connector = aiohttp.TCPConnector(limit=bench.CLIENTS)
    timeout = aiohttp.ClientTimeout(total=bench.REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        leases = await fleet_phases._grant(session, base, bench, ranks) if mode == "engine" else {}
        register = [
            bench.expect(
                "PUT",
                fleet_phases._put_path(bench, name, reg.rank, leases),
                201,
                bench._document(reg, name, layouts, args.seed),
            )
            for name, reg in ranks
        ]
        database = _database(bench, config)
        cpu = await server_readings.db_cpu(database)
        result.register = await bench.drive(session, [base], "register", register)
        result.register_db_cpu = await server_readings.since(database, cpu)
        result.batches = await server_readings.admission_batches(session, base)
        if mode == "engine":
            result.ranks_per_renewal = fleet_phases.RANKS_PER_LEASE
            paths = [
                f"/v1/deployments/fleet/leases/{lease}" for lease in sorted(set(leases.values()))
            ]
        else:
            paths = [bench.rank_path(name, reg.rank) for name, reg in ranks]
        renew = [
            bench.expect("POST", rng.choice(paths) + "/heartbeat", 200) for _ in range(RENEWALS)
        ]
        cpu = await server_readings.db_cpu(database)
        result.renewals = await bench.drive(session, [base], "renewals", renew)
        result.renewals_db_cpu = await server_readings.since(database, cpu)
        first, repeated = await bench.matrix_phases(session, base)
        result.matrix_first, result.matrix_repeated = first.seconds, repeated.latencies


def _database(bench: Any, config: str) -> str | None:
    """The bench database's name where this run is on PostgreSQL."""
    on_postgres = config in ("postgres", "baseline")
    return make_url(bench.POSTGRES_URL).database if on_postgres else None


def _fresh_replica_matrix(
    bench: Any, serving: LiveServer, where: tuple[Path, Path], profile: tuple[Path | None, str]
) -> float:
    """A second server of the ``tree`` that serves, on the same database, started now: the time
    of its first matrix (under ``--profile``, recorded from its start to its first matrix's end)."""
    workdir, tree = where
    directory = workdir / "fresh-replica"
    directory.mkdir()
    fresh = LiveServer(
        directory,
        database_url=serving.database_url,
        tokens=(bench.WORKER_TOKEN, bench.ADMIN_TOKEN),
        env={"KVROUTE_REPLICA_ID": "bench-fresh", "PYTHONPATH": str(tree)},
    )
    fresh.start()
    try:
        with bench.profiled([fresh], *profile):
            return asyncio.run(_time_matrix(bench, fresh.url))
    finally:
        fresh.stop()


async def _time_matrix(bench: Any, base: str) -> float:
    timeout = aiohttp.ClientTimeout(total=bench.REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        matrix = bench.expect("GET", MATRIX_PATH, 200, token=bench.ADMIN_TOKEN)
        started = time.perf_counter()
        await matrix(session, base)
        return time.perf_counter() - started


# (measure, value of a run, "time" (lower is better) | "rate" (higher is better) | "" (no ratio))
def _measures(runs: list[SizeRun]) -> list[tuple[str, list[float], str, str]]:
    ms = 1e3
    rows = [
        ("register: total s (<= 10 s at 8,192)", [r.register.seconds for r in runs], "time", ".1f"),
        ("register: ms per rank", [r.register.seconds / r.ranks * ms for r in runs], "time", ".2f"),
        (
            "register: p50 ms, first quarter",
            [r.register.quarter_p50(0) * ms for r in runs],
            "time",
            ".1f",
        ),
        (
            "register: p50 ms, last quarter",
            [r.register.quarter_p50(3) * ms for r in runs],
            "time",
            ".1f",
        ),
        (
            "register: p50 last / first quarter (<= 1.3x)",
            [r.register.quarter_p50(3) / r.register.quarter_p50(0) for r in runs],
            "",
            ".2f",
        ),
        ("register: p99 ms", [r.register.percentile(0.99) * ms for r in runs], "time", ".1f"),
        (
            "register: server CPU ms per rank",
            [(r.register.server_cpu or 0.0) / r.ranks * ms for r in runs],
            "time",
            ".2f",
        ),
        (  # group admission: how many registrations each transaction took, and for how long
            "register: admission batches, mean ranks each",
            [r.batches[1] / r.batches[0] for r in runs],
            "",
            ".1f",
        ),
        (
            "register: admission batch, mean ms",
            [r.batches[2] / r.batches[0] * ms for r in runs],
            "time",
            ".2f",
        ),
        (
            "register: PostgreSQL CPU ms per rank",
            [_per(r.register_db_cpu, r.ranks) for r in runs],
            "time",
            ".2f",
        ),
        (
            "renewals/s (a rank's, or an engine lease's)",
            [r.renewals.throughput for r in runs],
            "rate",
            ".0f",
        ),
        (
            "ranks kept live/s (>= 3,000)",
            [r.renewals.throughput * r.ranks_per_renewal for r in runs],
            "rate",
            ".0f",
        ),
        (
            "renewals: server CPU ms each",
            [_per(r.renewals.server_cpu, RENEWALS) for r in runs],
            "time",
            ".3f",
        ),
        (
            "renewals: PostgreSQL CPU ms each",
            [_per(r.renewals_db_cpu, RENEWALS) for r in runs],
            "time",
            ".3f",
        ),
        ("renewals: p99 ms", [r.renewals.percentile(0.99) * ms for r in runs], "time", ".1f"),
        ("matrix: first ms", [r.matrix_first * ms for r in runs], "time", ".0f"),
        (
            "matrix: repeated ms, median (<= 100 ms)",
            [statistics.median(r.matrix_repeated) * ms for r in runs],
            "time",
            ".0f",
        ),
        (  # the answer has a cell per pair of instances: its time grows with their square
            "matrix: repeated us per instance pair",
            [statistics.median(r.matrix_repeated) * 1e6 / _instances(r) ** 2 for r in runs],
            "time",
            ".3f",
        ),
        (
            "fresh replica: first matrix ms (<= 1,000)",
            [r.fresh_matrix * ms for r in runs],
            "time",
            ".0f",
        ),
        ("server RSS MiB at the end / peak", [r.rss_mib for r in runs], "", ".0f"),
        (
            "server memory: KiB per rank added to the first size (RSS at the end)",
            [_added_kib(runs[0], r) for r in runs],
            "",
            ".1f",
        ),
        ("load average, start / end", [r.load[0] for r in runs], "", ".1f"),
    ]
    return rows


def _instances(run_: SizeRun) -> int:
    return run_.ranks // RANKS_PER_INSTANCE


def _added_kib(first: SizeRun, run_: SizeRun) -> float:
    """What the server holds per rank beyond the first size's fleet (nan for the first)."""
    if run_.ranks == first.ranks:
        return float("nan")
    return (run_.rss_mib - first.rss_mib) * 1024 / (run_.ranks - first.ranks)


def _per(seconds: float | None, count: int) -> float:
    return float("nan") if seconds is None else seconds / count * 1e3


def report(title: str, runs: list[SizeRun]) -> None:
    table = figures_table(
        f"{title}: {runs[0].ranks:,}-rank run as the baseline",
        ("measure",),
        [f"{run_.ranks:,} ranks" for run_ in runs]
        + [f"{run_.ranks:,} / {runs[0].ranks:,}" for run_ in runs[1:]],
    )
    for name, values, kind, spec in _measures(runs):
        cells = [format(value, spec) for value in values]
        if name.startswith("server RSS"):
            cells = [f"{r.rss_mib:.0f} / {r.peak_rss_mib:.0f}" for r in runs]
        elif name.startswith("load average"):
            cells = [f"{r.load[0]:.1f} / {r.load[1]:.1f}" for r in runs]
        ratios = [_ratio(value, values[0], kind) for value in values[1:]]
        table.add_row(name, *cells, *ratios)
    Console(width=160).print(table)


def report_pair(title: str, old: SizeRun, new: SizeRun) -> None:
    """One size, the baseline tree's figures beside this one's and their ratio."""
    table = figures_table(title, ("measure",), ("baseline", "this tree", "this / baseline"))
    for name, values, kind, spec in _measures([old, new]):
        if name.startswith(("server RSS", "server memory", "load average")):
            continue
        table.add_row(name, *(format(value, spec) for value in values), _ratio(*values[::-1], kind))
    Console(width=160).print(table)


def _ratio(value: float, baseline: float, kind: str) -> str:
    if not kind or not baseline or math.isnan(value) or math.isnan(baseline):
        return ""
    return f"{value / baseline:.2f}x"
