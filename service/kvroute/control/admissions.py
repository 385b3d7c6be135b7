"""Group admission: the registrations of one deployment that arrive together share a transaction.

Admissions of a deployment serialize on its database lock, so under a fleet's bring-up they queue.
Instead of each taking the lock for its own dozen statements, the first to arrive admits
everything queued behind it in one batch (``store.admission.admit_batch``), whose answers are
exactly those of admitting the same registrations one by one in arrival order; registrations that
arrive meanwhile form the next batch. A quiet deployment sees batches of one, so nothing waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import CollectorRegistry, Histogram

from kvroute.geometry import RankRegistration
from kvroute.store.admission import BatchResult, Outcome

MAX_BATCH = 64  # bounds one transaction's lock hold and its statements' sizes
BATCH_RANK_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# A batch's transaction: a few round trips, or seconds when it waits for another replica's lock.
BATCH_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass(frozen=True)
class AdmissionMetrics:
    """What group admission did: registrations answered per batch, and how long each batch took
    (its transaction, the wait for the deployment's lock included), by deployment."""

    ranks: Histogram
    seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AdmissionMetrics:
        return cls(
            ranks=Histogram(
                "kvroute_admission_batch_ranks",
                "Registrations answered by one admission batch (one transaction)",
                ["deployment"],
                buckets=BATCH_RANK_BUCKETS,
                registry=registry,
            ),
            seconds=Histogram(
                "kvroute_admission_batch_seconds",
                "Time one admission batch held its deployment's queue, lock wait included",
                ["deployment"],
                buckets=BATCH_SECONDS_BUCKETS,
                registry=registry,
            ),
        )

    def observe(self, deployment: str, answered: int, seconds: float) -> None:
        self.ranks.labels(deployment=deployment).observe(answered)
        self.seconds.labels(deployment=deployment).observe(seconds)


# (candidates, their engine leases or None, now) -> the batch's result
AdmitBatch = Callable[[list[RankRegistration], list[str | None], datetime], Awaitable[BatchResult]]


@dataclass
class _Waiting:
    reg: RankRegistration
    lease: str | None
    now: datetime
    answer: asyncio.Future[Outcome]


class Admissions:
    """Per-deployment queues of registrations, each drained by one task at a time."""

    def __init__(self, admit_batch: AdmitBatch, metrics: AdmissionMetrics | None = None) -> None:
        self._admit_batch = admit_batch
        self._metrics = metrics
        self._queues: dict[str, list[_Waiting]] = {}
        self._drains: dict[str, asyncio.Task[None]] = {}

    async def submit(
        self, reg: RankRegistration, now: datetime, lease: str | None = None
    ) -> Outcome:
        """The registration's outcome (a refusal is returned, not raised); ``lease`` names the
        engine lease that is to keep the rank."""
        waiting = _Waiting(reg, lease, now, asyncio.get_running_loop().create_future())
        self._queues.setdefault(reg.deployment, []).append(waiting)
        if reg.deployment not in self._drains:
            self._drains[reg.deployment] = asyncio.create_task(
                self._drain(reg.deployment), name=f"kvroute-admissions-{reg.deployment}"
            )
        return await waiting.answer

    async def _drain(self, deployment: str) -> None:
        queue = self._queues[deployment]
        try:
            while queue:
                batch = _take(queue)
                started = time.perf_counter()
                try:
                    result = await self._admit_batch(
                        [waiting.reg for waiting in batch],
                        [waiting.lease for waiting in batch],
                        max(w.now for w in batch),
                    )
                except Exception as error:  # the database failed the whole batch
                    for waiting in batch:
                        _settle(waiting.answer, error=error)
                    continue
                if self._metrics is not None:
                    elapsed = time.perf_counter() - started
                    self._metrics.observe(deployment, len(result.outcomes), elapsed)
                for waiting, outcome in zip(batch, result.outcomes, strict=False):
                    _settle(waiting.answer, outcome=outcome)
                queue[:0] = batch[len(result.outcomes) :]  # deferred: first in the next batch
        finally:
            del self._drains[deployment]
            del self._queues[deployment]
            for waiting in queue:  # only when the drain itself was cancelled (shutdown)
                waiting.answer.cancel()


def _take(queue: list[_Waiting]) -> list[_Waiting]:
    """The longest prefix of distinct ranks, at most ``MAX_BATCH`` long, removed from ``queue``."""
    keys: set[tuple[str, int]] = set()
    count = 0
    for waiting in queue[:MAX_BATCH]:
        if waiting.reg.key in keys:
            break
        keys.add(waiting.reg.key)
        count += 1
    batch = queue[:count]
    del queue[:count]
    return batch


def _settle(
    answer: asyncio.Future[Outcome],
    *,
    outcome: Outcome | None = None,
    error: BaseException | None = None,
) -> None:
    if answer.done():  # its request went away; the registration still took effect
        return
    if error is not None:
        answer.set_exception(error)
    else:
        assert outcome is not None
        answer.set_result(outcome)
