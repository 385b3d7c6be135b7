"""A worker shrinks its shm segment under a live kvroute: the job fails clearly, the server lives.

Before the fix the cached mapping of the truncated segment was reused and the next job's copy
killed ``kvroute serve`` with SIGBUS (exit 135). The segment belongs to a separate worker process,
as in production; the job rows are checked on both databases.
"""

from __future__ import annotations

import pytest

from tests.faults.conftest import query
from tests.faults.transfers import call, register_world, submit, wait_final

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
