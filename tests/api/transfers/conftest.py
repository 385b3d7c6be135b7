"""Fixtures of the transfer endpoint tests: segment owners and apps built per test."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from kvroute.api import create_app
from kvroute.api.keys import copy_engine_key
from kvroute.transfer import CopyEngine
from tests.api.transfers.world import Client
from tests.transfer.conftest import Owners


@pytest.fixture(scope="module")
def owners() -> Iterator[Owners]:
    started = Owners(("workers",))
    yield started
    started.stop()


@pytest.fixture
def segment(owners: Owners) -> Iterator[Callable[[int], str]]:
    created: list[str] = []

    def create(size: int) -> str:
        created.append(owners.create("workers", size, len(created)))
        return created[-1]

    yield create
    for name in created:
        owners.unlink("workers", name)


@pytest.fixture
def start(
    aiohttp_client: Any, make_settings: Callable[..., Any]
) -> Callable[..., Awaitable[Client]]:
    async def build(engine: CopyEngine | None = None, **overrides: Any) -> Client:
        app = create_app(make_settings(**overrides))
        if engine is not None:
            app[copy_engine_key] = engine
        client: Client = await aiohttp_client(app)
        return client

    return build
