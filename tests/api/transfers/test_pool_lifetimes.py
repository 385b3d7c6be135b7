"""Pools a job opened are closed once no job uses them and their rank is gone (issue 20).

Ranks come and go as real workers' do: registered over pools of a separate owner process (named
``/dev/shm`` segments or sealed memfds), used by one job, then deleted, re-registered or left to
expire, and the worker frees the memory. What kvroute still holds is read from this process's own
``/proc/self/fd`` and ``/proc/self/maps`` (the app runs in the test process), not from its metrics
alone. Before the fix every round left its descriptors and mappings behind.
"""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kvroute.api.keys import sessionmaker_key
from kvroute.api.lifecycle import _reap_round
from kvroute.store import jobs
from tests.api.conftest import ADMIN, WORKER, rank_path
from tests.api.transfers.world import (
    CONTEXT,
    GENERATION,
    KV,
    TRANSFERS,
    GatedEngine,
    body,
    until,
    wait_entered,
)
from tests.transfer.conftest import Owners
from tests.world import layout_rank

ROUNDS = 6
GRACE = timedelta(hours=1)
RANKS = (("ctx0", CONTEXT, 0), ("ctx0", CONTEXT, 1), ("gen0", GENERATION, 0))


class Memories:
    """The owner process's pools for one round of ranks: plain segments or sealed memfds."""

    def __init__(self, owners: Owners, backend: str) -> None:
        self._owners = owners
        self._backend = backend
        self._live: list[dict[str, Any]] = []

    def create(self, size: int) -> dict[str, Any]:
        if self._backend == "memfd":
            memory = self._owners.memfd("workers", size, seed=len(self._live))
        else:
            name = self._owners.create("workers", size, len(self._live))
            memory = {"backend": "shm", "name": name}
        self._live.append(memory)
        return memory

    def free(self) -> None:
        """The worker frees every pool it made (closes its memfds, unlinks its segments)."""
        for memory in self._live:
            if memory["backend"] == "memfd":
                self._owners.memfd_close("workers", memory["fd"])
            else:
                self._owners.unlink("workers", memory["name"])
        self._live.clear()


def held_by_this_process() -> tuple[int, int]:
    """(descriptors, mappings) of this process that lead to the test's pools, freed ones included."""
    ours = re.compile(rf"(/dev/shm/|/memfd:)kvroute-test-{os.getpid()}-")
    descriptors = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            descriptors += bool(ours.match(os.readlink(f"/proc/self/fd/{entry}")))
        except OSError:
            continue
    maps = Path("/proc/self/maps").read_text().splitlines()
    return descriptors, sum(bool(ours.search(line)) for line in maps)


async def register(client, memories: Memories, *, lease: int = 30) -> None:
    for instance, side, rank in RANKS:
        document = layout_rank(side, KV, rank, num_slots=4).doc | {"lease_seconds": lease}
        for pool in document["pools"]:
            pool["memory"] = memories.create(pool["slot_stride"] * pool["num_slots"])
        response = await client.put(rank_path(instance, rank), json=document, headers=WORKER)
        assert response.status in (200, 201), await response.text()


async def one_job(client) -> None:
    response = await client.post(TRANSFERS, json=body([0, 1], [2, 3]), headers=WORKER)
    assert response.status == 202, await response.text()
    job = await until(client, (await response.json())["id"], {"succeeded", "failed"})
    assert job["state"] == "succeeded", job["error"]


async def open_pools(client) -> float:
    metrics = await (await client.get("/metrics")).text()
    (value,) = re.findall(r"^kvroute_open_pools (\S+)$", metrics, re.MULTILINE)
    descriptors = re.findall(r"^kvroute_open_pool_descriptors (\S+)$", metrics, re.MULTILINE)
    assert descriptors == [str(float(value) * 2)]  # two per shm or memfd mapping
    return float(value)


@pytest.fixture(params=["memfd", "shm"])
def memories(request, owners: Owners) -> Memories:
    return Memories(owners, request.param)


async def test_deleted_ranks_leave_no_descriptor_or_mapping_behind(start, memories) -> None:
    client = await start()
    for round_ in range(ROUNDS):
        await register(client, memories)
        await one_job(client)
        assert held_by_this_process() == (6, 3)  # three pools, each mapped with two descriptors
        path = "/v1/deployments/llama/instances/{}"
        gone = await client.delete(path.format("ctx0"), headers=ADMIN)  # a whole instance
        assert gone.status == 204
        gone = await client.delete(rank_path("gen0", 0), headers=ADMIN)  # one rank
        assert gone.status == 204
        memories.free()
        assert held_by_this_process() == (0, 0), f"round {round_}"
    assert await open_pools(client) == 0


async def test_re_registered_ranks_keep_only_their_current_pools_open(start, memories) -> None:
    client = await start()
    for _ in range(ROUNDS):
        await register(client, memories)  # the same ranks, over new pools: a new generation
        await one_job(client)
        assert held_by_this_process() == (6, 3)  # the current generation's three pools
    assert await open_pools(client) == 3


async def test_expired_ranks_pools_are_closed_by_the_reaper_round(start, memories) -> None:
    client = await start(lease_grace_seconds=3600)  # expired, not yet reaped: only the lease ends
    await register(client, memories, lease=5)
    await one_job(client)
    assert held_by_this_process() == (6, 3)
    now = datetime.now(UTC)

    await _reap_round(client.app, since=now, now=now + timedelta(seconds=10), grace=GRACE)

    assert held_by_this_process() == (0, 0)
    assert await open_pools(client) == 0
    memories.free()


async def test_a_job_needing_more_open_pools_than_allowed_is_503_with_retry_after(
    start, owners: Owners
) -> None:
    engine = GatedEngine()
    client = await start(engine=engine, transfer_max_open_pools=3)
    first_round, second_round = Memories(owners, "memfd"), Memories(owners, "memfd")
    await register(client, first_round)
    running = await client.post(TRANSFERS, json=body([0], [1]), headers=WORKER)
    assert running.status == 202, await running.text()
    await wait_entered(engine)  # its three pools are in use until the gate opens
    await register(client, second_round)

    refused = await client.post(TRANSFERS, json=body([1], [2]), headers=WORKER)

    problem = await refused.json()
    assert refused.status == 503, problem
    assert problem["code"] == "pools_exhausted"
    assert "KVROUTE_TRANSFER_MAX_OPEN_POOLS=3" in problem["detail"]
    assert int(refused.headers["Retry-After"]) >= 1
    assert len(await jobs.list_jobs(client.app[sessionmaker_key], "llama")) == 1
    engine.gate.set()
    await until(client, (await running.json())["id"], {"succeeded"})
    retried = await client.post(TRANSFERS, json=body([1], [2]), headers=WORKER)
    assert retried.status == 202, await retried.text()
    await until(client, (await retried.json())["id"], {"succeeded"})
    first_round.free()
    second_round.free()
