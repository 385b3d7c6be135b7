"""Client fixtures: a live kvroute process per module, and registration documents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client.live import LiveServer, live_server_in


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = live_server_in(tmp_path_factory.mktemp("kvroute-live")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def restartable_server(tmp_path: Path) -> Iterator[LiveServer]:
    server = live_server_in(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()
