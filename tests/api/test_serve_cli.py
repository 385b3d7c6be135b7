"""``kvroute serve`` and ``kvroute db`` as an operator meets them: the real CLI in a subprocess.

Everyday startup failures are one line on stderr that says what is wrong and what to do, with exit
status 2; SIGTERM drains (readiness 503 at once, requests still served) and exits 0 without a
traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvroute.live import LiveServer
from tests.api.conftest import ADMIN_TOKEN, WORKER_TOKEN, rank_path
from tests.api.documents import rank_document

CLI_TIMEOUT_S = 60
DRAIN_S = 3.0
UNREACHABLE = "postgresql+asyncpg://postgres@127.0.0.1:1/kvroute"


def run_cli(args: list[str], directory: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTE_")}
    env.setdefault("KVROUTE_DATABASE_URL", f"sqlite+aiosqlite:///{directory}/kvroute.db")
    env.update(variables)
    return subprocess.run(
        [sys.executable, "-m", "kvroute", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "listening" not in result.stdout + result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def test_everyday_startup_failures_are_one_line_and_exit_2(tmp_path, postgres_url):
    missing = postgres_url.rsplit("/", 1)[0] + "/kvroute_test_no_such_database"
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    serve = ["serve", "--port", "0"]  # port 8080 may be taken on a shared machine
    cases = [
        (
            serve,
            {"KVROUTE_DATABASE_URL": UNREACHABLE},
            ["cannot reach PostgreSQL", "127.0.0.1:1"],
        ),
        (["db", "upgrade"], {"KVROUTE_DATABASE_URL": UNREACHABLE}, ["cannot reach PostgreSQL"]),
        (serve, {"KVROUTE_DATABASE_URL": missing}, ["does not exist", "createdb"]),
        (["db", "upgrade"], {"KVROUTE_DATABASE_URL": missing}, ["does not exist"]),
        (["serve", "--port", port], {}, ["cannot listen on 127.0.0.1:" + port, "in use"]),
        (serve, {"KVROUTE_ADMIN_TOKEN": " " * 16}, ["KVROUTE_ADMIN_TOKEN", "is blank"]),
        (serve, {"KVROUTE_ADMN_TOKEN": ADMIN_TOKEN}, ["unknown", "KVROUTE_ADMN_TOKEN"]),
        (
            serve,
            {"KVROUTE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/nowhere/kvroute.db"},
            ["directory", "does not exist"],
        ),
    ]
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda case: run_cli(case[0], tmp_path, **case[1]), cases))
    finally:
        taken.close()
    for (_, _, words), result in zip(cases, results, strict=True):
        one_line_refusal(result, *words)


def _status(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Authorization", f"Bearer {WORKER_TOKEN}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers)


@pytest.mark.slow
def test_sigterm_drains_then_exits_cleanly(tmp_path):
    server = LiveServer(
        tmp_path,
        tokens=(WORKER_TOKEN, ADMIN_TOKEN),
        env={"KVROUTE_DRAIN_SECONDS": str(DRAIN_S), "KVROUTE_LOG_LEVEL": "INFO"},
    ).start()
    assert server.process is not None
    body = json.dumps(rank_document()).encode()
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    ready, headers = _status(server.url + "/readyz")
    registered, _ = _status(server.url + rank_path("ctx0", 0), "PUT", body)
    healthy, _ = _status(server.url + "/healthz")
    served_at = time.monotonic() - signalled
    code = server.process.wait(timeout=DRAIN_S + 30)
    stopped_after = time.monotonic() - signalled
    server.process = None
    log = server.log.read_text()

    assert (ready, headers.get("Retry-After")) == (503, "1")
    assert (registered, healthy) == (201, 200)  # still served while draining
    assert served_at < DRAIN_S
    assert code == 0
    assert stopped_after >= DRAIN_S
    assert "draining for 3s" in log
    assert "Traceback" not in log
    assert "Event loop is closed" not in log


@pytest.mark.parametrize(("loop", "module"), [("uvloop", "uvloop"), ("asyncio", "asyncio.")])
def test_either_event_loop_serves_and_the_log_names_it(tmp_path, loop, module):
    server = LiveServer(
        tmp_path,
        tokens=(WORKER_TOKEN, ADMIN_TOKEN),
        env={"KVROUTE_EVENT_LOOP": loop, "KVROUTE_LOG_LEVEL": "INFO"},
    ).start()
    try:
        body = json.dumps(rank_document()).encode()
        registered, _ = _status(server.url + rank_path("ctx0", 0), "PUT", body)
    finally:
        server.stop()
    log = server.log.read_text()
    assert registered == 201
    assert f"(event loop: {module}" in log
    assert "Traceback" not in log


def test_an_unknown_event_loop_is_refused_in_one_line(tmp_path):
    result = run_cli(["serve", "--port", "0"], tmp_path, KVROUTE_EVENT_LOOP="tokio")
    one_line_refusal(result, "KVROUTE_EVENT_LOOP")
