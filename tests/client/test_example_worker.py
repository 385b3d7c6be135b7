"""examples/worker.py against a live server: it registers, keeps its lease and gets its plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.client.live import ADMIN_TOKEN, WORKER_TOKEN, LiveServer

pytest.importorskip("torch")
pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "worker.py"


def test_worker_example_runs(live_server: LiveServer) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", live_server.url, "--token", WORKER_TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "registered gen0 rank 0, generation 1"
    # 2 senders x 32 layers x (K and V: 2 of the 4 receiver heads each)
    assert "senders (0, 1), 128 fragments and 2097152 bytes per block" in lines[1]
    from kvroute.client import KvrouteClient

    with KvrouteClient(live_server.url, token=ADMIN_TOKEN) as admin:
        [gen0] = [i for i in admin.instances("example") if i.name == "gen0"]
    assert gen0.live_ranks == 2
