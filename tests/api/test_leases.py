"""Leases: an expired rank is shown as expired, stops being a peer and cannot heartbeat."""

from __future__ import annotations

import asyncio
import logging

from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.documents import rank_document

REAPER_WAIT_SECONDS = 30.0  # bounds a failing run only: a passing one waits for the round


class RoundEnd(logging.Handler):
    """Set by the reaper round's last act, its "reaped" line: the rank's 404 alone came before
    the round updated the metrics, and a /metrics read in between still saw the instance."""

    def __init__(self) -> None:
        super().__init__()
        self._seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("reaped "):
            self._seen.set()

    async def wait(self) -> None:
        await self._seen.wait()


async def _state(client, instance: str, rank: int) -> str:
    return str((await (await client.get(rank_path(instance, rank), headers=ADMIN)).json())["state"])


async def test_expired_rank_stops_being_a_peer(client, clock):
    await register(client, "ctx0", 0, rank_document(head_dim=16, lease_seconds=1))
    incompatible = rank_document(role="generation", head_dim=32)
    assert (await register(client, "gen0", 0, incompatible))[0] == 409

    clock.advance(0.999)
    assert await _state(client, "ctx0", 0) == "live"
    clock.advance(0.001)  # a lease is live strictly before its expiry instant
    assert await _state(client, "ctx0", 0) == "expired"
    instance = await (
        await client.get("/v1/deployments/llama/instances/ctx0", headers=ADMIN)
    ).json()
    assert (instance["live_ranks"], instance["expired_ranks"]) == (0, 1)

    status, _ = await register(client, "gen0", 0, incompatible)
    assert status == 201


async def test_expired_rank_cannot_heartbeat_and_must_reregister(client, clock):
    await register(client, "ctx0", 0, rank_document(lease_seconds=1))
    clock.advance(0.5)
    assert (await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)).status == 200
    clock.advance(1.5)  # past the renewed lease
    response = await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)
    assert response.status == 404
    status, body = await register(client, "ctx0", 0, rank_document(lease_seconds=1))
    assert status == 200
    assert body["generation"] == 1


async def test_reaper_removes_expired_ranks_after_grace(make_client, caplog, clock):
    caplog.set_level("INFO", logger="kvroute.api.lifecycle")
    client = await make_client(lease_grace_seconds=10, reaper_interval_seconds=0.05, clock=clock)
    reaped = RoundEnd()
    logging.getLogger("kvroute.api.lifecycle").addHandler(reaped)
    try:
        await register(client, "ctx0", 0, rank_document(lease_seconds=1))
        clock.advance(12)  # past the lease and the grace period after it
        async with asyncio.timeout(REAPER_WAIT_SECONDS):
            await reaped.wait()
    finally:
        logging.getLogger("kvroute.api.lifecycle").removeHandler(reaped)
    assert (await client.get(rank_path("ctx0", 0), headers=ADMIN)).status == 404
    text = await (await client.get("/metrics")).text()
    # The instance is gone with its last rank, and so are its series; the expiry was counted.
    assert 'instance="ctx0"' not in text
    assert 'kvroute_expired_leases_total{deployment="llama"} 1.0' in text
    # Both lines name the rank, in the message and as fields a JSON log can be queried by.
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("lease expired: llama/ctx0 rank 0 (") for m in messages), messages
    assert any(m.endswith("over 10s ago: llama/ctx0 rank 0") for m in messages), messages
    (expired,) = [r.fields for r in caplog.records if r.getMessage().startswith("lease expired")]
    assert expired == {
        "event": "lease_expired",
        "deployment": "llama",
        "instance": "ctx0",
        "rank": 0,
    }
