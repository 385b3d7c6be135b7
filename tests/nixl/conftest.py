"""NIXL fixtures: a live kvroute process; UCX restricted to loopback for every process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.client.live import LiveServer, live_server_in


@contextmanager
def _serving(root: Path) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("UCX_NET_DEVICES", "lo")  # spawned senders inherit it
        server = live_server_in(root).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with _serving(tmp_path_factory.mktemp("kvroute-nixl")) as server:
        yield server


@pytest.fixture(scope="module")
def module_live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One kvroute for a module's tests (each test its own consumer instance)."""
    with _serving(tmp_path_factory.mktemp("kvroute-nixl")) as server:
        yield server
