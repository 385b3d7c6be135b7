"""NIXL fixtures: a live kvroute process; UCX restricted to loopback for every process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.live import LiveServer, live_server_in


@pytest.fixture
def live_server(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LiveServer]:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # spawned senders inherit it
    server = live_server_in(tmp_path_factory.mktemp("kvroute-nixl")).start()
    try:
        yield server
    finally:
        server.stop()
