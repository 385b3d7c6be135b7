"""Registration as an application service: admission with the process's caches.

One ``Registry`` per process holds what makes admission cheap at fleet scale: the group
admission queues (``control.admissions``: registrations arriving together share one
transaction), the parsed registrations by generation (shared with plans, transfers and the matrix)
the verdicts memoized per pair of geometry classes (shared with the matrix) and the pairs of
instance digests whose ranks agreed (``geometry.checks.instance``). The caches hold immutable facts
(a document at a generation, a verdict of two geometries), so replicas never need to agree on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from cachetools import LRUCache

from kvroute.control.admissions import AdmissionMetrics, Admissions
from kvroute.control.answers import AnswerCache
from kvroute.control.renewals import Renewals
from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.checks.classes import VerdictMemo
from kvroute.geometry.checks.instance import InstanceMemo
from kvroute.store import admission, engine_leases, events, lease_watch, registry, statistics
from kvroute.store.engine import SessionMaker, engine_of
from kvroute.store.errors import LeaseExpired
from kvroute.store.records import LeaseRecord, RankName, RegisterOutcome
from kvroute.store.registrations import RegistrationCache

VERDICT_CACHE_SIZE = 65_536  # pairs of geometry classes: a fleet has tens
AGREEMENT_CACHE_SIZE = 4_096  # pairs of instance digests: a fleet's instances have a handful


@dataclass(frozen=True, slots=True)
class ReapRound:
    """One round of the lease reaper: leases that ended in its window, ranks it removed (their
    lease ended over the grace period ago) and the rank counts per instance afterwards."""

    expired: list[tuple[RankName, datetime]]
    reaped: list[RankName]
    counts: dict[tuple[str, str], tuple[int, int]]


class Registry:
    """The rank registry's writes: admission, refusals, heartbeats, engine leases, deletions and
    the reaper's rounds."""

    def __init__(
        self,
        sessionmaker: SessionMaker,
        *,
        rejection_log_size: int,
        admission_metrics: AdmissionMetrics | None = None,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.rejection_log_size = rejection_log_size
        self.registrations = RegistrationCache(sessionmaker)
        self.verdicts: VerdictMemo = LRUCache(VERDICT_CACHE_SIZE)
        self.agreements: InstanceMemo = LRUCache(AGREEMENT_CACHE_SIZE)
        # The matrix and pairs answers as last rendered, with the state they were computed from.
        self.answers = AnswerCache()
        self._admissions = Admissions(self._admit_batch, admission_metrics)
        # Called after each change this process commits (the event hub reads the log at once).
        self.changed: Callable[[str], None] = lambda deployment: None
        self._renewals = Renewals(sessionmaker)

    async def register(
        self,
        reg: RankRegistration,
        *,
        now: datetime,
        engine_lease: str | None = None,
        checked: bool = False,
    ) -> RegisterOutcome:
        """Admits, renews or re-registers ``reg`` in the next batch of its deployment, kept by
        ``engine_lease`` when given (else by a lease of its own); a refusal is logged and raised as
        its ``GeometryError``, changing nothing. A lease that is not live raises ``LeaseExpired``
        (not a refusal: nothing is logged). ``checked``: the caller already ran
        ``admission.prepare``'s checks (and refused their failures as this would)."""
        try:
            if not checked:
                await admission.prepare(reg)
            outcome = await self._admissions.submit(reg, now, engine_lease)
            if isinstance(outcome, (GeometryError, LeaseExpired)):
                raise outcome
            self.changed(reg.deployment)
        except GeometryError as error:
            await self.refuse(
                error, deployment=reg.deployment, instance=reg.instance, rank=reg.rank, now=now
            )
            raise
        return outcome

    async def _admit_batch(
        self, candidates: list[RankRegistration], leases: list[str | None], now: datetime
    ) -> admission.BatchResult:
        return await admission.admit_batch(
            self.sessionmaker, candidates, self, now=now, leases=leases
        )

    async def dry_run(
        self, candidates: list[RankRegistration], *, now: datetime
    ) -> tuple[int, GeometryError | None]:
        """Admission's answer for ``candidates`` in order, up to the first refusal; stores nothing
        (no rank, no deployment, no rejection log entry: it is a question, not a registration)."""
        return await admission.dry_run(self.sessionmaker, candidates, self, now=now)

    async def refuse(
        self, error: GeometryError, *, deployment: str, instance: str, rank: int, now: datetime
    ) -> None:
        """Logs a refusal found before admission (a document that does not parse)."""
        await registry.record_rejection(
            self.sessionmaker,
            error,
            deployment=deployment,
            instance=instance,
            rank=rank,
            now=now,
            keep=self.rejection_log_size,
        )

    async def heartbeat(
        self, deployment: str, instance: str, rank: int, *, now: datetime
    ) -> datetime:
        return await self._renewals.heartbeat(deployment, instance, rank, now=now)

    # Engine leases: one lease keeps many ranks (``kvroute.store.engine_leases``).

    async def grant_lease(
        self, deployment: str, lease_seconds: int, *, now: datetime
    ) -> LeaseRecord:
        return await engine_leases.grant(self.sessionmaker, deployment, lease_seconds, now=now)

    async def renew_lease(self, deployment: str, lease_id: str, *, now: datetime) -> LeaseRecord:
        return await self._renewals.renew_lease(deployment, lease_id, now=now)

    async def lease(self, deployment: str, lease_id: str) -> LeaseRecord:
        return await engine_leases.get(self.sessionmaker, deployment, lease_id)

    async def revoke_lease(
        self, deployment: str, lease_id: str, *, now: datetime
    ) -> tuple[tuple[str, int], ...]:
        """Removes the lease and the ranks it keeps; returns those ranks."""
        ranks = await engine_leases.revoke(self.sessionmaker, deployment, lease_id, now=now)
        self.changed(deployment)
        return ranks

    # Deletions (admin).

    async def delete_rank(
        self, deployment: str, instance: str, rank: int, *, now: datetime
    ) -> None:
        await registry.delete_rank(self.sessionmaker, deployment, instance, rank, now=now)
        self.changed(deployment)

    async def delete_instance(self, deployment: str, instance: str, *, now: datetime) -> None:
        await registry.delete_instance(self.sessionmaker, deployment, instance, now=now)
        self.changed(deployment)

    # The lease reaper (``api.lifecycle``).

    async def reap(self, *, since: datetime, now: datetime, grace: timedelta) -> ReapRound:
        """Reports the leases that ended in ``(since, now]`` and removes the long-expired ranks."""
        expired = await lease_watch.expired_between(self.sessionmaker, after=since, until=now)
        reaped = await registry.reap_expired(self.sessionmaker, now=now, grace=grace)
        counts = await lease_watch.rank_counts(self.sessionmaker, now=now)
        return ReapRound(expired, reaped, counts)

    async def refresh_statistics(self) -> list[str]:
        """Analyzes the tables a fleet grew since they were last analyzed (``store.statistics``);
        the reaper's rounds call it. Answers the tables analyzed."""
        return await statistics.refresh(engine_of(self.sessionmaker))

    async def reap_engine_leases(self, *, cutoff: datetime) -> None:
        """Removes the engine leases that ended by ``cutoff`` with their ranks (reaped before),
        or that never attached any, and trims the event log."""
        await engine_leases.reap_expired(self.sessionmaker, cutoff=cutoff)
        await events.trim(self.sessionmaker)
