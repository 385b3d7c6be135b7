"""Transfer jobs and their memory: a job's row exists before it runs, a shrunk segment fails a job.

Uses this package's fixtures and world (segments of a separate owner process, the real app
factory, a gated copy engine).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvroute.api.keys import sessionmaker_key
from kvroute.store import jobs
from kvroute.store.errors import NotFound
from kvroute.transfer import CopyEngine, TransferJob
from kvroute.transfer.jobs import CopyResult
from tests.api.conftest import WORKER, rank_path
from tests.api.transfers.world import (
    GATE_S,
    GENERATION,
    KV,
    TRANSFERS,
    GatedEngine,
    body,
    register_world,
    submit,
    until,
    wait_entered,
)
from tests.world import layout_rank


class RowWitness(CopyEngine):
    """The real engine, which first looks up the job's row from the worker thread."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, bool] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sessionmaker: Any = None

    def copy(self, job: TransferJob, **kwargs: Any) -> CopyResult:
        assert self.loop is not None
        lookup = jobs.get_job(self.sessionmaker, job.job_id)
        try:
            asyncio.run_coroutine_threadsafe(lookup, self.loop).result(GATE_S)
            self.rows[job.job_id] = True
        except NotFound:
            self.rows[job.job_id] = False
        return super().copy(job)


async def test_a_job_s_row_exists_before_the_job_can_run(start, segment) -> None:
    engine = RowWitness()
    client = await start(engine, transfer_workers=2)
    engine.loop, engine.sessionmaker = asyncio.get_running_loop(), client.app[sessionmaker_key]
    await register_world(client, segment)

    accepted = [await submit(client, [block], [block]) for block in range(4)]
    for job in accepted:
        await until(client, job["id"], {"succeeded"})

    assert engine.rows == {job["id"]: True for job in accepted}


async def test_a_segment_shrunk_while_its_job_waits_fails_the_job_not_the_server(
    start, segment, owners
) -> None:
    """The issue's SIGBUS: the receiver truncates its segment after the job was accepted."""
    engine = GatedEngine()
    client = await start(engine, transfer_workers=1)
    await register_world(client, segment)
    document = layout_rank(GENERATION, KV, 0, num_slots=4).doc
    pool = document["pools"][0]
    shrinking = segment(pool["slot_stride"] * pool["num_slots"])
    pool["memory"] = {"backend": "shm", "name": shrinking}
    response = await client.put(rank_path("gen1", 0), json=document, headers=WORKER)
    assert response.status == 201, await response.text()
    running = await submit(client, [0], [0])  # ctx0 -> gen0, held in the engine
    await wait_entered(engine)
    waiting = await client.post(
        TRANSFERS, json={**body([1], [1]), "receiver": "gen1"}, headers=WORKER
    )
    assert waiting.status == 202, await waiting.text()

    owners.truncate("workers", shrinking, 0)
    engine.gate.set()
    failed = await until(client, (await waiting.json())["id"], {"failed", "succeeded"})

    assert failed["state"] == "failed"
    assert f"receiver: segment '{shrinking}': mapping is 0 bytes" in failed["error"]
    assert "checked as the job started" in failed["error"]
    assert (await until(client, running["id"], {"succeeded", "failed"}))["state"] == "succeeded"
    refused = await client.post(
        TRANSFERS, json={**body([2], [2]), "receiver": "gen1"}, headers=WORKER
    )
    assert refused.status == 422
    assert (await refused.json())["code"] == "pool_memory_unavailable"
    assert await until(client, (await submit(client, [3], [3]))["id"], {"succeeded"})
