"""A real ``kvroute serve`` process on 127.0.0.1, for tests, benchmarks and local experiments.

Clients that must not share an event loop with the server (the sync client, worker processes, a
load generator, a lease keeper that outlives a server restart) talk to kvroute exactly as in
production: the CLI in its own process, a free loopback port, a bounded wait for readiness.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

START_TIMEOUT_S = 90.0  # imports alone took 12-28 s on the shared 2-core machine (load 8-9)
STOP_TIMEOUT_S = 15.0
CALL_TIMEOUT_S = 30.0


def json_call(method: str, url: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    """One JSON request with ``token`` as its bearer: (status, JSON body, None when empty); a 4xx
    or 5xx is an answer here, not an error, and nothing is retried (unlike the client)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LiveServer:
    """``kvroute serve`` in ``directory``; SQLite there unless ``database_url`` says otherwise.

    ``tokens`` is (worker, admin); without tokens kvroute serves loopback only, as here.
    ``command`` is the program that serves (default: this interpreter's ``-m kvroute``; e.g. the
    ``kvroute`` script of another installation). ``restart(fresh_db=True)`` keeps the port and
    starts over on an empty SQLite database.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        database_url: str | None = None,
        tokens: tuple[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "kvroute"),
    ) -> None:
        self.directory = directory
        self.command = list(command)
        self.port = port or free_port()
        self.database = directory / "kvroute.db"
        self.database_url = database_url or f"sqlite+aiosqlite:///{self.database}"
        self.tokens = tokens
        self.extra_env = dict(env or {})
        self.log = directory / f"kvroute-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        # The caller's own KVROUTE_* settings must not leak into the server under test.
        env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTE_")}
        env.update(
            KVROUTE_DATABASE_URL=self.database_url,
            KVROUTE_LOG_LEVEL="WARNING",
            KVROUTE_SHUTDOWN_TIMEOUT_SECONDS="2",
            # Nothing routes to a test server through a load balancer: stop without a drain.
            KVROUTE_DRAIN_SECONDS="0",
        )
        if self.tokens is not None:
            env.update(KVROUTE_WORKER_TOKEN=self.tokens[0], KVROUTE_ADMIN_TOKEN=self.tokens[1])
        env.update(self.extra_env)
        return env

    def start(self) -> LiveServer:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *self.command,
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                ],
                cwd=self.directory,
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"kvroute serve exited ({code}): {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"kvroute serve was not ready within {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)
        self.process = None

    def restart(self, *, fresh_db: bool) -> None:
        self.stop()
        if fresh_db:
            # The WAL and its index too: a fresh database file next to an old WAL would replay
            # the old rows into it whenever the previous server exited before a checkpoint.
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{self.database}{suffix}").unlink(missing_ok=True)
        self.start()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
