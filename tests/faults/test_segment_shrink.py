"""A worker shrinks its pool under a live kvroute: the server lives.

A plain shm segment (the opt-in) can shrink: before the first fix the cached mapping of the
truncated segment was reused and the next job's copy killed ``kvroute serve`` with SIGBUS (exit
135); now the job fails clearly. A sealed memfd (the default of ``kvroute.client``) cannot shrink at
all: the worker's ``ftruncate`` fails while long copies run through it, and they complete. The pools
belong to a separate worker process, as in production; the job rows are checked on both databases.
"""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from datetime import datetime

import pytest

from tests.faults.conftest import query
from tests.faults.transfers import JOB_WAIT_S, call, register_world, submit, wait_final
from tests.transfer.shm_owner import seeded_bytes

pytestmark = pytest.mark.slow


def test_a_segment_shrunk_between_jobs_fails_the_next_job_not_the_server(
    servers, database_url, owners
) -> None:
    server = servers(database_url)
    world = register_world(server.url, owners)
    receiver = world.segments["gen0"]
    status, first = submit(server.url, [0, 1])
    assert status == 202, first
    assert wait_final(server.url, first["id"])["state"] == "succeeded"

    owners.truncate("workers", receiver, 0)  # same file, same name, 0 bytes
    status, refused = submit(server.url, [2])

    assert status == 422, refused
    assert refused["code"] == "pool_memory_unavailable"
    assert (refused["instance"], refused["rank"], refused["backend"]) == ("gen0", 0, "shm")
    assert f"segment '{receiver}': mapping is 0 bytes" in refused["reason"]
    assert server.process is not None
    assert server.process.poll() is None
    assert call("GET", server.url + "/readyz")[0] == 200

    owners.truncate("workers", receiver, world.pool_bytes)  # the worker restores its pool
    status, again = submit(server.url, [3])
    assert status == 202, again
    assert wait_final(server.url, again["id"])["state"] == "succeeded"
    stored = query(database_url, "SELECT id, state FROM transfer_jobs ORDER BY created_at")
    assert stored == [(first["id"], "succeeded"), (again["id"], "succeeded")]


# 1 MiB slots (32 layers of K and V, 8 heads x 4 tokens x 128 bf16): each job copies 256 MiB.
LONG_COPY = {"num_layers": 32, "head_dim": 128, "num_slots": 256}
JOBS = 5  # queued behind one another on the two workers: seconds of copying to shrink under


def test_a_sealed_pool_cannot_shrink_under_long_copies_and_they_complete(
    servers, database_url, owners
) -> None:
    server = servers(database_url)
    world = register_world(server.url, owners, sealed=True, **LONG_COPY)
    receiver = int(world.memories["gen0"]["fd"])
    blocks = list(range(LONG_COPY["num_slots"]))

    # The worker keeps trying to shrink its pool, as fast as it can, from before the first job is
    # submitted until every job has ended. Started after the submissions (as it once was), the
    # attempts began after the last copy on a quiet machine, and nothing was shown.
    attempts: list[tuple[float, float, int | None]] = []
    ended = threading.Event()

    def shrink() -> None:
        while not ended.is_set():
            before = time.time()
            refused = owners.memfd_truncate("workers", receiver, 0)
            attempts.append((before, time.time(), refused))

    worker = threading.Thread(target=shrink)
    worker.start()
    try:
        deadline = time.monotonic() + JOB_WAIT_S
        while not attempts:  # refused already: the seal holds with no copy running, too
            assert time.monotonic() < deadline, "the worker never answered a truncate"
            time.sleep(0.01)
        accepted = []
        for _ in range(JOBS):
            status, job = submit(server.url, blocks)
            assert status == 202, job
            accepted.append(job["id"])
        finals = {job_id: wait_final(server.url, job_id) for job_id in accepted}
    finally:
        ended.set()
        worker.join(timeout=JOB_WAIT_S)

    assert [finals[job_id]["state"] for job_id in accepted] == ["succeeded"] * JOBS, finals
    assert {refused for _, _, refused in attempts} == {errno.EPERM}
    # The jobs copy back to back on the two workers: between the first start and the last end.
    started = min(_stamp(job["started_at"]) for job in finals.values())
    finished = max(_stamp(job["finished_at"]) for job in finals.values())
    during = [
        (before, after) for before, after, _ in attempts if started < before < after < finished
    ]
    assert during, "no truncate attempt fell inside a running copy; make the copies longer"
    assert server.process is not None
    assert server.process.poll() is None
    assert call("GET", server.url + "/readyz")[0] == 200
    sender = seeded_bytes(0, world.pool_bytes).tobytes()
    assert owners.memfd_digest("workers", receiver) == hashlib.sha256(sender).hexdigest()
    stored = query(database_url, "SELECT state FROM transfer_jobs")
    assert stored == [("succeeded",)] * JOBS
    for memory in world.memories.values():
        owners.memfd_close("workers", int(memory["fd"]))


def _stamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()
