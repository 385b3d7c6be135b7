"""Sampled KV digests and the canary in the connector (``kv_digest_rate`` of
``kv_connector_extra_config``).

The canary: vLLM's block pool keeps block 0 as its null block, given to no request, so a producer
rank writes the canary there at start-up (through the layout its backend's own cache write showed
the probe), and a consumer rank pulls it with the real plan and NIXL when it first pairs with a
producer instance, and again after that instance registers again (the prefetcher drops its plan),
checks it through its own layout and reports the path.

A producer's scheduler samples a finished request and marks its handover (``kvroute_digest``);
each producer rank then digests the request's blocks as it holds them, in logical order
(``client.kv_digest``), and stores the digest in kvroute, off the engine's step. A consumer rank
whose pull of a marked request completed reads every sending producer rank's digest from kvroute,
digests what it received over the same chunks, and compares, also off the step: a mismatch makes
the request's blocks load errors (vLLM recomputes them rather than decoding from wrong KV), is
reported to kvroute as a failed path (the pairs answer then leaves the pair out, an event and
``kvroute_kv_digest_mismatch_total`` follow) and logged with the first wrong element.

Digests read host memory (a CPU engine's cache, ``mem_type`` DRAM) and one KV cache group of
attention (hybrid state groups are not digested); elsewhere a marked request is pulled unchecked,
and said so once in the log.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.client import KvrouteClient, KvrouteError
from kvroute.client.integrity import check_canary, path_report, write_canary
from kvroute.client.kv_digest import KvDigest, Mismatch, kv_digest
from kvroute.client.nixl_descs import PoolAddress
from kvroute.geometry import RankRegistration

log = logging.getLogger(f"vllm.{__name__}")
POLL_S = 0.05
NULL_BLOCK = 0  # vLLM's BlockPool hands it to no request: the canary's block on both sides  # between reads of the producer's digests while its ranks are still storing them


def host_pools(addresses: Mapping[int, PoolAddress]) -> dict[int, np.ndarray]:
    """Flat uint8 arrays over a rank's registered pools (host memory)."""
    return {
        pool: np.ctypeslib.as_array(
            (ctypes.c_uint8 * (at.slot_stride * at.num_slots)).from_address(at.base)
        )
        for pool, at in addresses.items()
    }


@dataclass(frozen=True)
class RankMemory:
    """What a rank digests: its registration and its pools; None where digests cannot read."""

    reg: RankRegistration
    pools: dict[int, np.ndarray]

    @classmethod
    def of(
        cls,
        document: Mapping[str, Any],
        where: tuple[str, str, int],
        addresses: Mapping[int, PoolAddress],
        mem_type: str,
        groups: int,
    ) -> RankMemory | None:
        deployment, instance, rank = where
        if mem_type != "DRAM" or groups != 1:
            log.warning("kvroute: KV digests read host memory of one KV cache group; %s rank %d "
                        "(%s, %d groups) pulls sampled requests unchecked", instance, rank,
                        mem_type, groups)  # fmt: skip
            return None
        reg = RankRegistration.from_json(
            document, deployment=deployment, instance=instance, rank=rank
        )
        return cls(reg, host_pools(addresses))

    def digest(self, blocks: tuple[int, ...], tokens: range, chunk: int) -> KvDigest:
        return kv_digest(self.reg, self.pools, blocks, tokens, chunk)

    def write_canary(self) -> None:
        write_canary(self.reg, self.pools, [NULL_BLOCK], range(self.reg.tokens_per_block))


class ProducerDigests:
    """A producer rank's digests of sampled requests, stored in kvroute off the step."""

    def __init__(self, client: KvrouteClient, memory: RankMemory, chunk: int) -> None:
        self.client, self.memory, self.chunk = client, memory, chunk
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-digest")

    def submit(self, request_id: str, blocks: tuple[int, ...], prompt_tokens: int) -> None:
        self.pool.submit(self._store, request_id, blocks, prompt_tokens)

    def _store(self, request_id: str, blocks: tuple[int, ...], prompt_tokens: int) -> None:
        reg = self.memory.reg
        try:
            digest = self.memory.digest(blocks, range(prompt_tokens), self.chunk)
            self.client.put_kv_digest(
                reg.deployment, reg.instance, request_id, reg.rank, digest.to_json()
            )
        except Exception:  # the consumer's check then times out and fails safe (recompute)
            log.warning("kvroute: could not store the digest of %s", request_id, exc_info=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Check:
    """One received request to compare: who produced it, its blocks here, the tokens moved."""

    request_id: str
    producer: str
    producer_request: str
    senders: frozenset[int]
    blocks: tuple[int, ...]
    tokens: tuple[int, int]


class ConsumerChecks:
    """A consumer rank's comparisons, off the step; ``finished`` answers (check, failure)."""

    def __init__(
        self, client: KvrouteClient, memory: RankMemory, chunk: int, timeout_s: float
    ) -> None:
        self.client, self.memory, self.chunk, self.timeout_s = client, memory, chunk, timeout_s
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-digest-check")
        self.running: dict[str, tuple[Check, Future[str | None]]] = {}

    def submit(self, check: Check) -> None:
        self.running[check.request_id] = (check, self.pool.submit(self._compare, check))

    def finished(self) -> list[tuple[Check, str | None]]:
        """Checks that ended: None when the digests agree, else why the request is not trusted."""
        ended = []
        for request_id, (check, future) in list(self.running.items()):
            if future.done():
                del self.running[request_id]
                error = future.exception()
                ended.append((check, f"digest check failed: {error}" if error else future.result()))
        return ended

    def canary(self, producer: str, tokens: int, cost_s: float) -> None:
        """Checks the canary pulled from ``producer`` into the null block and reports the path."""
        self.pool.submit(self._canary, producer, tokens, cost_s)

    def _canary(self, producer: str, tokens: int, cost_s: float) -> None:
        reg = self.memory.reg
        started = time.perf_counter()
        failure = check_canary(reg, self.memory.pools, [NULL_BLOCK], range(tokens))
        cost_ms = (cost_s + time.perf_counter() - started) * 1e3
        if failure is not None:
            log.error("kvroute: the canary from %s to %s rank %d failed at %s; kvroute routes no "
                      "request over this path", producer, reg.instance, reg.rank,
                      failure.describe())  # fmt: skip
        report = path_report(producer, reg.instance, reg.rank, "canary", failure, cost_ms)
        try:
            self.client.report_kv_path(reg.deployment, report)
        except KvrouteError:
            log.warning("kvroute: could not report the canary from %s", producer, exc_info=True)

    def _compare(self, check: Check) -> str | None:
        sent = self._producer_digest(check)
        if sent is None:
            return f"no digest from every producer rank after {self.timeout_s} s"
        start, end = check.tokens
        first = -(-start // self.chunk) * self.chunk  # whole chunks only: the producer's cuts
        if first >= end:
            return None
        got = self.memory.digest(check.blocks, range(first, end), self.chunk)
        failure = sent.window(first).first_mismatch(got)
        self._report(check, failure)
        return None if failure is None else f"KV digest mismatch: {failure.describe()}"

    def _producer_digest(self, check: Check) -> KvDigest | None:
        deadline = time.monotonic() + self.timeout_s
        reg = self.memory.reg
        while time.monotonic() < deadline:
            found = self.client.kv_digests(reg.deployment, check.producer, check.producer_request)
            if check.senders <= found.keys():
                merged: KvDigest | None = None
                for rank in sorted(check.senders):
                    digest = KvDigest.from_json(found[rank])
                    if merged is None:
                        merged = digest
                    else:
                        merged.merge(digest)
                return merged
            time.sleep(POLL_S)
        return None

    def _report(self, check: Check, failure: Mismatch | None) -> None:
        reg = self.memory.reg
        report = path_report(check.producer, reg.instance, reg.rank, "digest", failure)
        try:
            self.client.report_kv_path(reg.deployment, report)
        except KvrouteError:
            log.warning("kvroute: could not report the digest of %s", check.request_id,
                        exc_info=True)  # fmt: skip

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
