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
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.api import create_app
from kvroute.api.keys import copy_engine_key, sessionmaker_key, transfer_service_key
from kvroute.store import jobs
from kvroute.store.engine import create_engine, make_sessionmaker
from kvroute.store.jobs import INTERRUPTED
from kvroute.store.models import TransferJob as JobRow
from kvroute.transfer import CopyEngine, TransferJob
from kvroute.transfer.jobs import CopyResult
from tests.api.conftest import ADMIN, WORKER, rank_path
from tests.transfer.conftest import Owners
from tests.world import Side, ViewClass, layout_rank

Client = TestClient[web.Request, web.Application]
GATE_S = 10.0
POLLS = 500  # x 10 ms
KV = [ViewClass(("key", "value"), "target", "hnd", 4, 2, 4)]
CONTEXT, GENERATION = Side("context", 2, (2,), seed=1), Side("generation", 1, (2,), seed=2)
TRANSFERS = "/v1/deployments/llama/transfers"


class GatedEngine(CopyEngine):
    """The real engine, held at a gate so a job stays running until the test opens it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def copy(self, job: TransferJob, **kwargs: Any) -> CopyResult:
        self.entered.set()
        if not self.gate.wait(GATE_S):
            raise TimeoutError("test gate never opened")
        return super().copy(job)


@pytest.fixture(scope="module")
def owners() -> Iterator[Owners]:
    started = Owners(("workers",))
    yield started
    started.stop()


@pytest.fixture
def segment(owners: Owners) -> Iterator[Callable[[int], str]]:
    created: list[str] = []

    def create(size: int) -> str:
        created.append(owners.create("workers", size, len(created)))
        return created[-1]

    yield create
    for name in created:
        owners.unlink("workers", name)


@pytest.fixture
def start(
    aiohttp_client: Any, make_settings: Callable[..., Any]
) -> Callable[..., Awaitable[Client]]:
    async def build(engine: CopyEngine | None = None, **overrides: Any) -> Client:
        app = create_app(make_settings(**overrides))
        if engine is not None:
            app[copy_engine_key] = engine
        client: Client = await aiohttp_client(app)
        return client

    return build


async def register_world(
    client: Client,
    segment: Callable[[int], str],
    *,
    receiver_memory: dict[str, Any] | None = None,
    context_ranks: tuple[int, ...] = (0, 1),
    generation: Side = GENERATION,
) -> None:
    """Context TP2 -> generation TP1 (HND, 4 heads), every pool in its own segment."""
    for side, name, ranks in ((CONTEXT, "ctx0", context_ranks), (generation, "gen0", (0,))):
        for rank in ranks:
            document = layout_rank(side, KV, rank, num_slots=4).doc
            for pool in document["pools"]:
                size = pool["slot_stride"] * pool["num_slots"]
                memory = {"backend": "shm", "name": segment(size)}
                pool["memory"] = (
                    receiver_memory if side is generation and receiver_memory else memory
                )
            response = await client.put(rank_path(name, rank), json=document, headers=WORKER)
            assert response.status == 201, await response.text()


def body(src: list[int], dst: list[int]) -> dict[str, Any]:
    return {
        "sender": "ctx0",
        "receiver": "gen0",
        "receiver_ranks": [0],
        "src_blocks": src,
        "dst_blocks": dst,
    }


async def submit(client: Client, src: list[int], dst: list[int]) -> dict[str, Any]:
    response = await client.post(TRANSFERS, json=body(src, dst), headers=WORKER)
    assert response.status == 202, await response.text()
    return dict(await response.json())


async def state_of(client: Client, job_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/transfers/{job_id}", headers=WORKER)
    assert response.status == 200
    return dict(await response.json())


async def until(client: Client, job_id: str, states: set[str]) -> dict[str, Any]:
    for _ in range(POLLS):
        job = await state_of(client, job_id)
        if job["state"] in states:
            return job
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job_id} never reached {states}")


async def wait_entered(engine: GatedEngine) -> None:
    assert await asyncio.to_thread(engine.entered.wait, GATE_S), "no job reached the engine"


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


# Generation blocks of 8 tokens beside context blocks of 4: 64 bytes a token (2 layers x K/V x 4
# heads x 4 bytes), the receiver's slot 0 holding tokens [0, 8) when a list starts there.
WIDE = Side("generation", 1, (2,), seed=2, tokens_per_block=8)
BYTES_PER_TOKEN = 2 * 2 * 4 * 4


async def test_a_token_range_moves_between_block_sizes(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    # tokens [5, 14): the sender's suffix list starts at token 4 (blocks 1..3 of 4 tokens),
    # the receiver's at token 0 (blocks of 8); both are derived by upstream's rule
    request = body([3, 1, 2], [2, 0]) | {"tokens": {"start": 5, "end": 14}}

    response = await client.post(TRANSFERS, json=request, headers=WORKER)

    assert response.status == 202, await response.text()
    job = await until(client, (await response.json())["id"], {"succeeded", "failed"})
    assert job["state"] == "succeeded", job["error"]
    assert job["bytes"] == 9 * BYTES_PER_TOKEN


async def test_lists_without_tokens_must_hold_the_same_tokens(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    same = await client.post(TRANSFERS, json=body([0, 1], [3]), headers=WORKER)
    assert same.status == 202, await same.text()
    assert (await same.json())["bytes"] == 8 * BYTES_PER_TOKEN

    response = await client.post(TRANSFERS, json=body([0, 1, 2], [3]), headers=WORKER)

    problem = await response.json()
    assert response.status == 422, problem
    assert (problem["code"], problem["field"], problem["token"]) == (
        "token_range_not_covered",
        "dst_blocks",
        8,
    )
    assert (problem["covered"], problem["tokens"]) == ([0, 8], [0, 12])


@pytest.mark.parametrize(
    ("members", "src", "dst", "expected"),
    [
        (  # the receiver's suffix list of one block starts at token 8: token 5 has no block
            {"tokens": {"start": 5, "end": 14}},
            [1, 2, 3],
            [0],
            {"code": "token_range_not_covered", "field": "dst_blocks", "token": 5,
             "covered": [8, 16], "tokens": [5, 14]},
        ),
        (  # named first tokens: the sender's list ends at token 12
            {"tokens": {"start": 5, "end": 14}, "src_first_token": 4, "dst_first_token": 0},
            [1, 2],
            [0, 1],
            {"code": "token_range_not_covered", "field": "src_blocks", "token": 12,
             "covered": [4, 12], "tokens": [5, 14]},
        ),
        (
            {"tokens": {"start": 9, "end": 9}},
            [1],
            [0],
            {"code": "invalid_transfer", "field": "tokens"},
        ),
        (  # three blocks of 4 cannot end at token 4
            {"tokens": {"start": 0, "end": 4}},
            [0, 1, 2],
            [0],
            {"code": "invalid_transfer", "field": "src_blocks"},
        ),
    ],
)  # fmt: skip
async def test_token_ranges_the_lists_do_not_cover_are_422_naming_the_first_gap(
    start, segment, members, src, dst, expected
) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)

    response = await client.post(TRANSFERS, json=body(src, dst) | members, headers=WORKER)

    problem = await response.json()
    assert response.status == 422, problem
    assert {key: problem[key] for key in expected} == expected
    assert await jobs.list_jobs(client.app[sessionmaker_key], "llama") == []


async def test_a_token_range_member_outside_the_schema_is_refused(start, segment) -> None:
    client = await start()
    await register_world(client, segment, generation=WIDE)
    request = body([1], [0]) | {"tokens": {"start": 0, "end": 4, "step": 1}}

    response = await client.post(TRANSFERS, json=request, headers=WORKER)

    assert response.status in (400, 422)
    assert await jobs.list_jobs(client.app[sessionmaker_key], "llama") == []
