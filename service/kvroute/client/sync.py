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

from kvroute.client.aio import DEFAULT_TIMEOUT_S, AsyncKvrouteClient
from kvroute.client.lease import LeaseKeeper
from kvroute.client.models import (
    Compatibility,
    DeploymentSummary,
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
        self, deployment: str, instance: str, rank: int, document: Mapping[str, Any]
    ) -> Registered:
        return self._run(self.aio.register(deployment, instance, rank, document))

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
    ) -> SyncLease:
        """Registers and heartbeats in the background until ``stop()`` (or the ``with`` block ends)."""
        keeper = LeaseKeeper(self.aio, deployment, instance, rank, document, interval=interval)

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
    ) -> PlanDocument:
        return self._run(
            self.aio.get_plan(
                deployment,
                sender=sender,
                receiver=receiver,
                receiver_rank=receiver_rank,
                sender_dp_rank=sender_dp_rank,
                period=period,
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
    ) -> list[PlanDocument]:
        return self._run(
            self.aio.get_plans(
                deployment,
                sender=sender,
                receiver=receiver,
                sender_dp_rank=sender_dp_rank,
                period=period,
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


class SyncLease:
    """A lease keeper running on the client's loop; ``stop()`` ends the heartbeats."""

    def __init__(self, client: KvrouteClient, keeper: LeaseKeeper) -> None:
        self._client = client
        self.keeper = keeper

    @property
    def generation(self) -> int | None:
        return self.keeper.generation

    def stop(self, *, deregister: bool = False) -> None:
        self._client._run(self.keeper.stop(deregister=deregister))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
