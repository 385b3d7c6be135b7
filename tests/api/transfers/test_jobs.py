"""Transfer endpoints through the real app factory: refusals, cancellation, back-pressure, restart.

Pools are shared-memory segments created by a separate owner process; a gated copy engine (the
real engine, held until the test opens its gate) keeps a job running for as long as a test needs.
Copy correctness across layouts is tests/e2e/test_transfers_e2e.py's subject.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from kvroute.api.keys import sessionmaker_key, transfer_service_key
from kvroute.store import jobs
from kvroute.store.engine import create_engine, make_sessionmaker
from kvroute.store.jobs import INTERRUPTED
from kvroute.store.models import TransferJobRow as JobRow
from tests.api.conftest import ADMIN, WORKER
from tests.api.transfers.world import (
    GATE_S,
    TRANSFERS,
    GatedEngine,
    body,
    register_world,
    state_of,
    submit,
    until,
    wait_entered,
)


async def test_job_runs_and_is_reported_from_the_database(start, segment) -> None:
    client = await start()
    await register_world(client, segment)

    accepted = await submit(client, [3, 1], [0, 2])
    job = await until(client, accepted["id"], {"succeeded", "failed"})

    assert accepted["state"] == "queued"
    assert job["state"] == "succeeded", job["error"]
    assert (job["receiver_ranks"], job["blocks"], job["error"]) == ([0], 2, None)
    assert job["bytes"] > 0
    assert job["fragments"] > 0
    assert job["started_at"] <= job["finished_at"]
    assert job["duration_seconds"] >= 0
    async with client.app[sessionmaker_key]() as session:
        stored = await session.get(JobRow, accepted["id"])
    assert stored is not None
    assert (stored.state, stored.src_blocks, stored.dst_blocks) == ("succeeded", [3, 1], [0, 2])
    metrics = await (await client.get("/metrics")).text()
    assert 'kvroute_transfer_jobs_total{state="succeeded"} 1.0' in metrics
    assert f"kvroute_transfer_bytes_total {float(job['bytes'])}" in metrics
    assert "kvroute_transfer_duration_seconds_count 1.0" in metrics
    assert "kvroute_transfer_queue_depth 0.0" in metrics
    ready = await (await client.get("/readyz")).json()
    assert ready["checks"]["transfer_pool"] == "ok"


async def test_recent_jobs_are_listed_newest_first_for_admins(start, segment) -> None:
    client = await start()
    await register_world(client, segment)
    first = await submit(client, [0], [1])
    await until(client, first["id"], {"succeeded"})
    second = await submit(client, [2, 3], [3, 2])
    await until(client, second["id"], {"succeeded"})

    listed = await client.get(TRANSFERS, headers=ADMIN)
    assert listed.status == 200
    answer = await listed.json()
    assert answer["deployment"] == "llama"
    assert [(job["id"], job["blocks"], job["state"]) for job in answer["transfers"]] == [
        (second["id"], 2, "succeeded"),
        (first["id"], 1, "succeeded"),
    ]
    assert answer["transfers"][0] == await state_of(client, second["id"])
    limited = await (await client.get(TRANSFERS + "?limit=1", headers=ADMIN)).json()
    assert [job["id"] for job in limited["transfers"]] == [second["id"]]
    assert (await client.get(TRANSFERS, headers=WORKER)).status == 403
    other = await client.get("/v1/deployments/other/transfers", headers=ADMIN)
    assert (await other.json())["transfers"] == []


async def test_queued_job_is_cancelled_running_and_finished_ones_are_not(start, segment) -> None:
    engine = GatedEngine()
    client = await start(engine, transfer_workers=1)
    await register_world(client, segment)
    running = await submit(client, [0], [0])
    await wait_entered(engine)
    queued = await submit(client, [1], [1])

    cancelled = await client.delete(f"/v1/transfers/{queued['id']}", headers=WORKER)
    refused = await client.delete(f"/v1/transfers/{running['id']}", headers=WORKER)
    engine.gate.set()
    done = await until(client, running["id"], {"succeeded"})
    again = await client.delete(f"/v1/transfers/{running['id']}", headers=WORKER)

    assert cancelled.status == 200
    assert (await cancelled.json())["state"] == "cancelled"
    assert (await state_of(client, queued["id"]))["error"] == "cancelled before it started"
    assert refused.status == 409
    assert "running" in (await refused.json())["detail"]
    assert done["state"] == "succeeded"
    assert again.status == 409
    assert "already succeeded" in (await again.json())["detail"]


async def test_full_queue_answers_429_with_retry_after_and_stores_nothing(start, segment) -> None:
    engine = GatedEngine()
    client = await start(engine, transfer_workers=1, transfer_queue_size=1)
    await register_world(client, segment)
    await submit(client, [0], [0])
    await wait_entered(engine)
    await submit(client, [1], [1])

    response = await client.post(TRANSFERS, json=body([2], [2]), headers=WORKER)

    assert response.status == 429
    assert int(response.headers["Retry-After"]) >= 1
    assert (await response.json())["code"] == "queue_full"
    assert len(await jobs.list_jobs(client.app[sessionmaker_key], "llama")) == 2
    metrics = await (await client.get("/metrics")).text()
    assert 'kvroute_transfer_rejected_total{reason="queue_full"} 1.0' in metrics
    engine.gate.set()


@pytest.mark.parametrize(
    ("src", "dst", "field", "words"),
    [
        ([0, 9], [0, 1], "src_blocks[1]", ["block id 9", "pool 0 of ctx0 rank", "num_slots 4"]),
        ([0, 1], [7, 1], "dst_blocks[0]", ["block id 7", "pool 0 of gen0 rank 0", "num_slots 4"]),
        ([0, 1], [2], "dst_blocks", ["has 1 block ids but src_blocks has 2"]),
        ([0, 1], [2, 2], "dst_blocks", ["block id 2 appears more than once"]),
    ],
)
async def test_bad_block_lists_are_422_naming_the_id_and_the_pool(
    start, segment, src, dst, field, words
) -> None:
    client = await start()
    await register_world(client, segment)

    response = await client.post(TRANSFERS, json=body(src, dst), headers=WORKER)

    problem = await response.json()
    assert response.status == 422, problem
    assert (problem["code"], problem["field"]) == ("invalid_transfer", field)
    assert all(word in problem["detail"] for word in words), problem["detail"]
    assert await jobs.list_jobs(client.app[sessionmaker_key], "llama") == []


async def test_missing_shm_segment_is_422_naming_pool_backend_and_reason(start, segment) -> None:
    client = await start()
    missing = {"backend": "shm", "name": "kvroute-test-never-created"}
    await register_world(client, segment, receiver_memory=missing)

    response = await client.post(TRANSFERS, json=body([0], [0]), headers=WORKER)

    problem = await response.json()
    assert response.status == 422, problem
    assert problem["code"] == "pool_memory_unavailable"
    assert (problem["instance"], problem["rank"], problem["pool"]) == ("gen0", 0, 0)
    assert problem["backend"] == "shm"
    assert "no shared memory segment named 'kvroute-test-never-created'" in problem["reason"]


async def test_missing_sender_rank_is_409_naming_it(start, segment) -> None:
    client = await start()
    await register_world(client, segment, context_ranks=(0,))

    response = await client.post(TRANSFERS, json=body([0], [0]), headers=WORKER)

    assert response.status == 409
    assert "missing or expired: 1" in (await response.json())["detail"]


async def test_unknown_instances_and_jobs_are_404(start) -> None:
    client = await start()

    submitted = await client.post(TRANSFERS, json=body([0], [0]), headers=WORKER)
    read = await client.get("/v1/transfers/no-such-job", headers=WORKER)
    cancelled = await client.delete("/v1/transfers/no-such-job", headers=ADMIN)

    assert (submitted.status, read.status, cancelled.status) == (404, 404, 404)


async def test_transfers_need_a_token(start) -> None:
    client = await start()

    response = await client.post(TRANSFERS, json=body([0], [0]))

    assert response.status == 401


async def test_restart_fails_the_jobs_of_the_previous_process(start, segment) -> None:
    engine = GatedEngine()
    first = await start(engine, transfer_workers=1)
    await register_world(first, segment)
    running = await submit(first, [0], [0])
    await wait_entered(engine)
    queued = await submit(first, [1], [1])
    await until(first, running["id"], {"running"})

    second = await start()  # a new process on the same database
    engine.gate.set()  # the first process's late result must not revive its job
    async with asyncio.timeout(GATE_S):
        await first.app[transfer_service_key].settled(running["id"])

    for job in (running, queued):
        seen = await state_of(second, job["id"])
        assert (seen["state"], seen["error"]) == ("failed", INTERRUPTED)
    refused = await second.delete(f"/v1/transfers/{queued['id']}", headers=WORKER)
    assert refused.status == 409


async def test_a_job_queued_by_another_process_is_409_here(start, segment) -> None:
    engine = GatedEngine()
    owner = await start(engine, transfer_workers=1)
    replica = await start()  # a second process on the same database
    await register_world(owner, segment)
    await submit(owner, [0], [0])
    await wait_entered(engine)
    queued = await submit(owner, [1], [1])

    refused = await replica.delete(f"/v1/transfers/{queued['id']}", headers=WORKER)
    seen = await state_of(replica, queued["id"])
    engine.gate.set()

    assert refused.status == 409
    assert "in another kvroute process" in (await refused.json())["detail"]
    assert seen["state"] == "queued"


async def test_shutdown_cancels_queued_jobs_and_lets_the_running_one_finish(
    start, segment, database_url
) -> None:
    engine = GatedEngine()
    client = await start(engine, transfer_workers=1, shutdown_timeout_seconds=5)
    await register_world(client, segment)
    running = await submit(client, [0], [0])
    await wait_entered(engine)
    queued = await submit(client, [1], [1])
    threading.Timer(0.2, engine.gate.set).start()  # the copy ends while shutdown waits for it

    await client.close()

    store = create_engine(database_url)
    try:
        sessionmaker = make_sessionmaker(store)
        finished = await jobs.get_job(sessionmaker, running["id"])
        drained = await jobs.get_job(sessionmaker, queued["id"])
    finally:
        await store.dispose()
    assert (finished.state, finished.error) == ("succeeded", None)
    assert (drained.state, drained.error) == ("cancelled", "cancelled: kvroute is draining")


NO_TORCH = """
import asyncio, sys
sys.modules["torch"] = None  # import torch now raises ImportError, as in the control-plane image
from aiohttp.test_utils import TestClient, TestServer
from kvroute.api import create_app
from kvroute.settings import Settings

async def main():
    app = create_app(Settings(database_url=sys.argv[1]))
    async with TestClient(TestServer(app)) as client:
        ready = await client.get("/readyz")
        body = {"sender": "a", "receiver": "b", "receiver_ranks": [0],
                "src_blocks": [0], "dst_blocks": [0]}
        post = await client.post("/v1/deployments/d/transfers", json=body)
        got = await client.get("/v1/transfers/x")
        print(ready.status, sorted((await ready.json())["checks"]), post.status,
              (await post.json())["code"], got.status)

asyncio.run(main())
"""


def test_without_torch_the_control_plane_serves_and_transfers_answer_503(sqlite_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH, sqlite_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "200 ['database', 'draining'] 503 no_data_plane 404"
