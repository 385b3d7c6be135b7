"""``kvroute proxy`` against a live kvroute: what it answers when no P/D pair can serve.

The proxy never hangs and never answers success without a consumer's answer: no engine, an
engine without its OpenAI address, or engines that cannot be reached each get a clear problem
naming why, within bounded time. Serving through real engines is in tests/realpd.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvroute.client import KvrouteClient
from kvroute.proxy import make_app
from tests.client.live import WORKER_TOKEN, LiveServer, free_port
from tests.documents import rank_document

BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}


@pytest.fixture
async def proxy(
    live_server: LiveServer, request: pytest.FixtureRequest
) -> AsyncIterator[TestClient]:
    app = make_app(live_server.url, request.node.name, token=WORKER_TOKEN, refresh_s=0.0)
    async with TestClient(TestServer(app)) as client:
        yield client


def register(live_server: LiveServer, deployment: str, endpoints: dict[str, str | None]) -> None:
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as client:
        for instance, endpoint in endpoints.items():
            role = "context" if instance.startswith("p") else "generation"
            document = rank_document(role=role)
            if endpoint is not None:
                document["endpoint"] = endpoint
            client.register(deployment, instance, 0, document)


async def test_no_engine_is_a_503_naming_the_deployment(
    proxy: TestClient, request: pytest.FixtureRequest
) -> None:
    answer = await proxy.post("/v1/completions", json=BODY)
    assert answer.status == 503
    problem = await answer.json()
    assert f"deployment '{request.node.name}' does not exist" in problem["detail"]
    assert (await proxy.get("/healthz")).status == 503


async def test_engines_without_an_address_are_named(
    proxy: TestClient, live_server: LiveServer, request: pytest.FixtureRequest
) -> None:
    register(live_server, request.node.name, {"p0": None, "d0": None})
    answer = await proxy.post("/v1/chat/completions", json=BODY)
    assert answer.status == 503
    assert "no endpoint registered by d0, p0" in (await answer.json())["detail"]


async def test_unreachable_engines_fail_fast_and_are_skipped(
    proxy: TestClient, live_server: LiveServer, request: pytest.FixtureRequest
) -> None:
    dead = {name: f"http://127.0.0.1:{free_port()}" for name in ("p0", "p1", "d0")}
    register(live_server, request.node.name, dead)
    started = time.monotonic()
    answer = await proxy.post("/v1/completions", json=BODY)
    assert answer.status == 502, await answer.text()
    assert "unreachable" in (await answer.json())["detail"]
    assert time.monotonic() - started < 20
    # Both producers were tried and are now skipped: the next request is refused naming them.
    answer = await proxy.post("/v1/completions", json=BODY)
    assert answer.status == 503
    assert "unreachable now: p0, p1" in (await answer.json())["detail"]


async def test_a_body_that_is_not_json_is_a_400(proxy: TestClient) -> None:
    answer = await proxy.post("/v1/completions", data=b"{not json")
    assert answer.status == 400


async def test_an_engine_on_a_new_port_is_reached_there_at_once(
    proxy: TestClient, live_server: LiveServer, request: pytest.FixtureRequest
) -> None:
    """A producer that restarted on another port (a new generation) is routed to its new address
    on the next refresh, and its old address's failure no longer keeps it out (cooldown 10 s)."""
    old, new = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    register(live_server, request.node.name, {"p0": old, "d0": f"http://127.0.0.1:{free_port()}"})
    health = await proxy.get("/healthz")
    assert (await health.json())["producer_url"] == old
    answer = await proxy.post("/v1/completions", json=BODY)
    assert answer.status == 503  # p0 unreachable, and no other producer
    assert "unreachable now: p0" in (await answer.json())["detail"]
    register(live_server, request.node.name, {"p0": new})
    health = await proxy.get("/healthz")
    assert health.status == 200, await health.text()
    assert (await health.json())["producer_url"] == new


async def test_the_proxy_routes_from_kvroute_s_last_answer_through_an_outage(
    restartable_server: LiveServer,
) -> None:
    """kvroute really stopped, longer than the engines' leases (5 s), then started again: the
    proxy keeps choosing the pair it knew all along, also once kvroute is back and still counts
    the leases as lapsed (the engines re-register within seconds); a proxy holding kvroute's last
    answer for 3 s only refuses after that, naming the outage."""
    deployment = "outage"
    with KvrouteClient(restartable_server.url, token=WORKER_TOKEN) as client:
        for instance, role in (("p0", "context"), ("d0", "generation")):
            document = rank_document(role=role, lease_seconds=5)
            document["endpoint"] = f"http://127.0.0.1:{free_port()}"
            client.register(deployment, instance, 0, document)
    apps = [
        make_app(restartable_server.url, deployment, token=WORKER_TOKEN, refresh_s=0.0, hold_s=hold)
        for hold in (120.0, 3.0)
    ]
    async with TestClient(TestServer(apps[0])) as patient, TestClient(TestServer(apps[1])) as brief:
        for proxy in (patient, brief):
            assert (await proxy.get("/healthz")).status == 200
        await asyncio.to_thread(restartable_server.stop)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 6:  # past the leases' end
            assert (await patient.get("/healthz")).status == 200
            await asyncio.sleep(0.2)
        refused = await brief.get("/healthz")
        await asyncio.to_thread(restartable_server.start)
        with KvrouteClient(restartable_server.url, token=WORKER_TOKEN) as client:
            pairs = client.pairs(deployment)  # kvroute itself counts d0 and p0 as gone
            assert not pairs.generation or not pairs.generation[0].pairs
        health = await patient.get("/healthz")
        assert health.status == 200, await health.text()
        assert (await health.json())["producer"] == "p0"
        assert refused.status == 503
        assert "kvroute is unreachable" in (await refused.json())["detail"]
