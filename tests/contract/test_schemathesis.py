"""Fuzz the live service with schemathesis against ``api_spec/openapi.yaml``.

A real ``kvroute serve`` process (127.0.0.1, a temporary SQLite database, tokens on) answers
generated requests, valid and invalid. Every answer must be documented in the spec (status,
content type, body schema) and none may be a server error. Bounded: at most
``MAX_EXAMPLES`` per operation.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

SPEC = Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml"
MAX_EXAMPLES = 50
STARTUP_SECONDS = 30.0
WORKER_TOKEN = "contract-worker-token-0123456789"
ADMIN_TOKEN = "contract-admin-token-0123456789"

# Auth goes through the spec's security scheme, so negative cases that drop the token stay
# tokenless (and must be answered 401).
CONFIG = SchemathesisConfig.from_dict(
    {
        "auth": {"openapi": {"bearer": {"bearer": ADMIN_TOKEN}}},
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True},
    }
)
schema = schemathesis.openapi.from_path(str(SPEC), config=CONFIG)
statuses: Counter[int] = Counter()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_ready(base_url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"kvroute serve exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    pytest.fail(f"kvroute serve not ready within {STARTUP_SECONDS} s")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("contract")
    port = _free_port()
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith("KVROUTE_")
    }
    environment.update(
        KVROUTE_DATABASE_URL=f"sqlite+aiosqlite:///{workdir}/kvroute.db",
        KVROUTE_WORKER_TOKEN=WORKER_TOKEN,
        KVROUTE_ADMIN_TOKEN=ADMIN_TOKEN,
        KVROUTE_LOG_LEVEL="WARNING",
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "kvroute", "serve", "--port", str(port)],
        cwd=workdir,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_is_documented_and_never_a_server_error(case, base_url):
    # Schema-valid documents are still refused when their geometry is wrong (409/422): that is
    # the service's purpose, so "valid input must be accepted" does not apply here.
    response = case.call_and_validate(
        base_url=base_url,
        excluded_checks=[positive_data_acceptance],
        timeout=10,
    )
    statuses[response.status_code] += 1


def test_fuzzing_got_past_auth_and_validation():
    """Guards the run above against passing vacuously (e.g. every request answered 401)."""
    assert statuses[200] > 0
    assert statuses[401] > 0
    assert sum(count for status, count in statuses.items() if status in (400, 422)) > 0
