"""The compatibility matrix and the pairs answer alone, on a fleet registered once.

Registering issue 22's 8,192 ranks takes minutes on a loaded machine; the matrix takes seconds.
``--setup`` registers ``--ranks`` ranks (issue 22's 32-rank instances, engine leases of 8 ranks,
hour-long leases) into the bench database once; every later run starts a server on that database
as it is and times only the read answers, so a profile or a before/after comparison costs seconds:

    python bench/matrix_bench.py --setup --ranks 8192
    python bench/matrix_bench.py [--baseline OLD/service] [--repeat 5] [--profile DIR]

Phases, per configuration (``baseline`` first when given, then this checkout): the matrix (first
call on the fresh server, which parses every document; the median of ``--repeat`` calls; the median
of ``--repeat`` calls each right after a change: a probe rank registered, or its instance deleted
again), the pairs answer (likewise) and ``--plan-reads``
cached plan reads on 16 clients (a first pass fills the plan cache), so a change to the read path
shows up in the same run. Both configurations read the same rows: the schema must be the same.
Every figure should be reported with the load average printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

import fleet_phases
import scale_bench as bench

MATRIX = "/v1/deployments/fleet/compatibility"
PAIRS = "/v1/deployments/fleet/pairs"


async def setup(base: str, ranks: int) -> float:
    fleet = fleet_phases.fleet32(
        bench.MODEL, max(1, ranks // (2 * fleet_phases.RANKS_PER_INSTANCE))
    )
    connector = aiohttp.TCPConnector(limit=bench.CLIENTS)
    timeout = aiohttp.ClientTimeout(total=bench.REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        leases = await fleet_phases._grant(session, base, bench, fleet)
        register = [
            bench.expect(
                "PUT",
                fleet_phases._put_path(bench, name, reg.rank, leases),
                201,
                fleet_phases._doc(bench, reg),
            )
            for name, reg in fleet
        ]
        phase = await bench.drive(session, [base], f"register {len(fleet):,} ranks", register)
    return phase.seconds


async def timed(session: aiohttp.ClientSession, url: str, token: str) -> tuple[float, int]:
    started = time.perf_counter()
    async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as response:
        body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {url}: {response.status} {body[:300]!r}")
    return time.perf_counter() - started, len(body)


async def after_changes(
    session: aiohttp.ClientSession, base: str, path: str, token: str, repeat: int
) -> float:
    """The median answer time right after a change (a probe rank registered, then its instance
    deleted, so the fleet ends as it began): what a cache keyed by the state cannot hide."""
    template = fleet_phases.fleet32(bench.MODEL, 1)[0][1]
    document = fleet_phases._doc(bench, template)
    instance = "/v1/deployments/fleet/instances/probe"
    put = bench.expect("PUT", bench.rank_path("probe", 0), 201, document)
    delete = bench.expect("DELETE", instance, 204, token=bench.ADMIN_TOKEN)
    times = []
    for index in range(repeat):
        await (put if index % 2 == 0 else delete)(session, base)
        times.append((await timed(session, base + path, token))[0])
    if repeat % 2:
        await delete(session, base)
    return statistics.median(times)


async def phases(base: str, repeat: int, plan_reads: int, answers: bool) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=300)
    out: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=bench.CLIENTS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for name, path, token in (
            (("matrix", MATRIX, bench.ADMIN_TOKEN), ("pairs", PAIRS, bench.WORKER_TOKEN))
            if answers
            else ()
        ):
            first, size = await timed(session, base + path, token)
            repeated = [(await timed(session, base + path, token))[0] for _ in range(repeat)]
            changed = await after_changes(session, base, path, token, repeat)
            out[name] = (first, statistics.median(repeated), changed, size)
        if plan_reads:
            plans = fleet_phases._plans(8)
            fill = [bench.expect("GET", bench.plan_path(i, r), 200) for i, r in plans]
            await bench.drive(session, [base], "fill", fill)
            rng = random.Random(7)
            reads = [
                bench.expect("GET", bench.plan_path(*rng.choice(plans)), 200)
                for _ in range(plan_reads)
            ]
            out["plans"] = await bench.drive(session, [base], "cached", reads)
    return out


def run(config: str, args: argparse.Namespace) -> dict[str, Any]:
    source = {"PYTHONPATH": str(args.baseline)} if config == "baseline" else {}
    with tempfile.TemporaryDirectory() as workdir:
        directory = Path(workdir) / config
        directory.mkdir()
        server = bench.LiveServer(
            directory,
            database_url=bench.POSTGRES_URL,
            tokens=(bench.WORKER_TOKEN, bench.ADMIN_TOKEN),
            env={"KVROUTE_REPLICA_ID": f"matrix-{config}", **source},
        ).start()
        try:
            with bench.profiled([server], args.profile, config):
                return asyncio.run(
                    phases(server.url, args.repeat, args.plan_reads, not args.plans_only)
                )
        except RuntimeError:
            for line in server.log.read_text().splitlines()[-20:]:
                print(line[:1500], file=sys.stderr)
            raise
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="fresh database, register the fleet")
    parser.add_argument("--ranks", type=int, default=8192)
    parser.add_argument("--baseline", type=Path, help="another checkout's service/ directory")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--plan-reads", type=int, default=2000)
    parser.add_argument("--plans-only", action="store_true", help="cached plan reads alone")
    parser.add_argument("--profile", type=Path, help="py-spy collapsed stacks per configuration")
    args = parser.parse_args()
    if args.setup:
        bench.LEASE_SECONDS = 86400  # the fleet stays live for a day of runs
        with (
            tempfile.TemporaryDirectory() as workdir,
            bench.servers("postgres", Path(workdir)) as s,
        ):
            seconds = asyncio.run(setup(s[0].url, args.ranks))
        print(f"registered {args.ranks:,} ranks in {seconds:.1f} s; load {os.getloadavg()}")
        return
    configs = (["baseline"] if args.baseline else []) + ["current"]
    results = {}
    for config in configs:
        results[config] = run(config, args)
        print(f"{config}: done, load {os.getloadavg()}", file=sys.stderr)
    for config, result in results.items():
        for name in ("matrix", "pairs") if not args.plans_only else ():
            first, median, changed, size = result[name]
            print(
                f"{config:9} {name:7} first {first * 1e3:7.0f} ms, repeated median "
                f"{median * 1e3:6.0f} ms, after a change median {changed * 1e3:6.0f} ms, "
                f"body {size / 1e6:.2f} MB"
            )
        if "plans" in result:
            plans = result["plans"]
            print(
                f"{config:9} cached plan reads {plans.throughput:.0f}/s, "
                f"p99 {plans.percentile(0.99) * 1e3:.1f} ms"
            )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
