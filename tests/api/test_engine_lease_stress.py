"""Engine leases raced over two ``kvroute serve`` processes on one PostgreSQL, against a sequential
model (as ``test_registry_stress`` does for per-rank leases).

Every engine (an instance of two ranks) is driven by its own worker: it grants a lease and
registers both ranks with it (through either process), renews the lease (sometimes too late, so it
expires), revokes it, or pauses. Operations of one engine are sequential, so its expected state
follows from its own acknowledged operations; engines run concurrently, and two geometry families
(head_dim 128 and 64) refuse each other, so which get in depends on timing. Checked:

* no compatible rank refused, and no incompatible pair both live (matrix during and after);
* one renewal renews every rank the lease keeps: a renewal that answers 200 lists exactly the
  engine's ranks registered with that lease;
* a renewal refused as expired only ever came after the lease's last known expiry had passed;
* every acknowledged write present: each rank's final row has its last acknowledged generation,
  or is gone after a revoke of the lease keeping it.
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
from tests.api.test_registry_stress import RUN_SECONDS, _matrix, _watch

pytestmark = pytest.mark.postgres

DEPLOYMENT = "engines"
REQUEST_SECONDS = 15.0
FAMILIES = {"ctx0": 128, "ctx1": 128, "gen0": 128, "gen1": 128, "ctx9": 64, "gen9": 64}
TP = 2


@dataclass
class EngineLog:
    instance: str
    lease: str | None = None
    lease_expires_at: datetime | None = None
    generation: dict[int, int | None] = field(default_factory=dict)  # None: removed
    lease_of: dict[int, str] = field(default_factory=dict)
    refusals: list[dict[str, Any]] = field(default_factory=list)
    partial_renewals: list[tuple[set[int], set[int]]] = field(default_factory=list)
    late_renewals: list[tuple[datetime | None, datetime]] = field(default_factory=list)


def _document(instance: str, rank: int, variant: int) -> dict[str, Any]:
    role = "context" if instance.startswith("ctx") else "generation"
    document = rank_document(role=role, tp_size=TP, tp_rank=rank, head_dim=FAMILIES[instance])
    document["endpoint"] = f"127.0.0.1:{7000 + variant}"  # a changed document: a new generation
    return document


async def _bring_up(
    session: aiohttp.ClientSession,
    bases: list[str],
    log: EngineLog,
    rng,
    lease_seconds: int | None = None,
) -> None:
    leases = f"{rng.choice(bases)}/v1/deployments/{DEPLOYMENT}/leases"
    lease_seconds = lease_seconds or rng.choice([1, 2, 30])
    async with session.post(leases, json={"lease_seconds": lease_seconds}) as response:
        assert response.status == 201, await response.text()
        body = await response.json()
    log.lease, log.lease_expires_at = (
        body["lease_id"],
        datetime.fromisoformat(body["lease_expires_at"]),
    )
    for rank in range(TP):
        path = f"/v1/deployments/{DEPLOYMENT}/instances/{log.instance}/ranks/{rank}"
        document = _document(log.instance, rank, rng.randrange(3))
        async with session.put(
            rng.choice(bases) + path, json=document, params={"engine_lease": log.lease}
        ) as response:
            body = await response.json()
            if response.status in (200, 201):
                log.generation[rank] = body["generation"]
                log.lease_of[rank] = log.lease
            elif response.status == 404:  # the lease (1 s) ran out before this rank got in
                assert body["code"] == "not_found", body
            else:
                assert response.status == 409, body
                log.refusals.append(body)


async def _renew(session: aiohttp.ClientSession, bases: list[str], log: EngineLog, rng) -> None:
    if log.lease is None:
        return
    url = f"{rng.choice(bases)}/v1/deployments/{DEPLOYMENT}/leases/{log.lease}/heartbeat"
    async with session.post(url) as response:
        body = await response.json()
        if response.status == 200:
            log.lease_expires_at = datetime.fromisoformat(body["lease_expires_at"])
            renewed = {kept["rank"] for kept in body["ranks"]}
            kept = {rank for rank, lease in log.lease_of.items() if lease == log.lease}
            if renewed != kept:
                log.partial_renewals.append((renewed, kept))
        else:
            assert response.status == 404, body
            log.late_renewals.append((log.lease_expires_at, datetime.now(UTC)))
            log.lease = None


async def _revoke(session: aiohttp.ClientSession, bases: list[str], log: EngineLog, rng) -> None:
    if log.lease is None:
        return
    url = f"{rng.choice(bases)}/v1/deployments/{DEPLOYMENT}/leases/{log.lease}"
    async with session.delete(url) as response:
        assert response.status == 204, await response.text()
    for rank, lease in list(log.lease_of.items()):
        if lease == log.lease:
            log.generation[rank] = None
            del log.lease_of[rank]
    log.lease = None


async def _worker(
    session: aiohttp.ClientSession, bases: list[str], log: EngineLog, seed: int
) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + RUN_SECONDS
    # Every engine starts with a lease that runs out before its first renewal, so expiries are in
    # the run whatever the machine's speed; the random churn follows.
    await _bring_up(session, bases, log, rng, lease_seconds=1)
    await asyncio.sleep(1.5)
    await _renew(session, bases, log, rng)
    while time.monotonic() < deadline:
        action = rng.choices(["bring_up", "renew", "revoke", "pause"], [3, 6, 1, 2])[0]
        if action == "bring_up":
            await _bring_up(session, bases, log, rng)
        elif action == "renew":
            await _renew(session, bases, log, rng)
        elif action == "revoke":
            await _revoke(session, bases, log, rng)
        else:
            await asyncio.sleep(rng.uniform(0.5, 1.5))  # long enough for a 1 s lease to end


async def test_engine_lease_churn_matches_the_sequential_model(servers: list[str]) -> None:
    logs = [EngineLog(instance) for instance in FAMILIES]
    timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        *_, reads = await asyncio.gather(
            *(_worker(session, servers, log, seed) for seed, log in enumerate(logs)),
            _watch(session, servers[1], DEPLOYMENT),
        )
        final = await _matrix(session, servers[0], DEPLOYMENT)
        rows = {}
        for log in logs:
            for rank in range(TP):
                path = f"/v1/deployments/{DEPLOYMENT}/instances/{log.instance}/ranks/{rank}"
                async with session.get(servers[0] + path) as response:
                    rows[log.instance, rank] = await response.json() if response.ok else None
    assert reads > 10
    assert not [p for p in final if p["status"] == "incompatible"], final
    for log in logs:
        assert log.partial_renewals == [], log.instance
        for refusal in log.refusals:
            assert refusal["code"] == "head_dim_mismatch", refusal
            assert FAMILIES[refusal["peer_instance"]] != FAMILIES[log.instance], refusal
        for known, refused_at in log.late_renewals:
            assert known is None or known <= refused_at, log.instance
        for rank, generation in log.generation.items():
            row = rows[log.instance, rank]
            if generation is None:
                assert row is None, (log.instance, rank, row)
            else:
                assert row is not None, (log.instance, rank)
                assert row["generation"] == generation, (log.instance, rank)
    assert sum(len(log.refusals) for log in logs) > 0  # the families did collide
    assert sum(len(log.late_renewals) for log in logs) > 0  # and leases did run out
