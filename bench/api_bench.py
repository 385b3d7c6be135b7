"""HTTP benchmark: a live ``kvroute serve`` driven by many concurrent clients from another process.

Starts ``kvroute serve`` (127.0.0.1, a free port, a temporary SQLite file, tokens on, warnings-only
logs) and measures, with aiohttp clients in this process: registrations, heartbeats, uncached plan
reads (the first read of each plan) and cached plan reads, the last also with a single client to
show the service time apart from queueing. Each row prints throughput and p50/p99 latency, and the p50 as a multiple of the in-process ``build_plan`` time for the same plans, which
makes the HTTP overhead visible. The deployment is the example of docs/api.md "Plans" (context TP4 -> generation
TP2, 32 layers with 8 KV heads, 1 draft layer with 1 head, bf16, head_dim 128, 32 tokens).

    python bench/api_bench.py [--deployments 48] [--clients 64] [--reads 6000] [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from kvroute.geometry import RankRegistration, build_plan
from kvroute.live import LiveServer
from plan_bench import Model, instance
from tables import figures_table

MODEL = Model(layers=32, kv_heads=8, draft_heads=1, indexer=False)
CONTEXT_TP, GENERATION_TP = 4, 2
WORKER_TOKEN = "bench-worker-token-0123456789"
ADMIN_TOKEN = "bench-admin-token-0123456789ab"
HEADERS = {"Authorization": f"Bearer {WORKER_TOKEN}"}
REQUEST_TIMEOUT_SECONDS = 10.0
TOTAL_SECONDS = 110.0  # the whole run, server start included, stays under two minutes
LEASE_SECONDS = 600
WRITE_CLIENTS = 16  # SQLite serialises writers: more clients only queue on its lock

Request = Callable[[aiohttp.ClientSession], Awaitable[None]]


@dataclass(frozen=True)
class Phase:
    name: str
    clients: int
    seconds: float
    latencies: list[float]

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def drive(
    session: aiohttp.ClientSession, name: str, requests: list[Request], clients: int
) -> Phase:
    """Runs the requests on ``clients`` concurrent connections; one latency sample each."""
    pending = iter(requests)
    latencies: list[float] = []

    async def client() -> None:
        for request in pending:
            started = time.perf_counter()
            await request(session)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return Phase(name, clients, time.perf_counter() - started, latencies)


def expect(method: str, url: str, status: int, body: Any = None) -> Request:
    async def request(session: aiohttp.ClientSession) -> None:
        async with session.request(method, url, json=body, headers=HEADERS) as response:
            await response.read()
            if response.status != status:
                raise RuntimeError(f"{method} {url}: {response.status}, expected {status}")

    return request


def document(reg: RankRegistration) -> dict[str, Any]:
    # Leases outlive the run: an expiry mid-benchmark would turn plan reads into 409s.
    return {**reg.to_json(), "lease_seconds": LEASE_SECONDS}


def deployment_urls(base: str, deployments: int) -> list[tuple[str, str]]:
    return [(f"{base}/v1/deployments/d{index}", f"d{index}") for index in range(deployments)]


def plan_reads(base: str, deployments: int) -> list[Request]:
    return [
        expect("GET", f"{url}/plans?sender=ctx0&receiver=gen0&receiver_rank={rank}", 200)
        for url, _ in deployment_urls(base, deployments)
        for rank in range(GENERATION_TP)
    ]


async def run(base: str, args: argparse.Namespace) -> list[Phase]:
    context = instance(MODEL, "context", "ctx0", CONTEXT_TP, 1)
    generation = instance(MODEL, "generation", "gen0", GENERATION_TP, 1)
    ranks = [("ctx0", reg) for reg in context] + [("gen0", reg) for reg in generation]
    connector = aiohttp.TCPConnector(limit=args.clients)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        urls = deployment_urls(base, args.deployments)
        registrations = [
            expect("PUT", f"{url}/instances/{name}/ranks/{reg.rank}", 201, document(reg))
            for url, _ in urls
            for name, reg in ranks
        ]
        phases = [await drive(session, "register rank", registrations, WRITE_CLIENTS)]
        beats = [
            expect("POST", f"{url}/instances/{name}/ranks/{reg.rank}/heartbeat", 200)
            for url, _ in urls
            for name, reg in ranks
        ]
        rounds = max(1, args.heartbeats // len(beats))
        phases.append(await drive(session, "heartbeat", beats * rounds, args.clients))
        phases.append(
            await drive(session, "plan, uncached", plan_reads(base, args.deployments), args.clients)
        )
        reads = plan_reads(base, args.deployments)
        cached = [reads[index % len(reads)] for index in range(args.reads)]
        phases.append(await drive(session, "plan, cached", cached, args.clients))
        # One client: the service time of a cached read, without queueing behind 63 others
        # (with N closed-loop clients, latency is at least N / throughput: Little's law).
        phases.append(await drive(session, "plan, cached", cached[: args.reads // 10], 1))
    return phases


def build_seconds(context: list[RankRegistration], generation: list[RankRegistration]) -> float:
    samples = []
    for _ in range(50):
        for receiver in generation:
            started = time.perf_counter()
            build_plan(context, receiver)
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def report(phases: list[Phase], build: float) -> None:
    table = figures_table(
        f"kvroute over HTTP (in-process build_plan: {build * 1e3:.3f} ms)",
        ("phase",),
        ("requests", "clients", "req/s", "p50 ms", "p99 ms", "p50 / build"),
    )
    for phase in phases:
        p50 = phase.percentile(0.5)
        table.add_row(
            phase.name,
            str(len(phase.latencies)),
            str(phase.clients),
            f"{phase.throughput:.0f}",
            f"{p50 * 1e3:.2f}",
            f"{phase.percentile(0.99) * 1e3:.2f}",
            f"{p50 / build:.1f}x" if phase.name.startswith("plan") else "-",
        )
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployments", type=int, default=48)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--heartbeats", type=int, default=3000)
    parser.add_argument("--reads", type=int, default=6000)
    parser.add_argument(
        "--database-url",
        help="serve on this database (e.g. an empty PostgreSQL database) instead of a temp SQLite file",
    )
    args = parser.parse_args()
    context = instance(MODEL, "context", "ctx0", CONTEXT_TP, 1)
    generation = instance(MODEL, "generation", "gen0", GENERATION_TP, 1)
    build = build_seconds(context, generation)
    with (
        tempfile.TemporaryDirectory() as workdir,
        LiveServer(
            Path(workdir), database_url=args.database_url, tokens=(WORKER_TOKEN, ADMIN_TOKEN)
        ) as server,
    ):
        phases = asyncio.run(asyncio.wait_for(run(server.url, args), TOTAL_SECONDS))
    report(phases, build)


if __name__ == "__main__":
    main()
