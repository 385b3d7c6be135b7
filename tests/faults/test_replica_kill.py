"""A replica killed with transfer jobs in flight: its rows fail on its restart, the others' do not.

Two replicas (``a`` and ``b``) share one PostgreSQL and one set of worker segments, each with one
transfer worker and a queue of slow jobs. ``b`` is frozen (SIGSTOP) with jobs queued and running,
``a`` is killed with SIGKILL in the same state and started again under its name: every job ``a`` had
in flight is failed as interrupted, while ``b``'s rows are left alone and finish once ``b`` resumes.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvroute.store.jobs import INTERRUPTED
from tests.faults.conftest import kill, query
from tests.faults.transfers import register_world, submit, wait_final

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

JOBS = 12  # per replica; each copies 16 blocks of 16 MiB, so most are still queued at the kill
BLOCKS = list(range(16))
IN_FLIGHT = ("queued", "running")
ROWS = "SELECT id, replica, state, error FROM transfer_jobs"


def _rows(database_url: str) -> dict[str, tuple[str, str, Any]]:
    return {
        job: (replica, state, error) for job, replica, state, error in query(database_url, ROWS)
    }


def _flood(base: str) -> list[str]:
    accepted = []
    for _ in range(JOBS):
        status, job = submit(base, BLOCKS)
        assert status == 202, job
        accepted.append(job["id"])
    return accepted


def test_a_killed_replica_fails_only_its_own_jobs_on_restart(
    servers, postgres_test_url, owners
) -> None:
    one_worker = {"KVROUTE_TRANSFER_WORKERS": "1"}
    with ThreadPoolExecutor(max_workers=2) as pool:  # two starts at once: half the wait
        a, b = pool.map(lambda name: servers(postgres_test_url, name=name, **one_worker), "ab")
    # 32 layers of 512 KiB: 16 MiB slots, 256 MiB per 16-block job. With 64 MiB jobs a quiet
    # machine copied them about as fast as they were submitted: 2-4 of 12 were left in flight.
    register_world(a.url, owners, num_layers=32, head_dim=4096, num_slots=16)

    b_jobs = _flood(b.url)
    assert b.process is not None
    b.process.send_signal(signal.SIGSTOP)  # b's queue stays as it is until SIGCONT
    a_jobs = _flood(a.url)
    kill(a)
    before = _rows(postgres_test_url)
    a_in_flight = [job for job in a_jobs if before[job][1] in IN_FLIGHT]
    b_in_flight = [job for job in b_jobs if before[job][1] in IN_FLIGHT]
    assert a_in_flight, "every job of a finished before the kill: make them slower"
    assert b_in_flight, "every job of b finished before the freeze: make them slower"

    a.start()  # the same replica id: recovery fails what its previous process left in flight
    for job in a_jobs:
        wait_final(a.url, job)
    after = _rows(postgres_test_url)

    for job in a_in_flight:
        assert after[job] == ("a", "failed", INTERRUPTED)
    for job in set(a_jobs) - set(a_in_flight):
        assert after[job] == before[job]  # finished before the kill: untouched
    for job in b_jobs:
        assert after[job] == before[job]  # another replica's rows: untouched
    b.process.send_signal(signal.SIGCONT)
    for job in b_in_flight:
        assert wait_final(b.url, job)["state"] == "succeeded"
