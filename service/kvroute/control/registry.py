"""Registration as an application service: admission with the process's caches.

One ``Registry`` per process holds what makes admission cheap at fleet scale: the group
admission queues (``control.admissions``: registrations arriving together share one
transaction), the parsed registrations by generation (shared with plans, transfers and the matrix)
and the verdicts memoized per pair of geometry classes (shared with the matrix). The caches hold
immutable facts (a document at a generation, a verdict of two geometries), so replicas never need
to agree on them.
"""

from __future__ import annotations

from datetime import datetime

from cachetools import LRUCache

from kvroute.control.admissions import Admissions
from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.classes import Verdict
from kvroute.store import admission, registry
from kvroute.store.engine import SessionMaker
from kvroute.store.records import RegisterOutcome
from kvroute.store.registrations import RegistrationCache

VERDICT_CACHE_SIZE = 65_536  # pairs of geometry classes: a fleet has tens


class Registry:
    def __init__(self, sessionmaker: SessionMaker, *, rejection_log_size: int) -> None:
        self.sessionmaker = sessionmaker
        self.rejection_log_size = rejection_log_size
        self.registrations = RegistrationCache(sessionmaker)
        self.verdicts: LRUCache[tuple[str, str], Verdict] = LRUCache(VERDICT_CACHE_SIZE)
        self._admissions = Admissions(self._admit_batch)

    async def register(self, reg: RankRegistration, *, now: datetime) -> RegisterOutcome:
        """Admits, renews or re-registers ``reg`` in the next batch of its deployment; a refusal is
        logged and raised as its ``GeometryError``, changing nothing."""
        try:
            await admission.prepare(reg)
            outcome = await self._admissions.submit(reg, now)
            if isinstance(outcome, GeometryError):
                raise outcome
        except GeometryError as error:
            await self.refuse(
                error, deployment=reg.deployment, instance=reg.instance, rank=reg.rank, now=now
            )
            raise
        return outcome

    async def _admit_batch(
        self, candidates: list[RankRegistration], now: datetime
    ) -> admission.BatchResult:
        return await admission.admit_batch(
            self.sessionmaker,
            candidates,
            now=now,
            registrations=self.registrations,
            verdicts=self.verdicts,
        )

    async def dry_run(
        self, candidates: list[RankRegistration], *, now: datetime
    ) -> tuple[int, GeometryError | None]:
        """Admission's answer for ``candidates`` in order, up to the first refusal; stores nothing
        (no rank, no deployment, no rejection log entry: it is a question, not a registration)."""
        return await admission.dry_run(
            self.sessionmaker,
            candidates,
            now=now,
            registrations=self.registrations,
            verdicts=self.verdicts,
        )

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
        return await registry.heartbeat(self.sessionmaker, deployment, instance, rank, now=now)
