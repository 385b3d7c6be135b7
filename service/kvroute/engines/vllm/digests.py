"""Sampled KV digests and the canary in the connector (``kv_digest_rate`` of
``kv_connector_extra_config``).

The canary (``canary``): a producer rank writes it into vLLM's null block at start-up, and a
consumer rank pulls it with the real plan and NIXL when it first pairs with a producer instance,
and again after that instance registers again (the prefetcher drops its plan), round by round
(``pulls``), checks each round here, off the step, and reports the path once.

A producer's scheduler samples a finished request and marks its handover (``kvroute_digest``);
each producer rank then digests the request's blocks as it holds them, in logical order
(``client.kv_digest``), and stores the digest in kvroute, off the engine's step. A consumer rank
whose pull of a marked request completed reads every sending producer rank's digest from kvroute,
digests what it received over the same chunks, and compares, also off the step: a mismatch makes
the request's blocks load errors (vLLM recomputes them rather than decoding from wrong KV), is
reported to kvroute as a failed path (the pairs answer then leaves the pair out, an event and
``kvroute_kv_digest_mismatch_total`` follow) and logged with the first wrong element.

Digests cover every KV cache group that transfers (``memory``: full attention, sliding windows
over the tokens each side holds, recurrent state as one request state per group). A CPU engine's
cache is read in place, a GPU engine's through the slots each use stages on the host
(``client.pool_access``); where the device cannot be reached, a marked request is pulled
unchecked, and said so once in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvroute.client import KvrouteClient, KvrouteError
from kvroute.client.integrity import path_report
from kvroute.client.kv_digest import Grid, KvDigest, Mismatch
from kvroute.engines.vllm.canary import Canary
from kvroute.engines.vllm.memory import RankMemory
from kvroute.geometry import RankRegistration

log = logging.getLogger(f"vllm.{__name__}")
Blocks = tuple[tuple[int, ...], ...]  # a request's block list per KV cache group, by group id
CHECKERS = 4  # sampled requests a consumer rank compares at once
POLL_S = 0.05  # between reads of the producer's digests while its ranks are still storing them
# A path report kvroute could not take is sent again after these pauses (s): a lease that lapsed
# on a loaded machine (404 until the keeper registers again) or kvroute restarting must not lose
# a canary, which is pulled once per pairing.
REPORT_RETRIES_S = (1.0, 2.0, 4.0, 8.0, 16.0)


def _transient(error: KvrouteError) -> bool:
    """Unreachable, a side not live (yet: a lease being renewed), or kvroute overloaded."""
    return error.status is None or error.status in (404, 429) or error.status >= 500


class ProducerDigests:
    """A producer rank's digests of sampled requests, stored in kvroute off the step."""

    def __init__(
        self, client: KvrouteClient, memory: RankMemory, chunk: int, window_step: int = 0
    ) -> None:
        self.client, self.memory, self.chunk = client, memory, chunk
        self.window_step = window_step  # 0: windows cut by ``chunk`` (see ``Grid``)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-digest")

    def submit(self, request_id: str, blocks: Blocks, prompt_tokens: int) -> None:
        self.pool.submit(self._store, request_id, blocks, prompt_tokens)

    def _store(self, request_id: str, blocks: Blocks, prompt_tokens: int) -> None:
        reg = self.memory.reg
        try:
            grid = Grid(self.window_step, prompt_tokens) if self.window_step else None
            tokens = range(prompt_tokens)
            digest = self.memory.digest(blocks, tokens, self.chunk, prompt_tokens, grid=grid)
            self.client.put_kv_digest(
                reg.deployment, reg.instance, request_id, reg.rank, digest.to_json()
            )
        except Exception:  # the consumer's check then times out and fails safe (recompute)
            log.warning("kvroute: could not store the digest of %s", request_id, exc_info=True)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Check:
    """One received request to compare: who produced it (its ranks' registrations), its blocks
    here (a list per KV cache group), the tokens moved of its prompt."""

    request_id: str
    producer: str
    producer_request: str
    senders: frozenset[int]
    blocks: Blocks
    tokens: tuple[int, int]
    prompt_tokens: int
    documents: Mapping[int, Mapping[str, Any]]


class ConsumerChecks:
    """A consumer rank's comparisons, off the step; ``finished`` answers (check, failure).

    Several at once: a check mostly waits, for the producer's digest to reach kvroute, and one
    waiting must not hold back the next request's. A path's outcome is reported after the
    request is answered, on a thread of its own: the report is a kvroute write, no part of
    whether the request's KV can be trusted."""

    def __init__(
        self, client: KvrouteClient, memory: RankMemory, chunk: int, timeout_s: float
    ) -> None:
        self.client, self.memory, self.chunk, self.timeout_s = client, memory, chunk, timeout_s
        self.pool = ThreadPoolExecutor(CHECKERS, thread_name_prefix="kvroute-digest-check")
        self.reports = ThreadPoolExecutor(1, thread_name_prefix="kvroute-path-report")
        self.closing = threading.Event()  # ends a report's pause between tries
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

    def check_canary(self, canary: Canary) -> Future[tuple[Mismatch | None, float]]:
        """Checks the canary round pulled into the null block: (first wrong element, seconds)."""
        return self.pool.submit(self._timed_check, canary)

    def _timed_check(self, canary: Canary) -> tuple[Mismatch | None, float]:
        started = time.perf_counter()
        failure = self.memory.check_canary(canary)
        return failure, time.perf_counter() - started

    def report_canary(self, canary: Canary, failure: Mismatch | None, cost_s: float) -> None:
        """Reports the path's outcome (``cost_s``: its rounds' pulls and checks)."""
        reg = self.memory.reg
        if failure is not None:
            log.error("kvroute: the canary from %s to %s rank %d failed at %s; kvroute routes no "
                      "request over this path", canary.instance, reg.instance, reg.rank,
                      failure.describe())  # fmt: skip
        else:
            log.info("kvroute: the canary from %s to %s rank %d attested %d views in %d rounds "
                     "(%.1f ms)", canary.instance, reg.instance, reg.rank,
                     sum(map(len, canary.rounds)), len(canary.rounds), cost_s * 1e3)  # fmt: skip
        report = path_report(canary.instance, reg.instance, reg.rank, "canary", failure,
                             cost_s * 1e3)  # fmt: skip
        self.reports.submit(self._send, report, f"the canary from {canary.instance}")

    def _compare(self, check: Check) -> str | None:
        sent = self._producer_digest(check)
        if sent is None:
            return f"no digest from every producer rank after {self.timeout_s} s"
        start, end = check.tokens
        first = -(-start // self.chunk) * self.chunk  # whole chunks only: the producer's cuts
        if first >= end:
            return None
        peers = [
            RankRegistration.from_json(doc, deployment=self.memory.reg.deployment,
                                       instance=check.producer, rank=rank)
            for rank, doc in sorted(check.documents.items())
        ]  # fmt: skip
        got = self.memory.digest(
            check.blocks, range(first, end), self.chunk, check.prompt_tokens, peers,
            grid=sent.grid, gridded=sent.gridded,
        )  # fmt: skip
        failure = sent.window(first).first_mismatch(got)
        self.reports.submit(self._report, check, failure)
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
        self._send(report, f"the digest of {check.request_id}")

    def _send(self, report: Mapping[str, Any], what: str) -> None:
        """Reports a path's outcome, again after a pause while kvroute cannot take it."""
        deployment = self.memory.reg.deployment
        for pause_s in (*REPORT_RETRIES_S, None):
            try:
                self.client.report_kv_path(deployment, report)
                return
            except KvrouteError as error:
                if pause_s is None or not _transient(error):
                    log.warning("kvroute: could not report %s: %s", what, error)
                    return
            if self.closing.wait(pause_s):
                return

    def close(self) -> None:
        self.closing.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.reports.shutdown(wait=False, cancel_futures=True)
