"""Pool churn soak: thousands of transfer jobs over ranks and pools that come and go (issue 20).

One live ``kvroute serve`` (SQLite in a temporary directory). This process plays the workers: each
round it creates a context and a generation pool (sealed memfds and plain ``/dev/shm`` segments in
turn), registers ``ctx0`` and ``gen0`` rank 0 over them, runs one job copying every block, then
churns the ranks (deletes the instance and the rank, deletes both ranks, or leaves them to be
re-registered over new pools next round, a new generation) and frees the pools, as a worker that
restarts would. After every round it reads the server's ``/proc/<pid>/fd`` and ``/proc/<pid>/maps``.

Printed: open descriptors and mappings of the server after the first rounds and at the end (total
and those leading to this run's pools), and the jobs' times (the server's copy time and the
client's submit-to-final latency, medians of ``--window`` jobs): the first and the last jobs of the
soak, and a control measured right after it on a fresh server, so the last jobs are compared with
jobs run under the same machine load. Absolute times move with the load; the ratios are the measure.

    python bench/pool_churn_bench.py [--rounds 2000] [--window 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.client.memory import ShmPool
from kvroute.client.pools import KvLayout, SharedKvPool, rank_document
from kvroute.geometry import Kind
from kvroute.live import LiveServer, json_call

WORKER_TOKEN = "churn-worker-token-0123456789"
ADMIN_TOKEN = "churn-admin-token-0123456789ab"
LAYOUT = KvLayout(Kind.HND, num_layers=4, num_kv_heads=8, tokens_per_block=16, head_dim=64,
                  dtype="bfloat16")  # fmt: skip
NUM_BLOCKS = 16  # 128 KiB blocks: 2 MiB pools, a job copies all of them
POLL_S = 0.002
JOB_WAIT_S = 30.0
BASELINE_ROUND = 20  # the server's first rounds warm its caches; flatness is measured after them
DEPLOYMENT = "/v1/deployments/churn"


@dataclass(frozen=True)
class Sample:
    """One round: the job's copy time on the server and its submit-to-final latency here, and what
    the server held afterwards (descriptors, mappings, and those leading to this run's pools)."""

    copy_s: float
    latency_s: float
    fds: int
    maps: int
    pool_fds: int
    pool_maps: int


def held(pid: int, marker: str) -> tuple[int, int, int, int]:
    """(descriptors, mappings, descriptors to ``marker`` pools, mappings of them) of ``pid``."""
    fds = pool_fds = 0
    for entry in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            pool_fds += marker in os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return fds, len(maps), pool_fds, sum(marker in line for line in maps)


class Churn:
    """Drives rounds against ``server``; pools are named ``kvroute-churn-<pid>-...``."""

    def __init__(self, server: LiveServer) -> None:
        assert server.process is not None
        self.server = server
        self.pid = server.process.pid
        self.marker = f"kvroute-churn-{os.getpid()}-"
        self.samples: list[Sample] = []

    def round(self, index: int) -> Sample:
        sealed = index % 2 == 0
        pools = [ShmPool(f"{self.marker}{index}-{side}", LAYOUT.block_bytes * NUM_BLOCKS,
                         sealed=sealed) for side in ("ctx", "gen")]  # fmt: skip
        try:
            for (role, instance), memory in zip(
                (("context", "ctx0"), ("generation", "gen0")), pools, strict=True
            ):
                shared = SharedKvPool.carve([LAYOUT], NUM_BLOCKS, buffer=memory.tensor)
                document = rank_document(
                    role=role, target=LAYOUT, pools=[shared.describe(memory=memory.descriptor())]
                )
                del shared
                self._ok("PUT", f"{DEPLOYMENT}/instances/{instance}/ranks/0", document, (200, 201))
            copy_s, latency_s = self._job()
            self._churn(index)
        finally:
            for memory in pools:
                memory.close()
        sample = Sample(copy_s, latency_s, *held(self.pid, self.marker))
        self.samples.append(sample)
        return sample

    def _job(self) -> tuple[float, float]:
        blocks = list(range(NUM_BLOCKS))
        body = {"sender": "ctx0", "receiver": "gen0", "receiver_ranks": [0],
                "src_blocks": blocks, "dst_blocks": blocks[::-1]}  # fmt: skip
        started = time.perf_counter()
        job = self._ok("POST", f"{DEPLOYMENT}/transfers", body, (202,))
        deadline = time.monotonic() + JOB_WAIT_S
        while job["state"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job['id']} did not finish within {JOB_WAIT_S} s")
            time.sleep(POLL_S)
            job = self._ok("GET", f"/v1/transfers/{job['id']}", None, (200,))
        latency = time.perf_counter() - started
        if job["state"] != "succeeded":
            raise RuntimeError(f"job {job['id']} {job['state']}: {job['error']}")
        return float(job["duration_seconds"]), latency

    def _churn(self, index: int) -> None:
        """Every third round deletes the context instance and the generation rank, every third
        both ranks; the rest leave them to be re-registered over new pools next round."""
        if index % 3 == 0:
            self._ok("DELETE", f"{DEPLOYMENT}/instances/ctx0", None, (204,), ADMIN_TOKEN)
            self._ok("DELETE", f"{DEPLOYMENT}/instances/gen0/ranks/0", None, (204,), ADMIN_TOKEN)
        elif index % 3 == 1:
            for instance in ("ctx0", "gen0"):
                path = f"{DEPLOYMENT}/instances/{instance}/ranks/0"
                self._ok("DELETE", path, None, (204,), ADMIN_TOKEN)

    def _ok(
        self,
        method: str,
        path: str,
        body: Any,
        statuses: tuple[int, ...],
        token: str = WORKER_TOKEN,
    ) -> Any:
        status, answer = json_call(method, self.server.url + path, token, body)
        if status not in statuses:
            raise RuntimeError(f"{method} {path}: {status} {answer}")
        return answer


def run(
    rounds: int, directory: Path, progress: Callable[[int, Sample], None] | None = None
) -> Churn:
    """Starts a server in ``directory`` and runs ``rounds`` rounds; the server is stopped after."""
    directory.mkdir(parents=True, exist_ok=True)
    server = LiveServer(directory, tokens=(WORKER_TOKEN, ADMIN_TOKEN)).start()
    try:
        churn = Churn(server)
        for index in range(rounds):
            sample = churn.round(index)
            if progress is not None:
                progress(index, sample)
        if server.process is None or server.process.poll() is not None:
            raise RuntimeError("kvroute serve exited during the soak")
        return churn
    finally:
        server.stop()


def _median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(sample, field) for sample in samples)


def report(churn: Churn, window: int, control: Churn | None = None) -> None:
    samples = churn.samples
    base = samples[min(BASELINE_ROUND, len(samples) - 1)]
    last = samples[-1]
    print(f"rounds {len(samples)} (one job each; pools {NUM_BLOCKS} x {LAYOUT.block_bytes} B)")
    print(f"server fds:   round {BASELINE_ROUND} {base.fds}, last {last.fds}, "
          f"max {max(s.fds for s in samples)}")  # fmt: skip
    print(f"server maps:  round {BASELINE_ROUND} {base.maps}, last {last.maps}, "
          f"max {max(s.maps for s in samples)}")  # fmt: skip
    print(f"pool fds/maps held after a round: max {max(s.pool_fds for s in samples)} / "
          f"{max(s.pool_maps for s in samples)}, last {last.pool_fds} / {last.pool_maps}")  # fmt: skip
    for field, name in (("copy_s", "job copy"), ("latency_s", "job latency")):
        first, latest = _median(samples[:window], field), _median(samples[-window:], field)
        line = (
            f"{name} (median of {window}): first {first * 1e3:.2f} ms, last "
            f"{latest * 1e3:.2f} ms, last/first {latest / first:.2f}"
        )
        if control is not None:
            fresh = _median(control.samples, field)
            line += f"; fresh server now {fresh * 1e3:.2f} ms, last/fresh {latest / fresh:.2f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--window", type=int, default=50)
    args = parser.parse_args()

    def progress(index: int, sample: Sample) -> None:
        if index % 250 == 0:
            print(f"  round {index}: fds {sample.fds}, maps {sample.maps}", flush=True)

    window = min(args.window, args.rounds)
    with tempfile.TemporaryDirectory() as directory:
        churn = run(args.rounds, Path(directory) / "soak", progress)
        control = run(window, Path(directory) / "control")
    report(churn, window, control)


if __name__ == "__main__":
    main()
