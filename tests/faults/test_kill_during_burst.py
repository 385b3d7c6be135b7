"""kill -9 in the middle of a registration burst loses no acknowledged write and leaves no partial row.

Eight clients register and re-register ranks as fast as the server answers; the server is killed
with SIGKILL while requests are in flight, then started again on the same database. Every write the
server acknowledged must be there (a later, unacknowledged one may have committed too), and every
stored rank must be whole: its pools, views, instance and generation counter.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from tests.documents import rank_document
from tests.faults.conftest import WORKER, kill, query

CLIENTS = 8
RANKS = 4  # per instance (TP4): an instance is written by one client, rank by rank
BURST_S = 1.5
REQUEST_TIMEOUT_S = 30.0

Acked = dict[tuple[str, int], tuple[int, int]]  # (instance, rank) -> (generation, num_slots)


async def _client(url: str, client: int, acked: Acked, deadline: float) -> None:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, headers=WORKER) as session:
        for batch in range(10_000):
            instance = f"i{client}-{batch}"
            for rank in range(RANKS):
                for num_slots in (64, 65):  # the second write is a new generation
                    if time.monotonic() > deadline:
                        return
                    document = rank_document(tp_size=RANKS, tp_rank=rank, num_slots=num_slots)
                    path = f"/v1/deployments/burst/instances/{instance}/ranks/{rank}"
                    try:
                        async with session.put(url + path, json=document) as response:
                            if response.status in (200, 201):
                                generation = (await response.json())["generation"]
                                acked[instance, rank] = (generation, num_slots)
                    except (aiohttp.ClientError, TimeoutError):
                        return  # the server is gone: what was in flight is unacknowledged


async def _burst_then_kill(server: Any) -> Acked:
    acked: Acked = {}
    deadline = time.monotonic() + BURST_S + REQUEST_TIMEOUT_S
    clients = [
        asyncio.create_task(_client(server.url, client, acked, deadline))
        for client in range(CLIENTS)
    ]
    await asyncio.sleep(BURST_S)
    await asyncio.to_thread(kill, server)
    await asyncio.gather(*clients)
    return acked


RANK_ROWS = """
SELECT r.instance, r.rank, r.generation, d.document,
       (SELECT count(*) FROM pools p WHERE p.deployment = r.deployment
            AND p.instance = r.instance AND p.rank = r.rank),
       (SELECT count(*) FROM views v WHERE v.deployment = r.deployment
            AND v.instance = r.instance AND v.rank = r.rank),
       (SELECT count(*) FROM instances i WHERE i.deployment = r.deployment
            AND i.name = r.instance),
       (SELECT g.generation FROM rank_generations g WHERE g.deployment = r.deployment
            AND g.instance = r.instance AND g.rank = r.rank)
FROM ranks r LEFT JOIN rank_documents d ON d.deployment = r.deployment
    AND d.instance = r.instance AND d.rank = r.rank
WHERE r.deployment = 'burst'
"""


@pytest.mark.slow
def test_kill_9_during_a_registration_burst(servers, database_url) -> None:
    server = servers(database_url)
    acked = asyncio.run(_burst_then_kill(server))
    assert len(acked) >= CLIENTS, "the burst was too short to mean anything"

    server.start()  # the same database, after an unclean death
    ready = asyncio.run(_get(server.url + "/readyz"))
    assert ready == 200
    stored = {}
    for instance, rank, generation, document, pools, views, instances, counter in query(
        database_url, RANK_ROWS
    ):
        document = json.loads(document) if isinstance(document, str) else document
        assert (pools, views) == (len(document["pools"]), len(document["views"])), instance
        assert instances == 1
        assert counter is not None
        assert counter >= generation
        stored[instance, rank] = (generation, document["pools"][0]["num_slots"])
    for key, (generation, num_slots) in acked.items():
        assert key in stored, f"acknowledged {key} is gone"
        assert stored[key][0] >= generation
        if stored[key][0] == generation:
            assert stored[key][1] == num_slots


async def _get(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status
