"""The async kvroute client a worker imports: registration, leases, plans, transfers, admin reads.

Every call goes through ``ServiceCalls._call`` (``client.http``): one session, bearer token,
per-request timeout, bounded retries, and every non-2xx answer raised as one ``KvrouteError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvroute import wire
from kvroute.client.errors import KvrouteError
from kvroute.client.http import segment as _seg
from kvroute.client.integrity_calls import KvIntegrityCalls
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
from kvroute.geometry import RequestBlocks


def rank_path(deployment: str, instance: str, rank: int) -> str:
    return f"/v1/deployments/{_seg(deployment)}/instances/{_seg(instance)}/ranks/{_seg(rank)}"


def lease_path(deployment: str, lease_id: str | None = None) -> str:
    base = f"/v1/deployments/{_seg(deployment)}/leases"
    return base if lease_id is None else f"{base}/{_seg(lease_id)}"


class AsyncKvrouteClient(KvIntegrityCalls):
    """Talks to one kvroute service; use as ``async with AsyncKvrouteClient(url) as client``."""

    # Registration and leases (worker token).

    async def register(
        self,
        deployment: str,
        instance: str,
        rank: int,
        document: Mapping[str, Any],
        *,
        engine_lease: str | None = None,
    ) -> Registered:
        """Registers the rank, kept by ``engine_lease`` when given (else by its own lease)."""
        params = {"engine_lease": engine_lease} if engine_lease else None
        status, body = await self._call(
            "PUT", rank_path(deployment, instance, rank), body=document, params=params
        )
        return Registered.from_json(body, created=status == 201)

    async def grant_lease(self, deployment: str, lease_seconds: int) -> EngineLease:
        """A new engine lease; register ranks with ``engine_lease=lease.lease_id``."""
        _, body = await self._call(
            "POST", lease_path(deployment), body={"lease_seconds": lease_seconds}, retry_sent=False
        )
        return wire.from_json(EngineLease, body)

    async def renew_lease(self, deployment: str, lease_id: str) -> EngineLease:
        """Renews the lease and its live ranks (``ranks``: those renewed); 404: grant a new one."""
        _, body = await self._call(
            "POST", lease_path(deployment, lease_id) + "/heartbeat", retry_sent=True
        )
        return wire.from_json(EngineLease, body)

    async def get_lease(self, deployment: str, lease_id: str) -> EngineLease:
        _, body = await self._call("GET", lease_path(deployment, lease_id))
        return wire.from_json(EngineLease, body)

    async def revoke_lease(self, deployment: str, lease_id: str) -> None:
        """Removes the lease and every rank it keeps (admin token)."""
        await self._call("DELETE", lease_path(deployment, lease_id))

    async def heartbeat(self, deployment: str, instance: str, rank: int) -> Lease:
        """Renews the lease; a 404 means kvroute no longer knows the rank: register again."""
        path = rank_path(deployment, instance, rank) + "/heartbeat"
        # Renewing twice is harmless, so a heartbeat lost in flight is resent.
        _, body = await self._call("POST", path, retry_sent=True)
        return wire.from_json(Lease, body)

    async def get_rank(self, deployment: str, instance: str, rank: int) -> RankInfo:
        _, body = await self._call("GET", rank_path(deployment, instance, rank))
        return wire.from_json(RankInfo, body)

    async def deregister(self, deployment: str, instance: str, rank: int) -> None:
        await self._call("DELETE", rank_path(deployment, instance, rank))

    # Plans and transfers (worker token).

    def keep_lease(
        self,
        deployment: str,
        instance: str,
        rank: int,
        document: Mapping[str, Any],
        *,
        interval: float | None = None,
        per_rank: bool = False,
    ) -> LeaseKeeper:
        """``async with client.keep_lease(...)``: registers, then renews until the block ends (an
        engine lease of the rank's own unless ``per_rank``)."""
        return LeaseKeeper(
            self, deployment, instance, rank, document, interval=interval, per_rank=per_rank
        )

    def keep_engine_lease(
        self,
        deployment: str,
        documents: Mapping[tuple[str, int], Mapping[str, Any]],
        *,
        interval: float | None = None,
    ) -> EngineLeaseKeeper:
        """``async with client.keep_engine_lease("llama", {("ctx0", 0): doc, ...})``: one engine
        lease for all the ranks, registered with it, renewed until the block ends."""
        return EngineLeaseKeeper(self, deployment, documents, interval=interval)

    async def get_plan(
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
        """One receiver rank's plan; ``period`` asks for every view pair's period form, from
        which any token range can be cut (``client.nixl_descs``), but for pairs without whole
        token rows, which keep their block form (``ViewTransfer.token_rows`` False);
        ``prompt_tokens`` is the prompt length a sender holding prefill CP chunks is planned for."""
        params = _plan_params(sender, receiver, sender_dp_rank, period, prompt_tokens)
        params["receiver_rank"] = receiver_rank
        _, body = await self._call(
            "GET", f"/v1/deployments/{_seg(deployment)}/plans", params=params
        )
        return PlanDocument.from_json(body)

    async def get_plans(
        self,
        deployment: str,
        *,
        sender: str,
        receiver: str,
        sender_dp_rank: int | None = None,
        period: bool = False,
        prompt_tokens: int | None = None,
    ) -> list[PlanDocument]:
        """Every rank's plan of a receiver instance in one answer, ordered by rank (``plan-sets``)."""
        params = _plan_params(sender, receiver, sender_dp_rank, period, prompt_tokens)
        path = f"/v1/deployments/{_seg(deployment)}/plan-sets"
        _, body = await self._call("GET", path, params=params)
        return [PlanDocument.from_json(plan) for plan in body["plans"]]

    async def submit_transfer(
        self,
        deployment: str,
        *,
        sender: str,
        receiver: str,
        receiver_ranks: Sequence[int],
        blocks: RequestBlocks,
    ) -> TransferStatus:
        """Queue a copy of one request. Without a window ``blocks.src[i]`` goes to
        ``blocks.dst[i]``; with one naming a range each list holds a run of the prompt and the
        tokens [start, end) move (a side's first token defaults to upstream's suffix rule). A gap
        answers 422 ``token_range_not_covered`` (``KvrouteError.problem`` names the token and the
        list). Hybrid models add the request's recurrent-state slot on both sides, and sliding
        windows the prompt's length (``TokenWindow.prompt_tokens``, default: the range's end)."""
        window = blocks.window
        tokens = window.tokens
        request = wire.TransferRequest(
            sender=sender,
            receiver=receiver,
            receiver_ranks=tuple(receiver_ranks),
            src_blocks=tuple(blocks.src),
            dst_blocks=tuple(blocks.dst),
            tokens=None if tokens is None else wire.TokenRange(tokens.start, tokens.end),
            src_first_token=window.src_first_token,
            dst_first_token=window.dst_first_token,
            src_state_slot=blocks.src_state_slot,
            dst_state_slot=blocks.dst_state_slot,
            prompt_tokens=window.prompt_tokens,
        )
        path = f"/v1/deployments/{_seg(deployment)}/transfers"
        _, body = await self._call("POST", path, body=wire.to_json(request))
        return wire.from_json(TransferStatus, body)

    async def get_transfer(self, job_id: str) -> TransferStatus:
        _, body = await self._call("GET", f"/v1/transfers/{_seg(job_id)}")
        return wire.from_json(TransferStatus, body)

    async def cancel_transfer(self, job_id: str) -> TransferStatus | None:
        """Cancels a queued job; the job's last state when the service reports one."""
        _, body = await self._call("DELETE", f"/v1/transfers/{_seg(job_id)}")
        return (
            wire.from_json(TransferStatus, body)
            if isinstance(body, Mapping) and "id" in body
            else None
        )

    async def wait_transfer(
        self, job_id: str, *, limit_s: float = 60.0, poll_interval: float = 0.02
    ) -> TransferStatus:
        """Polls until the job is finished; raises ``KvrouteError`` (code ``wait_timeout``) after ``limit_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        interval = poll_interval
        while True:
            status = await self.get_transfer(job_id)
            if status.finished:
                return status
            if loop.time() + interval > deadline:
                raise KvrouteError.unreachable(
                    "wait_timeout", f"transfer {job_id} still {status.state} after {limit_s} s"
                )
            await asyncio.sleep(interval)
            interval = min(interval * 2, 0.5)  # short jobs answer fast; long ones are not hammered

    # Admin reads (admin token).

    async def deployments(self) -> list[DeploymentSummary]:
        _, body = await self._call("GET", "/v1/deployments")
        return [wire.from_json(DeploymentSummary, item) for item in body["deployments"]]

    async def instances(self, deployment: str) -> list[InstanceSummary]:
        _, body = await self._call("GET", f"/v1/deployments/{_seg(deployment)}/instances")
        return [wire.from_json(InstanceSummary, item) for item in body["instances"]]

    async def instance(self, deployment: str, instance: str) -> Instance:
        _, body = await self._call(
            "GET", f"/v1/deployments/{_seg(deployment)}/instances/{_seg(instance)}"
        )
        return wire.from_json(Instance, body)

    async def delete_instance(self, deployment: str, instance: str) -> None:
        await self._call("DELETE", f"/v1/deployments/{_seg(deployment)}/instances/{_seg(instance)}")

    async def rejections(self, limit: int = 100) -> list[Rejection]:
        _, body = await self._call("GET", "/v1/rejections", params={"limit": limit})
        return [wire.from_json(Rejection, item) for item in body["rejections"]]

    async def compatibility(self, deployment: str) -> Compatibility:
        """The context x generation matrix with the first refusal of each incompatible pair."""
        _, body = await self._call("GET", f"/v1/deployments/{_seg(deployment)}/compatibility")
        return wire.from_json(Compatibility, body)

    async def pairs(self, deployment: str, generation: str | None = None) -> wire.Pairs:
        """Per generation instance (or ``generation`` alone), the context instances it may pair
        with, best first, and why each other one may not (routers)."""
        params = {"generation": generation} if generation is not None else None
        path = f"/v1/deployments/{_seg(deployment)}/pairs"
        _, body = await self._call("GET", path, params=params)
        return wire.from_json(wire.Pairs, body)


def _plan_params(
    sender: str, receiver: str, sender_dp_rank: int | None, period: bool, prompt_tokens: int | None
) -> dict[str, str | int]:
    """The query a plan and a plan set share."""
    params: dict[str, str | int] = {"sender": sender, "receiver": receiver}
    if sender_dp_rank is not None:
        params["sender_dp_rank"] = sender_dp_rank
    if prompt_tokens is not None:
        params["prompt_tokens"] = prompt_tokens
    if period:
        params["fragments"] = "period"
    return params
