"""Watching a deployment: registrations, expiries, deletions and plan invalidations as server-sent
events, each once and in revision order, resumable from a revision (both databases)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvroute import wire
from kvroute.api.keys import sessionmaker_key
from kvroute.client import AsyncKvrouteClient
from kvroute.client.watch import EventWatcher
from kvroute.store import events as event_log
from tests.api.conftest import ADMIN, WORKER, WORKER_TOKEN, rank_path, register
from tests.api.documents import rank_document

EVENTS = "/v1/deployments/llama/events"
WAIT_SECONDS = 10.0


def _watcher(client: Any, since: int | None = None) -> tuple[AsyncKvrouteClient, EventWatcher]:
    api = AsyncKvrouteClient(str(client.server.make_url("/")), token=WORKER_TOKEN)
    return api, EventWatcher(api, "llama", since=since)


async def _take(stream: AsyncIterator[wire.Event], count: int) -> list[wire.Event]:
    taken: list[wire.Event] = []
    async with asyncio.timeout(WAIT_SECONDS):
        while len(taken) < count:
            taken.append(await anext(stream))
    return taken


def _summary(events: list[wire.Event]) -> list[tuple[str, str | None, int | None]]:
    return [(event.kind, event.instance, event.rank) for event in events]


async def test_changes_arrive_once_in_order_and_renewals_send_nothing(client):
    api, watcher = _watcher(client, since=0)
    stream = aiter(watcher)
    try:
        await register(client, "ctx0", 0, rank_document())
        first = await _take(stream, 2)
        assert _summary(first) == [
            ("rank_registered", "ctx0", 0),
            ("plans_invalidated", "ctx0", None),
        ]
        assert [event.revision for event in first] == [1, 2]
        assert first[0].generation == 1
        # The same document again and a heartbeat: renewals, nothing a reader sees changes.
        await register(client, "ctx0", 0, rank_document())
        await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)
        changed = rank_document(num_slots=32)
        await register(client, "ctx0", 0, changed)
        assert (await client.delete(rank_path("ctx0", 0), headers=ADMIN)).status == 204
        rest = await _take(stream, 4)
        assert _summary(rest) == [
            ("rank_registered", "ctx0", 0),
            ("plans_invalidated", "ctx0", None),
            ("rank_deleted", "ctx0", 0),
            ("plans_invalidated", "ctx0", None),
        ]
        assert rest[0].generation == 2
        assert rest[2].data == {"reason": "deleted"}
        assert [event.revision for event in rest] == [3, 4, 5, 6]
    finally:
        await stream.aclose()
        await api.close()


async def test_a_watcher_resumes_from_a_revision(client):
    for instance in ("ctx0", "ctx1", "ctx2"):
        await register(client, instance, 0, rank_document())
    for since, header in ((2, False), (4, True)):
        headers = {**WORKER, "Last-Event-ID": str(since)} if header else WORKER
        params = {} if header else {"since": str(since)}
        response = await client.get(EVENTS, headers=headers, params=params)
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        ids = []
        async with asyncio.timeout(WAIT_SECONDS):
            while len(ids) < 6 - since:
                line = (await response.content.readline()).decode()
                if line.startswith("id: "):
                    ids.append(int(line[4:]))
        assert ids == list(range(since + 1, 7))
        response.close()


async def test_expiries_and_revoked_leases_are_events(client, clock):
    api, watcher = _watcher(client, since=0)
    stream = aiter(watcher)
    try:
        await register(client, "ctx0", 0, rank_document(lease_seconds=1))
        await _take(stream, 2)
        clock.advance(2)  # the hub notes the expiry on its next scan (every second)
        expired = await _take(stream, 2)
        assert _summary(expired) == [
            ("rank_expired", "ctx0", 0),
            ("plans_invalidated", "ctx0", None),
        ]
        leases = "/v1/deployments/llama/leases"
        lease = await (await client.post(leases, json={"lease_seconds": 30}, headers=WORKER)).json()
        await client.put(
            rank_path("gen0", 0),
            json=rank_document(role="generation"),
            params={"engine_lease": lease["lease_id"]},
            headers=WORKER,
        )
        await client.delete(f"{leases}/{lease['lease_id']}", headers=ADMIN)
        revoked = await _take(stream, 4)
        assert _summary(revoked)[2:] == [
            ("rank_deleted", "gen0", 0),
            ("plans_invalidated", "gen0", None),
        ]
        assert revoked[2].data == {"reason": "lease_revoked"}
    finally:
        await stream.aclose()
        await api.close()


async def test_a_revision_older_than_the_log_is_410(client):
    for instance in ("ctx0", "ctx1"):
        await register(client, instance, 0, rank_document())
    await event_log.trim(client.app[sessionmaker_key], keep=1)
    response = await client.get(EVENTS, headers=WORKER, params={"since": "1"})
    problem = await response.json()
    assert (response.status, problem["code"]) == (410, "events_compacted")
    assert (await client.get(EVENTS, headers=WORKER, params={"since": "x"})).status == 400
    live = await client.get(EVENTS, headers=WORKER, params={"since": "3"})
    assert live.status == 200
    live.close()


async def _ids_to_the_end(response: Any) -> list[int]:
    """Every event id of a stream that must end by itself within ``WAIT_SECONDS``."""
    async with asyncio.timeout(WAIT_SECONDS):
        text = (await response.read()).decode()
    return [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]


async def test_follow_false_ends_after_the_events_the_log_holds(client):
    for instance in ("ctx0", "ctx1", "ctx2"):
        await register(client, instance, 0, rank_document())
    bounded = {"follow": "false"}
    response = await client.get(EVENTS, headers=WORKER, params={"since": "2", **bounded})
    assert response.status == 200
    assert await _ids_to_the_end(response) == [3, 4, 5, 6]
    # Without ``since`` it starts at the current revision: only the comment naming it comes.
    response = await client.get(EVENTS, headers=WORKER, params=bounded)
    assert (await response.read()).decode() == "retry: 1000\n: revision 6\n\n"
    # A write just before the request is in its stream, whether or not the hub read it yet.
    await register(client, "ctx3", 0, rank_document())
    response = await client.get(EVENTS, headers=WORKER, params={"since": "6", **bounded})
    assert await _ids_to_the_end(response) == [7, 8]


async def test_timeout_ends_a_following_stream(client):
    await register(client, "ctx0", 0, rank_document())
    started = asyncio.get_running_loop().time()
    response = await client.get(EVENTS, headers=WORKER, params={"since": "0", "timeout": "1"})
    assert await _ids_to_the_end(response) == [1, 2]
    assert asyncio.get_running_loop().time() - started >= 1.0


async def test_bounds_are_spelled_strictly(client):
    for params, status in (
        ({"follow": "False"}, 400),
        ({"follow": "1"}, 400),
        ({"follow": "no"}, 400),
        ({"timeout": "0"}, 422),
        ({"timeout": "86401"}, 422),
        ({"timeout": "1.5"}, 400),
    ):
        response = await client.get(EVENTS, headers=WORKER, params=params)
        problem = await response.json()
        name = next(iter(params))
        assert (response.status, problem["field"]) == (status, f"query.{name}"), params
