"""``kvroute proxy`` against a live kvroute: what it answers when no P/D pair can serve.

The proxy never hangs and never answers success without a consumer's answer: no engine, an
engine without its OpenAI address, or engines that cannot be reached each get a clear problem
naming why, within bounded time. Serving through real engines is in tests/realpd.
"""

from __future__ import annotations

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
