"""Plans served from the registry, cached by the generations they were built from.

A plan is a pure function of its input registrations, and a registration is identified by its
generation, so a cached plan is valid exactly while every rank it was built from still has the
same generation and a live lease. Each request reads those generations (no documents); a hit
answers the cached plan, a miss loads the documents at the generations it saw and plans again.
Replicas of kvroute sharing one database therefore never serve a stale plan.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from cachetools import LRUCache

from kvroute.control.state_reads import StateReads
from kvroute.geometry import GeometryError, Plan, build_plan
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import Conflict
from kvroute.store.registrations import RegistrationCache, RegistrationMoved
from kvroute.store.snapshots import InstanceState


class PlanUnavailable(Conflict):
    """A plan needs every sender rank and the receiver rank live; names the ones that are not."""


class ReceiverNotLive(PlanUnavailable):
    """The receiver rank asking is not live (its lease lapsed, or it never registered): says
    nothing of the sender, so a worker keeps the plan it holds until it registers again."""

    code = "receiver_not_live"


@dataclass(frozen=True, slots=True)
class PlanKey:
    deployment: str
    sender: str
    receiver: str
    receiver_rank: int
    sender_dp_rank: int = 0
    prompt_tokens: int | None = None  # a chunked (prefill CP) sender's plan is per prompt length


@dataclass(frozen=True, slots=True)
class ServedPlan:
    plan: Plan
    sender_generations: Mapping[int, int]
    receiver_generation: int
    document: dict[str, Any]  # the plan document (docs/api.md), generations included
    cached: bool
    build_seconds: float | None  # None for a cache hit


class PlanService:
    """Builds and caches plans; one per process, shared by the plan and transfer endpoints."""

    def __init__(
        self,
        sessionmaker: SessionMaker,
        registrations: RegistrationCache | None = None,
        *,
        cache_size: int = 4096,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.registrations = registrations or RegistrationCache(sessionmaker)
        self._states = StateReads(sessionmaker)
        self._plans: LRUCache[PlanKey, tuple[tuple[object, ...], ServedPlan]] = LRUCache(cache_size)

    async def get(self, key: PlanKey, *, now: datetime) -> ServedPlan:
        states = await self._states.states(key.deployment, [key.sender, key.receiver], now=now)
        sender, receiver = states[key.sender], states[key.receiver]
        _require_live(sender, receiver, key.receiver_rank)
        generations = (tuple(sorted(sender.live.items())), receiver.live[key.receiver_rank])
        # A plan that serves any prompt is cached without the prompt length; only a chunked
        # sender's plan, built for one prompt length, is cached under it.
        general = replace(key, prompt_tokens=None)
        for cache_key in (general, key):
            hit = self._plans.get(cache_key)
            if hit is not None and hit[0] == generations:
                return replace(hit[1], cached=True, build_seconds=None)
        served = await self._build(key, sender, receiver.live[key.receiver_rank])
        self._plans[key if served.plan.prompt_tokens is not None else general] = (
            generations,
            served,
        )
        return served

    async def _build(
        self, key: PlanKey, sender: InstanceState, receiver_generation: int
    ) -> ServedPlan:
        wanted = [(key.sender, rank, gen) for rank, gen in sorted(sender.live.items())]
        wanted.append((key.receiver, key.receiver_rank, receiver_generation))
        try:
            registrations = await self.registrations.at(key.deployment, wanted)
        except RegistrationMoved as moved:
            raise PlanUnavailable(f"{moved} (while its plan was built)") from None
        senders, receiver = registrations[:-1], registrations[-1]
        started = time.perf_counter()
        # Planning is CPU-bound (milliseconds for per-token NHD plans): keep it off the event loop.
        plan = await asyncio.to_thread(
            build_plan,
            senders,
            receiver,
            sender_dp_rank=key.sender_dp_rank,
            prompt_tokens=key.prompt_tokens,
        )
        elapsed = time.perf_counter() - started
        sender_generations = dict(sorted(sender.live.items()))
        document = plan.to_json(
            sender_generations=sender_generations, receiver_generation=receiver_generation
        )
        return ServedPlan(plan, sender_generations, receiver_generation, document, False, elapsed)


def require_complete(side: str, state: InstanceState) -> None:
    """Every rank of the instance is live, or ``PlanUnavailable`` naming the live and the missing."""
    missing = state.missing
    if missing:
        live = ",".join(map(str, sorted(state.live))) or "none"
        raise PlanUnavailable(
            f"{side} instance {state.instance} has ranks {live} of {state.expected_ranks} live "
            f"(missing or expired: {','.join(map(str, missing))})"
        )


def _require_live(sender: InstanceState, receiver: InstanceState, receiver_rank: int) -> None:
    for state, role in ((sender, "context"), (receiver, "generation")):
        if state.role != role:
            side = "sender" if role == "context" else "receiver"
            raise GeometryError(
                "plan_roles_invalid",
                f"{side} instance {state.instance} is a {state.role} instance; a plan moves a context "
                "instance's cache to a generation instance",
                field=side,
                local=state.role,
                peer=role,
                stage="plan",
            )
    require_complete("sender", sender)
    if receiver_rank not in receiver.live:
        status = "expired" if receiver_rank in receiver.expired else "not registered"
        raise ReceiverNotLive(
            f"receiver instance {receiver.instance} rank {receiver_rank} is {status}"
        )
