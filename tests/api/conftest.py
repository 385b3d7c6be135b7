"""API test fixtures: the real app factory on each database of ``database_url``, and two live
replicas on one PostgreSQL database."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.api import create_app
from kvroute.api.clock import Clock, system_clock
from kvroute.live import LiveServer
from kvroute.settings import Settings
from tests.clock import ManualClock

WORKER_TOKEN = "worker-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
WORKER = {"Authorization": f"Bearer {WORKER_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

ClientFactory = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


def rank_path(instance: str, rank: int, deployment: str = "llama") -> str:
    return f"/v1/deployments/{deployment}/instances/{instance}/ranks/{rank}"


@pytest.fixture
def make_settings(database_url: str) -> Callable[..., Settings]:
    def build(**overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "database_url": database_url,
            "worker_token": WORKER_TOKEN,
            "admin_token": ADMIN_TOKEN,
            "reaper_interval_seconds": 60.0,
        }
        values.update(overrides)
        return Settings(**values)

    return build


@pytest.fixture
def make_client(
    aiohttp_client: Any, make_settings: Callable[..., Settings]
) -> Callable[..., Awaitable[TestClient[web.Request, web.Application]]]:
    async def build(
        *, clock: Clock = system_clock, **overrides: Any
    ) -> TestClient[web.Request, web.Application]:
        client: TestClient[web.Request, web.Application] = await aiohttp_client(
            create_app(make_settings(**overrides), clock=clock)
        )
        return client

    return build


@pytest.fixture
def servers(postgres_test_url: str, tmp_path: Path) -> Iterator[list[str]]:
    """The URLs of two ``kvroute serve`` processes sharing one PostgreSQL database."""
    with (
        LiveServer(tmp_path, database_url=postgres_test_url) as first,
        LiveServer(tmp_path, database_url=postgres_test_url) as second,
    ):
        yield [first.url, second.url]


@pytest.fixture
def clock() -> ManualClock:
    """The time of the ``client`` fixture's app: it moves only when a test advances it."""
    return ManualClock()


@pytest.fixture
async def client(
    make_client: Callable[..., Awaitable[TestClient[web.Request, web.Application]]],
    clock: ManualClock,
) -> TestClient[web.Request, web.Application]:
    return await make_client(clock=clock)


async def register(
    client: TestClient[web.Request, web.Application],
    instance: str,
    rank: int,
    document: dict[str, Any],
    *,
    deployment: str = "llama",
) -> tuple[int, dict[str, Any]]:
    response = await client.put(
        rank_path(instance, rank, deployment), json=document, headers=WORKER
    )
    return response.status, await response.json(content_type=None)


async def snapshot(client: TestClient[web.Request, web.Application]) -> dict[str, Any]:
    """Everything an admin can read about the registry (listings, instances, rank documents)."""
    deployments = (await (await client.get("/v1/deployments", headers=ADMIN)).json())["deployments"]
    state: dict[str, Any] = {"deployments": deployments}
    for deployment in deployments:
        name = deployment["name"]
        listing = await (
            await client.get(f"/v1/deployments/{name}/instances", headers=ADMIN)
        ).json()
        state[name] = listing
        for instance in listing["instances"]:
            path = f"/v1/deployments/{name}/instances/{instance['name']}"
            detail = await (await client.get(path, headers=ADMIN)).json()
            state[path] = detail
            for rank in detail["ranks"]:
                rank_url = rank_path(instance["name"], rank["rank"], name)
                state[rank_url] = await (await client.get(rank_url, headers=ADMIN)).json()
    return state
