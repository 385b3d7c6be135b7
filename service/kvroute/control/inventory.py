"""What the registry and the job table hold, as operators and workers read it.

The api's read-only handlers (deployments, instances, ranks, refusals, transfer jobs), readiness and
the metrics scrape reach the store here, never directly: ``tests/unit/test_layering.py`` holds the
api to ``control`` for every store read and write. Reads take no lock; ``GET`` of a transfer job
works on every replica, with or without a data plane (nothing here imports torch).
"""

from __future__ import annotations

from datetime import datetime

from kvroute import wire
from kvroute.store import jobs, lease_watch, registry
from kvroute.store.engine import SessionMaker, ping
from kvroute.store.rejections import DEFAULT_LOG_SIZE

RankCounts = dict[tuple[str, str], tuple[int, int]]  # (deployment, instance) -> (live, expired)


class Inventory:
    """Read-only views of the rank registry and the transfer jobs, over the app's sessionmaker."""

    def __init__(self, sessionmaker: SessionMaker) -> None:
        self.sessionmaker = sessionmaker

    async def deployments(self, *, now: datetime) -> list[wire.DeploymentSummary]:
        return await registry.list_deployments(self.sessionmaker, now=now)

    async def deployment(self, name: str, *, now: datetime) -> wire.Deployment:
        return await registry.get_deployment(self.sessionmaker, name, now=now)

    async def instances(self, deployment: str, *, now: datetime) -> list[wire.InstanceSummary]:
        return await registry.list_instances(self.sessionmaker, deployment, now=now)

    async def instance(self, deployment: str, instance: str, *, now: datetime) -> wire.Instance:
        return await registry.get_instance(self.sessionmaker, deployment, instance, now=now)

    async def rank(self, deployment: str, instance: str, rank: int, *, now: datetime) -> wire.Rank:
        return await registry.get_rank(self.sessionmaker, deployment, instance, rank, now=now)

    async def rejections(self, limit: int = DEFAULT_LOG_SIZE) -> list[wire.Rejection]:
        return await registry.list_rejections(self.sessionmaker, limit)

    async def transfer_job(self, job_id: str) -> wire.TransferJob:
        return await jobs.get_job(self.sessionmaker, job_id)

    async def transfer_jobs(self, deployment: str, *, limit: int) -> list[wire.TransferJob]:
        return await jobs.list_jobs(self.sessionmaker, deployment, limit=limit)

    async def rank_counts(self, *, now: datetime) -> RankCounts:
        """Live and expired ranks per instance, judged at ``now`` (for gauges, not admission)."""
        return await lease_watch.rank_counts(self.sessionmaker, now=now)

    async def ping(self) -> None:
        """One round trip to the database; raises what the driver raises when it cannot."""
        await ping(self.sessionmaker)
