"""Two ``kvroute serve`` processes on one PostgreSQL under concurrent fleet churn.

Every rank is driven by its own worker, as in a real fleet: it registers (through either process),
heartbeats (sometimes too late, so its lease expires), deletes itself or registers a changed
document. Operations of one rank are sequential, so the rank's expected final state follows from
its own acknowledged operations (a sequential model); ranks of all instances run concurrently.
Two geometry families share the deployment (head_dim 128 and 64): instances of one family refuse
those of the other, so which ones get in depends on timing. Checked:

* no compatible rank refused: every refusal names a peer of the other family;
* no incompatible pair both live: a compatibility matrix read while the churn runs, and the final
  one, never show an incompatible pair;
* every acknowledged write present: each rank's final row is what its last acknowledged operation
  left (its generation, or no row after a delete), and a heartbeat refused as expired only ever
  came after the lease the rank last heard of had ended.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest

from tests.api.documents import rank_document

pytestmark = pytest.mark.postgres

DEPLOYMENT = "churn"
RUN_SECONDS = 6.0
REQUEST_SECONDS = 15.0
FAMILIES = {"ctx0": 128, "ctx1": 128, "gen0": 128, "gen1": 128, "ctx9": 64, "gen9": 64}
TP = 2


@dataclass
class RankLog:
    instance: str
    rank: int
    generation: int | None = None  # of the last acknowledged registration; None once deleted
    lease_expires_at: datetime | None = None
    refusals: list[dict[str, Any]] = field(default_factory=list)
    late_heartbeats: list[tuple[datetime | None, datetime]] = field(default_factory=list)


def _document(instance: str, rank: int, lease: int, variant: int) -> dict[str, Any]:
    role = "context" if instance.startswith("ctx") else "generation"
    document = rank_document(
        role=role, tp_size=TP, tp_rank=rank, head_dim=FAMILIES[instance], lease_seconds=lease
    )
    document["endpoint"] = f"127.0.0.1:{7000 + variant}"  # a changed document: a new generation
    return document


async def _worker(
    session: aiohttp.ClientSession, bases: list[str], log: RankLog, seed: int
) -> None:
    rng = random.Random(seed)
    path = f"/v1/deployments/{DEPLOYMENT}/instances/{log.instance}/ranks/{log.rank}"
    deadline = time.monotonic() + RUN_SECONDS
    while time.monotonic() < deadline:
        base = rng.choice(bases)
        action = rng.choices(["register", "heartbeat", "delete", "pause"], [4, 6, 1, 2])[0]
        if action == "register":
            document = _document(log.instance, log.rank, rng.choice([1, 2, 30]), rng.randrange(3))
            async with session.put(base + path, json=document) as response:
                body = await response.json()
                if response.status in (200, 201):
                    log.generation = body["generation"]
                    log.lease_expires_at = datetime.fromisoformat(body["lease_expires_at"])
                else:
                    assert response.status == 409, body
                    log.refusals.append(body)
        elif action == "heartbeat":
            async with session.post(base + path + "/heartbeat") as response:
                body = await response.json()
                if response.status == 200:
                    log.lease_expires_at = datetime.fromisoformat(body["lease_expires_at"])
                else:
                    assert response.status == 404, body
                    log.late_heartbeats.append((log.lease_expires_at, datetime.now(UTC)))
        elif action == "delete":
            async with session.delete(base + path) as response:
                assert response.status in (204, 404)
                log.generation = log.lease_expires_at = None
        else:
            await asyncio.sleep(rng.uniform(0.5, 1.5))  # long enough for a 1 s lease to end


async def _matrix(
    session: aiohttp.ClientSession, base: str, deployment: str = DEPLOYMENT
) -> list[dict[str, Any]]:
    async with session.get(f"{base}/v1/deployments/{deployment}/compatibility") as response:
        if response.status == 404:
            return []  # the deployment's first rank has not registered yet
        assert response.status == 200
        return list((await response.json())["pairs"])


async def _watch(session: aiohttp.ClientSession, base: str, deployment: str = DEPLOYMENT) -> int:
    """Reads the matrix during the churn; returns how many it read."""
    deadline, reads = time.monotonic() + RUN_SECONDS, 0
    while time.monotonic() < deadline:
        pairs = await _matrix(session, base, deployment)
        assert not [p for p in pairs if p["status"] == "incompatible"], pairs
        reads += 1
        await asyncio.sleep(0.05)
    return reads


async def test_concurrent_churn_matches_the_sequential_model(servers: list[str]) -> None:
    logs = [RankLog(instance, rank) for instance in FAMILIES for rank in range(TP)]
    timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        *_, reads = await asyncio.gather(
            *(_worker(session, servers, log, seed) for seed, log in enumerate(logs)),
            _watch(session, servers[1]),
        )
        final = await _matrix(session, servers[0])
        rows = {}
        for log in logs:
            url = f"{servers[0]}/v1/deployments/{DEPLOYMENT}/instances/{log.instance}/ranks/{log.rank}"
            async with session.get(url) as response:
                rows[log.instance, log.rank] = await response.json() if response.ok else None
    assert reads > 10
    assert not [p for p in final if p["status"] == "incompatible"], final
    for log in logs:
        for refusal in log.refusals:
            assert refusal["code"] == "head_dim_mismatch", refusal
            assert FAMILIES[refusal["peer_instance"]] != FAMILIES[log.instance], refusal
        for known, refused_at in log.late_heartbeats:
            assert known is None or known <= refused_at, (log.instance, log.rank)
        row = rows[log.instance, log.rank]
        if log.generation is None:
            assert row is None, (log.instance, log.rank, row)
        else:
            assert row is not None, (log.instance, log.rank)
            assert row["generation"] == log.generation, (log.instance, log.rank)
    assert sum(len(log.refusals) for log in logs) > 0  # the families did collide
