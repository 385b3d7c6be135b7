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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvroute.geometry import GeometryError, Plan, RankRegistration, build_plan
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import Conflict
from kvroute.store.snapshots import InstanceState, instance_states, rank_documents


class PlanUnavailable(Conflict):
    """A plan needs every sender rank and the receiver rank live; names the ones that are not."""


@dataclass(frozen=True, slots=True)
class PlanKey:
    deployment: str
    sender: str
    receiver: str
    receiver_rank: int
    sender_dp_rank: int = 0


@dataclass(frozen=True, slots=True)
class ServedPlan:
    plan: Plan
    sender_generations: Mapping[int, int]
    receiver_generation: int
    document: dict[str, Any]  # the API.md plan document, generations included
    cached: bool
    build_seconds: float | None  # None for a cache hit


class PlanService:
    """Builds and caches plans; one per process, shared by the plan and transfer endpoints."""

    def __init__(self, sessionmaker: SessionMaker, *, cache_size: int = 4096) -> None:
        self._sessionmaker = sessionmaker
        self._plans: OrderedDict[PlanKey, tuple[tuple[object, ...], ServedPlan]] = OrderedDict()
        self._registrations: OrderedDict[tuple[str, str, int, int], RankRegistration] = (
            OrderedDict()
        )
        self._cache_size = cache_size

    async def get(self, key: PlanKey, *, now: datetime) -> ServedPlan:
        states = await instance_states(
            self._sessionmaker, key.deployment, [key.sender, key.receiver], now=now
        )
        sender, receiver = states[key.sender], states[key.receiver]
        _require_live(sender, receiver, key.receiver_rank)
        generations = (tuple(sorted(sender.live.items())), receiver.live[key.receiver_rank])
        hit = self._plans.get(key)
        if hit is not None and hit[0] == generations:
            self._plans.move_to_end(key)
            served = hit[1]
            return ServedPlan(
                served.plan,
                served.sender_generations,
                served.receiver_generation,
                served.document,
                True,
                None,
            )
        served = await self._build(key, sender, receiver.live[key.receiver_rank])
        self._remember(self._plans, key, (generations, served))
        return served

    async def _build(
        self, key: PlanKey, sender: InstanceState, receiver_generation: int
    ) -> ServedPlan:
        wanted = [(key.sender, rank, gen) for rank, gen in sorted(sender.live.items())]
        wanted.append((key.receiver, key.receiver_rank, receiver_generation))
        registrations = await self._registrations_at(key.deployment, wanted)
        senders, receiver = registrations[:-1], registrations[-1]
        started = time.perf_counter()
        # Planning is CPU-bound (milliseconds for per-token NHD plans): keep it off the event loop.
        plan = await asyncio.to_thread(
            build_plan, senders, receiver, sender_dp_rank=key.sender_dp_rank
        )
        elapsed = time.perf_counter() - started
        sender_generations = dict(sorted(sender.live.items()))
        document = plan.to_json(
            sender_generations=sender_generations, receiver_generation=receiver_generation
        )
        return ServedPlan(plan, sender_generations, receiver_generation, document, False, elapsed)

    async def _registrations_at(
        self, deployment: str, wanted: list[tuple[str, int, int]]
    ) -> list[RankRegistration]:
        """Parsed registrations at exactly these generations; uncached documents in one read."""
        found = {w: self._registrations.get((deployment, *w)) for w in wanted}
        missing = [w for w, reg in found.items() if reg is None]
        documents = await rank_documents(self._sessionmaker, deployment, missing)
        for instance, rank, generation in missing:
            document = documents.get((instance, rank))
            if document is None:
                raise PlanUnavailable(
                    f"{instance} rank {rank} re-registered or left while its plan was built; retry"
                )
            reg = RankRegistration.from_json(
                document, deployment=deployment, instance=instance, rank=rank
            )
            found[(instance, rank, generation)] = reg
            self._remember(self._registrations, (deployment, instance, rank, generation), reg)
        return [reg for reg in found.values() if reg is not None]

    def _remember(self, cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._cache_size:
            cache.popitem(last=False)


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
    missing = sorted(set(range(sender.expected_ranks)) - set(sender.live))
    if missing:
        live = ",".join(map(str, sorted(sender.live))) or "none"
        raise PlanUnavailable(
            f"sender instance {sender.instance} has ranks {live} of {sender.expected_ranks} live "
            f"(missing or expired: {','.join(map(str, missing))})"
        )
    if receiver_rank not in receiver.live:
        state = "expired" if receiver_rank in receiver.expired else "not registered"
        raise PlanUnavailable(
            f"receiver instance {receiver.instance} rank {receiver_rank} is {state}"
        )
