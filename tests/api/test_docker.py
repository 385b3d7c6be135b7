"""The container image and compose stack, checked without a Docker engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvroute.live import LiveServer, free_port

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed")
    result = subprocess.run(
        [binary, str(DOCKER / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multistage_non_root_and_serves_publicly():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", text, re.MULTILINE) == ["python:3.11-slim"] * 2
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user == ["10001:10001"]
    assert "torch" not in re.sub(r"#.*", "", text)
    assert 'CMD ["kvroute", "serve", "--host", "0.0.0.0"]' in text


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_gates_the_service_on_a_healthy_database_and_a_finished_migration():
    services = _compose()["services"]
    assert set(services) == {"db", "migrate", "kvroute"}
    probe = services["db"]["healthcheck"]["test"]
    assert "pg_isready" in probe
    assert probe[probe.index("-h") + 1] == "127.0.0.1"
    assert services["migrate"]["command"] == ["kvroute", "db", "upgrade"]
    assert services["migrate"]["depends_on"] == {"db": {"condition": "service_healthy"}}
    assert services["kvroute"]["depends_on"] == {
        "db": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
    }
    assert services["migrate"]["image"] == services["kvroute"]["image"]


def test_compose_secrets_come_from_uncommitted_env_files():
    services = _compose()["services"]
    for name, service in services.items():
        environment = service.get("environment", {})
        assert not any("TOKEN" in key or "PASSWORD" in key for key in environment), name
    env_files = {file for service in services.values() for file in service.get("env_file", [])}
    assert env_files == {"kvroute.env", "postgres.env"}
    ignored = subprocess.run(
        ["git", "check-ignore", *(str(DOCKER / file) for file in sorted(env_files))],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert ignored.returncode == 0, "docker/*.env must be ignored by git"
    for file in env_files:
        assert (DOCKER / f"{file}.example").is_file()


def _probe(text: str, instruction: str) -> list[str]:
    """The exec-form command of a HEALTHCHECK (``CMD [...]`` after line continuations)."""
    joined = text.replace("\\\n", " ")
    (line,) = [row for row in joined.splitlines() if row.startswith(instruction)]
    return json.loads(line[line.index("CMD") + 3 :].strip())


def test_healthchecks_follow_kvroute_port_not_a_fixed_one(tmp_path):
    image = _probe((DOCKER / "Dockerfile").read_text(), "HEALTHCHECK")
    compose = _compose()["services"]["kvroute"]["healthcheck"]["test"]
    assert image[0] == "python"
    assert compose[:2] == ["CMD", "python"]
    with LiveServer(tmp_path) as server:
        for probe, path in ((image, "/healthz"), (compose[1:], "/readyz")):
            assert path in probe[-1]
            assert "8080" not in probe[-1]
            command = [sys.executable, *probe[1:]]
            env = {"KVROUTE_PORT": str(server.port)}
            subprocess.run(command, env=env, check=True, timeout=30)
            elsewhere = {"KVROUTE_PORT": str(free_port())}
            failed = subprocess.run(command, env=elsewhere, capture_output=True, timeout=30)
            assert failed.returncode != 0
