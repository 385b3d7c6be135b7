"""The transfer tests' world: context TP2 -> generation TP1 over shm segments, a gated engine,
and the calls every test makes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.transfer import CopyEngine, TransferJob
from kvroute.transfer.jobs import CopyResult
from tests.api.conftest import WORKER, rank_path
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


# Generation blocks of 8 tokens beside context blocks of 4: 64 bytes a token (2 layers x K/V x 4
# heads x 4 bytes), the receiver's slot 0 holding tokens [0, 8) when a list starts there.
WIDE = Side("generation", 1, (2,), seed=2, tokens_per_block=8)
BYTES_PER_TOKEN = 2 * 2 * 4 * 4
