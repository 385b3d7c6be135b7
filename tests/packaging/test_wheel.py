"""The wheel an operator installs: built from this repository, installed into a fresh virtual
environment without torch, it serves on the embedded SQLite and migrates PostgreSQL.

Fast and honest: the wheel is built without build isolation (the setuptools of this venv) from a
copy of the sources, and installed with ``--no-deps`` into a new venv whose only view of the
dependencies is a directory of links to this venv's installed distributions, less kvroute itself
(an editable install pointing at the checkout) and less torch, nixl and CuPy. Every kvroute file
the commands run comes from the wheel: the test checks where ``kvroute`` is imported from.
"""

from __future__ import annotations

import asyncio
import email
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvroute.live import LiveServer
from kvroute.store import migrate
from tests.conftest import postgres_lock, recreate_schema

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "service", "api_spec", "migrations")
# Distributions the fresh venv must not see: kvroute comes from the wheel; the rest is the data
# plane, which the control plane installs without.
HIDDEN = ("kvroute", "torch", "nixl", "nixl-cu12", "cupy-cuda12x")
COMMAND_TIMEOUT_S = 120

pytestmark = pytest.mark.slow


def _top_level_names(distribution: str) -> set[str]:
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return set()
    return {file.parts[0] for file in files if file.parts and file.parts[0] != ".."}


def _dependency_links(target: Path) -> Path:
    """Links to every entry of this venv's site-packages except the hidden distributions."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    hidden = set().union(*(_top_level_names(name) for name in HIDDEN))
    target.mkdir()
    for entry in site.iterdir():
        name = entry.name
        if name in hidden or name.endswith(".pth") or name.startswith(("__editable__", "kvroute")):
            continue
        (target / name).symlink_to(entry)
    return target


def _build_wheel(work: Path) -> Path:
    source = work / "src"
    source.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(path, source / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    dist = work / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(source),
        ],
        check=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    (wheel,) = dist.glob("kvroute-*.whl")
    return wheel


class Installed:
    """A fresh venv with the wheel installed; ``run`` runs its ``kvroute`` script."""

    def __init__(self, work: Path, wheel: Path) -> None:
        self.venv = work / "venv"
        self.wheel = wheel
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(self.venv)],
            check=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        (site,) = self.venv.glob("lib/python*/site-packages")
        links = _dependency_links(work / "dependencies")
        (site / "kvroute-test-dependencies.pth").write_text(f"{links}\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(self.python),
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                str(wheel),
            ],
            check=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        self.site = site

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def kvroute(self) -> Path:
        return self.venv / "bin" / "kvroute"

    def run(
        self, *args: str, cwd: Path, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.kvroute), *args],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", **(env or {})},
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )

    def python_says(self, code: str, cwd: Path) -> str:
        result = subprocess.run(
            [str(self.python), "-c", code],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=True,
        )
        return result.stdout.strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    work = tmp_path_factory.mktemp("wheel")
    return Installed(work, _build_wheel(work))


def test_the_wheel_carries_the_migrations_the_spec_and_the_console(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    versions = sorted(p.name for p in (REPO_ROOT / "migrations" / "versions").glob("*.py"))
    assert {f"kvroute/migrations/versions/{name}" for name in versions} <= names
    assert {"kvroute/migrations/env.py", "kvroute/migrations/script.py.mako"} <= names
    assert "kvroute/api/openapi.yaml" in names
    ui = sorted(p.name for p in (REPO_ROOT / "service" / "kvroute" / "ui").iterdir())
    assert {f"kvroute/ui/{name}" for name in ui} <= names


def test_base_requirements_are_the_client_set_and_server_is_an_extra(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        fields = email.message_from_string(wheel.read(name).decode())
    requirements = [Requirement(text) for text in fields.get_all("Requires-Dist") or []]
    base = {r.name for r in requirements if r.marker is None}
    # xxhash: the KV digests a worker computes (``kvroute.client.kv_digest``).
    assert base == {"aiohttp", "numpy", "xxhash"}
    server = {r.name for r in requirements if r.marker and r.marker.evaluate({"extra": "server"})}
    assert {"sqlalchemy", "alembic", "asyncpg", "aiosqlite", "openapi-core"} <= server
    assert {"client", "server", "transfer"} <= set(fields.get_all("Provides-Extra") or [])


def test_kvroute_comes_from_the_wheel_and_torch_is_absent(
    installed: Installed, tmp_path: Path
) -> None:
    where = installed.python_says("import kvroute; print(kvroute.__file__)", tmp_path)
    assert Path(where).is_relative_to(installed.site)
    found = installed.python_says(
        "import importlib.util as u; print(u.find_spec('torch') is None)", tmp_path
    )
    assert found == "True"
    version = installed.run("--version", cwd=tmp_path)
    assert version.stdout.strip() == f"kvroute {metadata.version('kvroute')}"


def test_serve_on_embedded_sqlite_from_any_directory(installed: Installed, tmp_path: Path) -> None:
    with LiveServer(tmp_path, command=[str(installed.kvroute)]) as server:
        with urllib.request.urlopen(server.url + "/v1/openapi.yaml", timeout=10) as answer:
            assert answer.read().startswith(b"openapi: 3.1.0")
        with urllib.request.urlopen(server.url + "/ui/", timeout=10) as answer:
            assert b"<title>kvroute console</title>" in answer.read()
        with urllib.request.urlopen(server.url + "/v1/deployments", timeout=10) as answer:
            assert answer.status == 200
    assert (tmp_path / "kvroute.db").is_file()


def test_demo_without_torch_says_what_to_install_in_one_line(
    installed: Installed, tmp_path: Path
) -> None:
    result = installed.run("demo", "--small", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "pip install 'kvroute[server,transfer]'" in lines[0]


@pytest.mark.postgres
def test_db_upgrade_on_postgresql(installed: Installed, postgres_url: str, tmp_path: Path) -> None:
    with postgres_lock(postgres_url):
        asyncio.run(recreate_schema(postgres_url))
        try:
            env = {"KVROUTE_DATABASE_URL": postgres_url}
            first = installed.run("db", "upgrade", cwd=tmp_path, env=env)
            assert first.returncode == 0, first.stderr
            assert migrate.current(postgres_url) == migrate.head()
            assert f"migrated from none (empty schema) to {migrate.head()} (head)" in first.stdout
            again = installed.run("db", "upgrade", cwd=tmp_path, env=env)
            assert "nothing to do" in again.stdout
            check = installed.run("db", "check", cwd=tmp_path, env=env)
            assert check.returncode == 0, check.stderr
        finally:
            asyncio.run(recreate_schema(postgres_url))
            migrate.upgrade(postgres_url)
