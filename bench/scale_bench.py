"""Fleet-scale benchmark: one deployment of 1,024 ranks on a live kvroute, 16 concurrent clients.

The deployment is issue 9's: a Llama-70B-like model (80 layers, 8 KV heads, head_dim 128, bf16,
32 tokens per block, one Eagle draft layer with 2 KV heads in the same pool), 32 context instances
of TP8 x PP2 and 32 generation instances of TP4 x PP4, 16 ranks each. Phases, in order:

* register every rank (instances interleaved, as a fleet comes up), with the p50 of the first and
  the last quarter of registrations: their ratio shows whether admission grows with the deployment;
* heartbeats of random ranks;
* plan reads: each (ctx_i, gen_i, rank) plan once (uncached), then random cached reads;
* the compatibility matrix (first call, then the median of repeated calls).

Each configuration runs on a fresh database: ``postgres`` (one ``kvroute serve``), ``sqlite`` (one
server on a temp file) and ``postgres-2`` (two servers on one PostgreSQL, clients alternating).
The load generator shares the machine with the server(s), as in the issue. One table, one column
per configuration, and the two-replica throughput as a ratio of the one-replica figure.

    python bench/scale_bench.py [--configs postgres,sqlite,postgres-2] [--layouts identical,random]
        [--profile DIR]

``--layouts random`` has every rank lay its regions out its own way (``layouts.relayout``: shuffled
layer order, gaps, padded slot and stride, other view and pool ids; deterministic from ``--seed``):
the geometry, and so every verdict, stays the fleet's, but the documents all differ. Each layout
mode runs every configuration; random-layout columns are named ``CONFIG random``.

``--issue22`` runs issue 22's fleet instead (``fleet_phases.py``: 8,192 ranks of 32-rank
instances, per-rank and engine leases side by side, renewal rounds and SSE watchers; ``--ranks``,
``--watchers`` and ``--lease-modes`` bound it).

``--sizes 1024,8192`` runs issue 34's comparison instead (``fleet_sizes.py``): the fleet at each
size on a fresh database, per-rank and engine leases, a fresh replica's first matrix and the
server's memory, as ratios against the first size.

``--profile DIR`` records each server with py-spy (collapsed stacks, one file per server), sampling
the thread that holds the GIL: whole stacks of the Python CPU on any thread. (Sampled without
stopping the process, the stacks came torn and aiosqlite's idle thread counted as busy.)
``--baseline OLD/service`` first runs the same phases against another checkout's kvroute on
PostgreSQL (e.g. ``git worktree add /tmp/old <commit>``) and adds a column with the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from rich.console import Console
from sqlalchemy.engine import make_url

import fleet_phases
import fleet_sizes
from kvroute.geometry import RankRegistration
from kvroute.live import LiveServer
from layouts import relayout
from plan_bench import Model, interleaved_fleet
from tables import figures_table

MODEL = Model(layers=80, kv_heads=8, draft_heads=2, indexer=False)
INSTANCES = 32  # of each role: 1,024 ranks
CONTEXT_LAYOUT, GENERATION_LAYOUT = (8, 2), (4, 4)
CLIENTS = 16
LEASE_SECONDS = 3600  # leases outlive the run: an expiry would turn plan reads into 409s
WORKER_TOKEN = "bench-worker-token-0123456789"
ADMIN_TOKEN = "bench-admin-token-0123456789ab"
# A database of its own per checkout running the bench: it is dropped and created for each run.
POSTGRES_URL = os.environ.get(
    "KVROUTE_BENCH_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/kvroute_scale_bench"
)
REQUEST_TIMEOUT_SECONDS = 60.0
SERVICE = Path(__file__).resolve().parents[1] / "service"  # the tree this bench measures
# (configuration, configuration it is compared with, column title)
RATIOS = [
    ("postgres", "baseline", "postgres / baseline"),
    ("postgres-2", "postgres", "2 replicas / 1"),
    ("postgres random", "baseline random", "random: postgres / baseline"),
    ("postgres random", "postgres", "random / identical layouts"),
    ("postgres engine", "postgres per-rank", "postgres: engine / per-rank"),
    ("sqlite engine", "sqlite per-rank", "sqlite: engine / per-rank"),
    ("postgres engine", "baseline engine", "engine: postgres / baseline"),
    ("postgres per-rank", "baseline per-rank", "per-rank: postgres / baseline"),
]

Request = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


# Each running server's process id by its base URL: drive() reports the CPU each phase cost it.
SERVER_PIDS: dict[str, int] = {}


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)  # in submission order
    # CPU seconds spent during the phase: the servers together, and this load generator.
    server_cpu: float | None = None  # None: the phase did not go through drive()
    client_cpu: float = 0.0

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def percentile(self, fraction: float, samples: list[float] | None = None) -> float:
        ordered = sorted(self.latencies if samples is None else samples)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]

    def quarter_p50(self, which: int) -> float:
        size = len(self.latencies) // 4
        return self.percentile(0.5, self.latencies[which * size : (which + 1) * size])


def expect(method: str, path: str, status: int, body: Any = None, token: str = WORKER_TOKEN):
    headers = {"Authorization": f"Bearer {token}"}

    async def request(session: aiohttp.ClientSession, base: str) -> None:
        async with session.request(method, base + path, json=body, headers=headers) as response:
            await response.read()
            if response.status != status:
                raise RuntimeError(f"{method} {path}: {response.status}, expected {status}")

    return request


async def drive(
    session: aiohttp.ClientSession, bases: list[str], name: str, requests: list[Request]
) -> Phase:
    """Runs ``requests`` on ``CLIENTS`` closed-loop clients; client ``c`` talks to server ``c % n``."""
    phase = Phase(name, latencies=[0.0] * len(requests))
    pending = iter(enumerate(requests))

    async def client(base: str) -> None:
        for index, request in pending:
            started = time.perf_counter()
            await request(session, base)
            phase.latencies[index] = time.perf_counter() - started

    pids = [SERVER_PIDS[base] for base in bases if base in SERVER_PIDS]
    cpu = _server_cpu(pids), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(client(bases[c % len(bases)]) for c in range(CLIENTS)))
    phase.seconds = time.perf_counter() - started
    phase.server_cpu = _server_cpu(pids) - cpu[0]
    phase.client_cpu = time.process_time() - cpu[1]
    return phase


def _server_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            # Fields after the parenthesised command name; utime and stime are fields 14 and 15.
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def fleet(instances: int) -> list[tuple[str, RankRegistration]]:
    return interleaved_fleet(MODEL, instances, CONTEXT_LAYOUT, GENERATION_LAYOUT)


def rank_path(name: str, rank: int) -> str:
    return f"/v1/deployments/fleet/instances/{name}/ranks/{rank}"


def plan_path(index: int, rank: int) -> str:
    return f"/v1/deployments/fleet/plans?sender=ctx{index}&receiver=gen{index}&receiver_rank={rank}"


async def run_phases(bases: list[str], instances: int, seed: int, layouts: str) -> list[Phase]:
    rng = random.Random(seed)
    ranks = fleet(instances)
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        register = [
            expect("PUT", rank_path(name, reg.rank), 201, _document(reg, name, layouts, seed))
            for name, reg in ranks
        ]
        phases = [await drive(session, bases, f"register {len(ranks):,} ranks", register)]
        beats = [
            expect("POST", rank_path(*_pick(rng, ranks)) + "/heartbeat", 200) for _ in range(8000)
        ]
        phases.append(await drive(session, bases, "heartbeats, random ranks", beats))
        ranks_per_gen = GENERATION_LAYOUT[0] * GENERATION_LAYOUT[1]
        every_plan = [(i, r) for i in range(instances) for r in range(ranks_per_gen)]
        uncached = [expect("GET", plan_path(i, r), 200) for i, r in every_plan]
        phases.append(await drive(session, bases, "plan reads, uncached", uncached))
        cached = [expect("GET", plan_path(*rng.choice(every_plan)), 200) for _ in range(8000)]
        phases.append(await drive(session, bases, "plan reads, cached", cached))
        phases += await matrix_phases(session, bases[0])
    return phases


async def matrix_phases(session: aiohttp.ClientSession, base: str) -> list[Phase]:
    matrix = expect("GET", "/v1/deployments/fleet/compatibility", 200, token=ADMIN_TOKEN)
    first = Phase("compatibility matrix, first")
    started = time.perf_counter()
    await matrix(session, base)
    first.seconds = time.perf_counter() - started
    first.latencies = [first.seconds]
    repeated = Phase("compatibility matrix, repeated")
    for _ in range(5):
        started = time.perf_counter()
        await matrix(session, base)
        repeated.latencies.append(time.perf_counter() - started)
    repeated.seconds = sum(repeated.latencies)
    return [first, repeated]


def _document(reg: RankRegistration, name: str, layouts: str, seed: int) -> dict[str, Any]:
    doc = {**reg.to_json(), "lease_seconds": LEASE_SECONDS}
    if layouts == "random":  # each rank its own layout, the same one for a given seed
        doc = relayout(doc, random.Random(f"{seed}:{name}:{reg.rank}"))
    return doc


def _pick(rng: random.Random, ranks: list[tuple[str, RankRegistration]]) -> tuple[str, int]:
    name, reg = rng.choice(ranks)
    return name, reg.rank


async def fresh_postgres(url: str) -> None:
    database = make_url(url).database
    admin_dsn = make_url(url).set(drivername="postgresql", database="postgres")
    admin = await asyncpg.connect(admin_dsn.render_as_string(hide_password=False))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()


@contextlib.contextmanager
def servers(config: str, workdir: Path, baseline: Path | None = None) -> Iterator[list[LiveServer]]:
    """``config``'s servers on a fresh database; ``baseline`` runs another checkout's kvroute
    (its ``service`` directory) as the ``baseline`` configuration, on PostgreSQL (``baseline-sqlite``:
    on SQLite)."""
    count = 2 if config.endswith("-2") else 1
    url = None
    # Each server imports kvroute from the tree it measures, never from whatever the environment
    # has installed (an editable install of another checkout made two runs compare a tree with
    # itself).
    tree = baseline if config.startswith("baseline") and baseline else SERVICE
    source = {"PYTHONPATH": str(tree)}
    if config.startswith("postgres") or config == "baseline":
        url = POSTGRES_URL
        asyncio.run(fresh_postgres(url))
        upgrade = [sys.executable, "-m", "kvroute", "db", "upgrade"]  # that tree's migrations
        subprocess.run(
            upgrade,
            env={**_plain_env(), **source, "KVROUTE_DATABASE_URL": url},
            check=True,
            capture_output=True,
        )
    started: list[LiveServer] = []
    try:
        for index in range(count):
            directory = workdir / f"{config}-{index}"
            directory.mkdir()
            server = LiveServer(
                directory,
                database_url=url,
                tokens=(WORKER_TOKEN, ADMIN_TOKEN),
                env={"KVROUTE_REPLICA_ID": f"bench-{index}", **source},
            )
            started.append(server.start())
            if server.process is not None:
                SERVER_PIDS[server.url] = server.process.pid
        yield started
    finally:
        for server in started:
            SERVER_PIDS.pop(server.url, None)
            server.stop()


def _plain_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("KVROUTE_")}


@contextlib.contextmanager
def profiled(server_list: list[LiveServer], directory: Path | None, config: str) -> Iterator[None]:
    if directory is None:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    recorders = [
        subprocess.Popen(
            [
                shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--pid",
                str(server.process.pid),
                "--output",
                str(directory / f"{config}-{index}.txt"),
                "--format",
                "raw",
                "--rate",
                "200",
                "--gil",  # whole stacks of the thread holding the GIL: Python CPU only
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for index, server in enumerate(server_list)
        if server.process is not None
    ]
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(2)  # SIGINT: py-spy writes its stacks and exits
            recorder.wait(timeout=60)


def run_config(config: str, layouts: str, args: argparse.Namespace) -> list[Phase]:
    label = config if layouts == "identical" else f"{config}-{layouts}"
    with (
        tempfile.TemporaryDirectory() as workdir,
        servers(config, Path(workdir), args.baseline) as running,
        profiled(running, args.profile, label),
    ):
        bases = [server.url for server in running]
        return asyncio.run(run_phases(bases, args.instances, args.seed, layouts))


def report(results: dict[str, list[Phase]]) -> None:
    configs = list(results)
    ratios = [(two, one, label) for two, one, label in RATIOS if two in results and one in results]
    table = figures_table(
        f"kvroute at fleet scale: {CLIENTS} clients, server(s) on this machine",
        ("phase", "measure"),
        [*configs, *(label for _, _, label in ratios)],
    )
    for index, phase in enumerate(next(iter(results.values()))):
        for measure, value in _measures(phase):
            row = [phase.name, measure]
            row += [value(results[c][index]) for c in configs]
            for top, bottom, _ in ratios:
                row.append(_ratio(results[top][index], results[bottom][index], measure))
            table.add_row(*row)
    Console(width=160).print(table)


def _ratio(top: Phase, bottom: Phase, measure: str) -> str:
    """How many times better the top configuration is (time: faster; growth: the two growths)."""
    if not top.latencies or not bottom.latencies:
        return ""
    if measure == "req/s":
        return f"{top.throughput / bottom.throughput:.2f}x"
    if measure == "total s":
        return f"{bottom.seconds / top.seconds:.2f}x faster"
    if measure in ("p50 ms", "p99 ms"):
        fraction = 0.5 if measure == "p50 ms" else 0.99
        return f"{bottom.percentile(fraction) / top.percentile(fraction):.2f}x faster"
    if measure == "server CPU ms / req":  # how many times less CPU the top configuration costs
        costs = _cpu_per_request(bottom), _cpu_per_request(top)
        return f"{costs[0] / costs[1]:.2f}x less" if costs[0] and costs[1] else ""
    if measure.startswith("ms"):  # time: how many times faster the top configuration is
        return (
            f"{statistics.median(bottom.latencies) / statistics.median(top.latencies):.1f}x faster"
        )
    if measure.startswith("p50 last"):
        return f"{_growth(top).split()[0]} vs {_growth(bottom).split()[0]}"
    return ""


def _measures(phase: Phase) -> list[tuple[str, Callable[[Phase], str]]]:
    if phase.name.startswith("compatibility"):
        return [("ms (median)", lambda p: f"{statistics.median(p.latencies) * 1e3:.0f}")]
    if "watchers" in phase.name:
        return [
            ("deliveries", lambda p: f"{len(p.latencies):,}"),
            ("p50 ms", lambda p: f"{p.percentile(0.5) * 1e3:.1f}"),
            ("p99 ms", lambda p: f"{p.percentile(0.99) * 1e3:.1f}"),
        ]
    rows: list[tuple[str, Callable[[Phase], str]]] = [
        ("req/s", lambda p: f"{p.throughput:.0f}"),
        ("p50 ms", lambda p: f"{p.percentile(0.5) * 1e3:.1f}"),
        ("p99 ms", lambda p: f"{p.percentile(0.99) * 1e3:.1f}"),
        ("CPU, % of a core: server(s) / load gen", _cpu_shares),
        ("server CPU ms / req", _cpu_cost),
    ]
    if phase.name.startswith(("register", "renewal round", "renewals paced")):
        rows.insert(0, ("total s", lambda p: f"{p.seconds:.1f}"))
    if phase.name.startswith("register"):
        rows.append(("p50 last / first quarter", _growth))
    return rows


def _cpu_shares(phase: Phase) -> str:
    if phase.server_cpu is None or not phase.seconds:
        return ""
    server, client = phase.server_cpu / phase.seconds, phase.client_cpu / phase.seconds
    return f"{100 * server:.0f} / {100 * client:.0f}"


def _cpu_per_request(phase: Phase) -> float | None:
    if phase.server_cpu is None or not phase.latencies:
        return None
    return phase.server_cpu / len(phase.latencies)


def _cpu_cost(phase: Phase) -> str:
    cost = _cpu_per_request(phase)
    return "" if cost is None else f"{cost * 1e3:.2f}"


def _growth(phase: Phase) -> str:
    first, last = phase.quarter_p50(0), phase.quarter_p50(3)
    return f"{last / first:.2f}x ({first * 1e3:.1f} -> {last * 1e3:.1f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="postgres,sqlite,postgres-2")
    parser.add_argument("--profile", type=Path, help="write py-spy flame graphs here")
    parser.add_argument("--seed", type=int, default=9)
    parser.add_argument(
        "--layouts",
        default="identical",
        help="comma-separated: identical (every rank of a stage alike), random (per-rank layouts)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout's service/ directory, run first as the 'baseline' configuration",
    )
    parser.add_argument(
        "--instances", type=int, default=INSTANCES, help="instances of each role (32: 1,024 ranks)"
    )
    fleet_phases.add_arguments(parser)
    fleet_sizes.add_arguments(parser)
    args = parser.parse_args()
    if args.sizes:
        fleet_sizes.run(sys.modules[__name__], args)
        return
    if args.issue22:
        report(fleet_phases.issue22(sys.modules[__name__], args))
        return
    configs = args.configs.split(",")
    if args.baseline:
        configs.insert(0, "baseline")
    results = {}
    for layouts in args.layouts.split(","):
        if layouts not in ("identical", "random"):
            parser.error(f"--layouts: unknown mode {layouts!r} (identical, random)")
        for config in configs:
            name = config if layouts == "identical" else f"{config} {layouts}"
            results[name] = run_config(config, layouts, args)
    report(results)


if __name__ == "__main__":
    main()
