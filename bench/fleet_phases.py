"""Issue 22's fleet: 8,192 ranks (256 instances x 32 ranks), engine leases of 8 ranks, watchers.

``scale_bench.py --issue22`` runs these phases once per lease mode and database, on a fresh
database each: ``per-rank`` (every rank its own lease and heartbeat) and ``engine`` (a lease per 8
consecutive ranks of an instance, ranks registered with it, one renewal per lease). Phases:

* register every rank (instances interleaved; leases granted beforehand, untimed);
* one renewal round covering every rank (8,192 heartbeats, or 1,024 lease renewals): its total
  time is what must fit in lease/3 (10 s for the default 30 s lease), sent by 16 closed-loop
  clients as fast as the server answers, so its latencies are mostly queueing;
* the same round paced as a fleet sends it: each renewal at its own instant, evenly over lease/3
  (open loop, latency from that instant, so a server that falls behind is charged for it);
* plan reads: 256 plans once (uncached), then random cached reads of them;
* the compatibility matrix of every instance (first, then repeated);
* ``--watchers`` SSE watchers of ``GET .../events``, then five registrations: per watcher and
  change, the time from sending the registration to receiving its event.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.geometry import RankRegistration

RANKS_PER_INSTANCE = 32
CONTEXT_LAYOUT, GENERATION_LAYOUT = (8, 4), (4, 8)
RANKS_PER_LEASE = 8
PACED_LEAD_S = 0.5  # the paced phase's schedule starts this long after its tasks are made
NOMINAL_LEASE_SECONDS = 30  # what lease/3 is judged against (the bench's leases outlive the run)
PLANS = 256
CACHED_READS = 4000
CHANGES = 5
WATCH_TIMEOUT_S = 120.0


def fleet32(model: Any, instances: int) -> list[tuple[str, RankRegistration]]:
    from plan_bench import interleaved_fleet

    return interleaved_fleet(model, instances, CONTEXT_LAYOUT, GENERATION_LAYOUT)


async def run_fleet(bench: Any, bases: list[str], args: Any, mode: str) -> list[Any]:
    """``bench`` is the ``scale_bench`` module (its Phase, drive, expect and paths)."""
    rng = random.Random(args.seed)
    ranks = fleet32(bench.MODEL, max(1, args.ranks // (2 * RANKS_PER_INSTANCE)))
    connector = aiohttp.TCPConnector(limit=bench.CLIENTS)
    timeout = aiohttp.ClientTimeout(total=bench.REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        leases = await _grant(session, bases[0], bench, ranks) if mode == "engine" else {}
        register = [
            bench.expect("PUT", _put_path(bench, name, reg.rank, leases), 201, _doc(bench, reg))
            for name, reg in ranks
        ]
        phases = [await bench.drive(session, bases, f"register {len(ranks):,} ranks", register)]
        if mode == "engine":
            renew = [
                bench.expect("POST", f"/v1/deployments/fleet/leases/{lease}/heartbeat", 200)
                for lease in sorted(set(leases.values()))
            ]
        else:
            renew = [
                bench.expect("POST", bench.rank_path(name, reg.rank) + "/heartbeat", 200)
                for name, reg in ranks
            ]
        phases.append(await bench.drive(session, bases, "renewal round, all ranks", renew))
        phases.append(await _paced(bench, bases, renew, NOMINAL_LEASE_SECONDS / 3))
        if args.phases == "leases":  # registration and renewal only: quick iterations
            return phases
        plans = _plans(len(ranks) // (2 * RANKS_PER_INSTANCE))
        uncached = [bench.expect("GET", bench.plan_path(i, r), 200) for i, r in plans]
        phases.append(await bench.drive(session, bases, "plan reads, uncached", uncached))
        cached = [
            bench.expect("GET", bench.plan_path(*rng.choice(plans)), 200)
            for _ in range(CACHED_READS)
        ]
        phases.append(await bench.drive(session, bases, "plan reads, cached", cached))
        phases += await bench.matrix_phases(session, bases[0])
        phases.append(await _watch(bench, bases[0], args.watchers, ranks[0][1]))
    return phases


async def _paced(bench: Any, bases: list[str], requests: list[Any], seconds: float) -> Any:
    """``requests`` sent evenly over ``seconds`` whatever the answers' pace (an engine renews
    on its own clock); each latency counts from the renewal's scheduled instant."""
    phase = bench.Phase(f"renewals paced over lease/3 ({seconds:.0f} s)")
    phase.latencies = [0.0] * len(requests)
    connector = aiohttp.TCPConnector(limit=4 * bench.CLIENTS)
    timeout = aiohttp.ClientTimeout(total=bench.REQUEST_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # The schedule starts once every renewal's task exists: creating thousands of them takes
        # the load generator's loop about a tenth of a second, which the first renewals were
        # charged for (their p99 was the generator's, not the server's).
        started = time.perf_counter() + PACED_LEAD_S

        async def one(index: int, request: Any) -> None:
            due = started + index * seconds / len(requests)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await request(session, bases[index % len(bases)])
            phase.latencies[index] = time.perf_counter() - due

        await asyncio.gather(*(one(index, request) for index, request in enumerate(requests)))
        phase.seconds = time.perf_counter() - started
    return phase


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--issue22",
        action="store_true",
        help="issue 22's fleet (fleet_phases.py): 32 ranks per instance, per-rank and engine "
        "leases side by side, renewal rounds, watchers; --configs postgres,sqlite",
    )
    parser.add_argument("--ranks", type=int, default=8192, help="--issue22: ranks in all")
    parser.add_argument("--watchers", type=int, default=1000, help="--issue22: SSE watchers")
    parser.add_argument("--lease-modes", default="per-rank,engine", help="--issue22")
    parser.add_argument(
        "--phases",
        default="all",
        choices=("all", "leases"),
        help="--issue22: every phase, or registration and the renewal round only",
    )


def issue22(bench: Any, args: Any) -> dict[str, list[Any]]:
    """Every configuration (postgres, sqlite; with ``--baseline``, the other checkout on
    PostgreSQL first) in each lease mode, on a fresh database each."""
    configs = [c for c in args.configs.split(",") if c in ("postgres", "sqlite")]
    if args.baseline:
        configs.insert(0, "baseline")
    results = {}
    for config in configs:
        for mode in args.lease_modes.split(","):
            label = f"{config} {mode}"
            with (
                tempfile.TemporaryDirectory() as workdir,
                bench.servers(config, Path(workdir), args.baseline) as running,
                bench.profiled(running, args.profile, label.replace(" ", "-")),
            ):
                bases = [server.url for server in running]
                results[label] = asyncio.run(run_fleet(bench, bases, args, mode))
    return results


def _plans(instances: int) -> list[tuple[int, int]]:
    per_gen = GENERATION_LAYOUT[0] * GENERATION_LAYOUT[1]
    every = [(i, r) for i in range(instances) for r in range(per_gen)]
    return every[:PLANS]


def _doc(bench: Any, reg: RankRegistration) -> dict[str, Any]:
    return {**reg.to_json(), "lease_seconds": bench.LEASE_SECONDS}


def _put_path(bench: Any, name: str, rank: int, leases: dict[tuple[str, int], str]) -> str:
    lease = leases.get((name, rank // RANKS_PER_LEASE))
    path = bench.rank_path(name, rank)
    return path if lease is None else f"{path}?engine_lease={lease}"


async def _grant(
    session: aiohttp.ClientSession, base: str, bench: Any, ranks: list[tuple[str, Any]]
) -> dict[tuple[str, int], str]:
    """A lease per 8 consecutive ranks of each instance: (instance, rank // 8) -> lease id."""
    groups = sorted({(name, reg.rank // RANKS_PER_LEASE) for name, reg in ranks})
    headers = {"Authorization": f"Bearer {bench.WORKER_TOKEN}"}
    semaphore = asyncio.Semaphore(bench.CLIENTS)

    async def grant(group: tuple[str, int]) -> tuple[tuple[str, int], str]:
        async with (
            semaphore,
            session.post(
                f"{base}/v1/deployments/fleet/leases",
                json={"lease_seconds": bench.LEASE_SECONDS},
                headers=headers,
            ) as response,
        ):
            assert response.status == 201, await response.text()
            return group, (await response.json())["lease_id"]

    return dict(await asyncio.gather(*(grant(group) for group in groups)))


async def _watch(bench: Any, base: str, count: int, template: RankRegistration) -> Any:
    """``count`` watchers; ``CHANGES`` registrations one after another; per watcher and change
    the time from sending it to the watcher reading its event."""
    phase = bench.Phase(f"{count:,} watchers: change -> event")
    headers = {"Authorization": f"Bearer {bench.WORKER_TOKEN}"}
    arrivals: list[list[float]] = [[] for _ in range(count)]
    ready = [asyncio.Event() for _ in range(count)]
    delivered = [0] * CHANGES
    failed: list[str] = []
    everywhere = [asyncio.Event() for _ in range(CHANGES)]  # change k reached every watcher
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def watcher(index: int) -> None:
            url = f"{base}/v1/deployments/fleet/events"
            async with session.get(url, headers=headers) as response:
                if response.status != 200:
                    ready[index].set()  # counted as failed below, not waited for
                    failed.append(f"{response.status} {await response.text()}"[:200])
                    return
                async for line in response.content:
                    if line.startswith(b": revision"):
                        ready[index].set()
                    elif line.startswith(b"event: rank_registered"):
                        arrivals[index].append(time.perf_counter())
                        change = len(arrivals[index]) - 1
                        if change < CHANGES:
                            delivered[change] += 1
                            if delivered[change] == count:
                                everywhere[change].set()

        tasks = [asyncio.create_task(watcher(index)) for index in range(count)]
        try:
            async with asyncio.timeout(WATCH_TIMEOUT_S):
                await asyncio.gather(*(event.wait() for event in ready))
            if failed:
                raise RuntimeError(f"{len(failed)} watchers refused, e.g. {failed[0]}")
            started = []
            for change in range(CHANGES):
                document = {**template.to_json(), "lease_seconds": bench.LEASE_SECONDS}
                put = bench.expect("PUT", bench.rank_path(f"probe{change}", 0), 201, document)
                started.append(time.perf_counter())
                await put(session, base)
                async with asyncio.timeout(WATCH_TIMEOUT_S):
                    await everywhere[change].wait()
            phase.latencies = [
                seen[change] - started[change] for seen in arrivals for change in range(CHANGES)
            ]
            phase.seconds = time.perf_counter() - started[0]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return phase
