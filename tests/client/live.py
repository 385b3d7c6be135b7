"""A real ``kvroute serve`` process on 127.0.0.1 for tests that talk to it as workers do.

The sync client and separate worker processes cannot share the test's event loop with an in-process
server, and the lease keeper must survive a server restart, so these tests run the CLI exactly as an
operator would: SQLite in a temp directory, a free port, bearer tokens, a bounded wait for /healthz.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

WORKER_TOKEN = "worker-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """``kvroute serve`` on a SQLite file; ``restart(fresh_db=...)`` keeps the port."""

    def __init__(self, directory: Path, *, port: int | None = None, tokens: bool = True) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.tokens = tokens
        self.database = directory / "kvroute.db"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = directory / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LiveServer:
        env = {
            **os.environ,
            "KVROUTE_DATABASE_URL": f"sqlite+aiosqlite:///{self.database}",
            "KVROUTE_LOG_LEVEL": "WARNING",
            "KVROUTE_SHUTDOWN_TIMEOUT_SECONDS": "2",
        }
        if self.tokens:
            env["KVROUTE_WORKER_TOKEN"] = WORKER_TOKEN
            env["KVROUTE_ADMIN_TOKEN"] = ADMIN_TOKEN
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvroute", "serve", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"kvroute exited {self.process.returncode}: {self.log.read_text()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        raise RuntimeError(f"kvroute did not become healthy in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def restart(self, *, fresh_db: bool) -> None:
        self.stop()
        if fresh_db:
            self.database.unlink()
        self.start()
