"""Renewals in waves: the renewals of a deployment that arrive together share one statement.

A fleet's heartbeats and engine-lease renewals are its most frequent writes. One by one, each pays
a round trip and a commit; in waves (``control.waves``), sixteen concurrent renewals cost one
statement and one commit (on SQLite, one write transaction), and each is still judged at its own
clock reading, after it arrived, with the fencing rules of ``kvroute.store.leases`` (a rank's own
lease) and ``kvroute.store.engine_leases``.
"""

from __future__ import annotations

from datetime import datetime

from kvroute.control.waves import Waves
from kvroute.store import engine_leases, leases, registry
from kvroute.store.engine import SessionMaker, engine_of
from kvroute.store.records import LeaseRecord


class Renewals:
    def __init__(self, sessionmaker: SessionMaker) -> None:
        self._sessionmaker = sessionmaker
        # A rank renewed twice in one wave would be judged once: its repeat waits a wave.
        self._waves: Waves[leases.Renewal, datetime | None] = Waves(
            self._renew, name="renewals", distinct=lambda renewal: renewal[:2]
        )
        # Likewise a lease renewed twice in one wave.
        self._lease_waves: Waves[engine_leases.Renewal, engine_leases.Renewed | None] = Waves(
            self._renew_leases, name="lease-renewals", distinct=lambda renewal: renewal[0]
        )

    async def heartbeat(
        self, deployment: str, instance: str, rank: int, *, now: datetime
    ) -> datetime:
        """The renewed expiry; ``NotFound``/``LeaseExpired`` as ``store.registry.heartbeat``."""
        renewed = await self._waves.submit(deployment, (instance, rank, now))
        if renewed is not None:
            return renewed
        raise await registry.heartbeat_refusal(
            self._sessionmaker, deployment, instance, rank, now=now
        )

    async def _renew(self, deployment: str, wave: list[leases.Renewal]) -> list[datetime | None]:
        engine = engine_of(self._sessionmaker)
        renewed = await leases.renew_many(engine, deployment, wave)
        return [renewed.get((instance, rank)) for instance, rank, _ in wave]

    async def renew_lease(self, deployment: str, lease_id: str, *, now: datetime) -> LeaseRecord:
        """The renewed lease and the ranks it renewed; ``LeaseExpired`` as
        ``store.engine_leases.renew``."""
        renewed = await self._lease_waves.submit(deployment, (lease_id, now))
        return engine_leases.record(deployment, lease_id, renewed)

    async def _renew_leases(
        self, deployment: str, wave: list[engine_leases.Renewal]
    ) -> list[engine_leases.Renewed | None]:
        engine = engine_of(self._sessionmaker)
        renewed = await engine_leases.renew_many(engine, deployment, wave)
        return [renewed.get(lease_id) for lease_id, _ in wave]
