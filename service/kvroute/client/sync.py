"""A blocking facade over the async client for workers whose main loop is not asyncio.

The async client runs on a private event loop in a daemon thread, so a lease keeper started from
blocking code keeps heartbeating while the worker's own thread is busy in a forward pass; each
blocking method submits one coroutine to that loop and waits for its result.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, Self, TypeVar

from kvroute import wire
from kvroute.client.aio import DEFAULT_TIMEOUT_S, AsyncKvrouteClient
from kvroute.client.lease import EngineLeaseKeeper, LeaseKeeper
from kvroute.client.models import (
    Compatibility,
    DeploymentSummary,
    EngineLease,
    Instance,
    InstanceSummary,
    Lease,
    PlanDocument,
    RankInfo,
    Registered,
    Rejection,
    TransferStatus,
)
from kvroute.client.retry import RetryPolicy

T = TypeVar("T")


class KvrouteClient:
    """``with KvrouteClient(url, token=...) as client: client.register(...)``"""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvroute-client", daemon=True
        )
        self._thread.start()
        self.aio = AsyncKvrouteClient(base_url, token=token, timeout=timeout, retry=retry)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.aio.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(
        self,
        deployment: str,
        instance: str,
        rank: int,
        document: Mapping[str, Any],
        *,
        engine_lease: str | None = None,
    ) -> Registered:
        return self._run(
            self.aio.register(deployment, instance, rank, document, engine_lease=engine_lease)
        )

    def grant_lease(self, deployment: str, lease_seconds: int) -> EngineLease:
        return self._run(self.aio.grant_lease(deployment, lease_seconds))

    def renew_lease(self, deployment: str, lease_id: str) -> EngineLease:
        return self._run(self.aio.renew_lease(deployment, lease_id))

    def get_lease(self, deployment: str, lease_id: str) -> EngineLease:
        return self._run(self.aio.get_lease(deployment, lease_id))

    def revoke_lease(self, deployment: str, lease_id: str) -> None:
        self._run(self.aio.revoke_lease(deployment, lease_id))

    def keep_engine_lease(
        self,
        deployment: str,
        documents: Mapping[tuple[str, int], Mapping[str, Any]],
        *,
        interval: float | None = None,
    ) -> SyncEngineLease:
        """One engine lease for all the ranks, registered with it and renewed in the background
        until ``stop()`` (or the ``with`` block ends)."""
        keeper = self.aio.keep_engine_lease(deployment, documents, interval=interval)

        async def start() -> EngineLeaseKeeper:
            await keeper.start()
            return keeper

        return SyncEngineLease(self, self._run(start()))

    def heartbeat(self, deployment: str, instance: str, rank: int) -> Lease:
        return self._run(self.aio.heartbeat(deployment, instance, rank))

    def get_rank(self, deployment: str, instance: str, rank: int) -> RankInfo:
        return self._run(self.aio.get_rank(deployment, instance, rank))

    def deregister(self, deployment: str, instance: str, rank: int) -> None:
        self._run(self.aio.deregister(deployment, instance, rank))

    def keep_lease(
        self,
        deployment: str,
        instance: str,
        rank: int,
        document: Mapping[str, Any],
        *,
        interval: float | None = None,
        per_rank: bool = False,
    ) -> SyncLease:
        """Registers and renews in the background until ``stop()`` (or the ``with`` block ends);
        an engine lease of the rank's own unless ``per_rank``."""
        keeper = LeaseKeeper(
            self.aio, deployment, instance, rank, document, interval=interval, per_rank=per_rank
        )

        async def start() -> LeaseKeeper:
            await keeper.start()
            return keeper

        return SyncLease(self, self._run(start()))

    def get_plan(
        self,
        deployment: str,
        *,
        sender: str,
        receiver: str,
        receiver_rank: int,
        sender_dp_rank: int | None = None,
        period: bool = False,
        prompt_tokens: int | None = None,
    ) -> PlanDocument:
        return self._run(
            self.aio.get_plan(
                deployment,
                sender=sender,
                receiver=receiver,
                receiver_rank=receiver_rank,
                sender_dp_rank=sender_dp_rank,
                period=period,
                prompt_tokens=prompt_tokens,
            )
        )

    def get_plans(
        self,
        deployment: str,
        *,
        sender: str,
        receiver: str,
        sender_dp_rank: int | None = None,
        period: bool = False,
        prompt_tokens: int | None = None,
    ) -> list[PlanDocument]:
        return self._run(
            self.aio.get_plans(
                deployment,
                sender=sender,
                receiver=receiver,
                sender_dp_rank=sender_dp_rank,
                period=period,
                prompt_tokens=prompt_tokens,
            )
        )

    def submit_transfer(
        self,
        deployment: str,
        *,
        sender: str,
        receiver: str,
        receiver_ranks: Sequence[int],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        tokens: tuple[int, int] | None = None,
        src_first_token: int | None = None,
        dst_first_token: int | None = None,
        src_state_slot: int | None = None,
        dst_state_slot: int | None = None,
        prompt_tokens: int | None = None,
    ) -> TransferStatus:
        return self._run(
            self.aio.submit_transfer(
                deployment,
                sender=sender,
                receiver=receiver,
                receiver_ranks=receiver_ranks,
                src_blocks=src_blocks,
                dst_blocks=dst_blocks,
                tokens=tokens,
                src_first_token=src_first_token,
                dst_first_token=dst_first_token,
                src_state_slot=src_state_slot,
                dst_state_slot=dst_state_slot,
                prompt_tokens=prompt_tokens,
            )
        )

    def get_transfer(self, job_id: str) -> TransferStatus:
        return self._run(self.aio.get_transfer(job_id))

    def cancel_transfer(self, job_id: str) -> TransferStatus | None:
        return self._run(self.aio.cancel_transfer(job_id))

    def wait_transfer(
        self, job_id: str, *, limit_s: float = 60.0, poll_interval: float = 0.02
    ) -> TransferStatus:
        return self._run(
            self.aio.wait_transfer(job_id, limit_s=limit_s, poll_interval=poll_interval)
        )

    def deployments(self) -> list[DeploymentSummary]:
        return self._run(self.aio.deployments())

    def instances(self, deployment: str) -> list[InstanceSummary]:
        return self._run(self.aio.instances(deployment))

    def instance(self, deployment: str, instance: str) -> Instance:
        return self._run(self.aio.instance(deployment, instance))

    def delete_instance(self, deployment: str, instance: str) -> None:
        self._run(self.aio.delete_instance(deployment, instance))

    def rejections(self, limit: int = 100) -> list[Rejection]:
        return self._run(self.aio.rejections(limit))

    def compatibility(self, deployment: str) -> Compatibility:
        return self._run(self.aio.compatibility(deployment))

    def pairs(self, deployment: str, generation: str | None = None) -> wire.Pairs:
        return self._run(self.aio.pairs(deployment, generation))


class SyncEngineLease:
    """An engine lease keeper running on the client's loop; ``stop()`` ends the renewals."""

    def __init__(self, client: KvrouteClient, keeper: EngineLeaseKeeper) -> None:
        self._client = client
        self.keeper = keeper

    def stop(self, *, deregister: bool = False) -> None:
        self._client._run(self.keeper.stop(deregister=deregister))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncLease(SyncEngineLease):
    """A one-rank lease keeper running on the client's loop; ``stop()`` ends the heartbeats."""

    keeper: LeaseKeeper

    def __init__(self, client: KvrouteClient, keeper: LeaseKeeper) -> None:
        super().__init__(client, keeper)

    @property
    def generation(self) -> int | None:
        return self.keeper.generation
