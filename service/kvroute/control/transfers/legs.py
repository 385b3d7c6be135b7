"""Leg resolution: one receiver rank of a transfer request -> its plan and its opened pool memory.

A leg's plan comes from the registry (``PlanService``), so a job never runs a plan of a rank that
re-registered; its pools come from the registrations at exactly the generations the plan was built
from (the shared ``RegistrationCache``). Everything a request can get wrong (block ids outside a pool, a pool this process cannot
open) is refused here, before a job row exists or anything is queued.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from cachetools import LRUCache

from kvroute import wire
from kvroute.control.plans import PlanKey, PlanService, PlanUnavailable, ServedPlan
from kvroute.geometry import Pool
from kvroute.store.registrations import RankAt, RegistrationMoved
from kvroute.transfer.errors import PoolMemoryError, TransferValidationError
from kvroute.transfer.jobs import TransferLeg
from kvroute.transfer.memory import PoolMemory
from kvroute.transfer.opened import PoolMemoryCache, PoolOwner
from kvroute.transfer.plan import CopyPlan

_BlockTarget = tuple[str, tuple[int, ...], str, int, Pool]  # list name, ids, instance, rank, pool
COPY_PLAN_CACHE_SIZE = 1024  # compiled plans are immutable, keyed by fingerprint
BLOCK_LISTS = ("src_blocks", "dst_blocks")


@dataclass(frozen=True, slots=True)
class Leg:
    """One receiver rank's plan with the pools of its rank documents (memory not yet opened)."""

    copy_plan: CopyPlan
    receiver_rank: int
    sender_pools: dict[tuple[int, int], Pool]  # (sender rank, pool id)
    receiver_pools: dict[int, Pool]
    sender_generations: Mapping[int, int]  # the generations the plan was built from
    receiver_generation: int


class LegResolver:
    """Turns requests into checked legs; caches compiled plans and rank pools per generation."""

    def __init__(self, plans: PlanService, memories: PoolMemoryCache) -> None:
        self._plans = plans
        self._memories = memories
        self._copy_plans: LRUCache[str, CopyPlan] = LRUCache(COPY_PLAN_CACHE_SIZE)

    async def legs(
        self, deployment: str, request: wire.TransferRequest, *, now: datetime
    ) -> list[Leg]:
        """Every receiver rank's leg, each block id checked against the pools it addresses."""
        legs = [await self._leg(deployment, request, rank, now) for rank in request.receiver_ranks]
        for leg in legs:
            _check_blocks(request, leg)
        return legs

    def open(
        self, deployment: str, request: wire.TransferRequest, legs: Iterable[Leg]
    ) -> list[TransferLeg]:
        """Maps every pool a job touches (blocking: a backend may map memory or a device).

        Each pool is one use of the shared cache until ``release(job_memories(...))``; a pool
        that cannot be opened releases the ones opened before it."""
        opened: list[PoolMemory] = []
        legs_opened = []
        try:
            for leg in legs:
                src, dst = {}, {}
                for rank, pool_id in sending_pools(leg.copy_plan):
                    at = (request.sender, rank, leg.sender_generations[rank])
                    pool = leg.sender_pools[rank, pool_id]
                    src[rank, pool_id] = self._open(deployment, pool, at)
                    opened.append(src[rank, pool_id])
                for pool_id in receiving_pools(leg.copy_plan):
                    at = (request.receiver, leg.receiver_rank, leg.receiver_generation)
                    dst[pool_id] = self._open(deployment, leg.receiver_pools[pool_id], at)
                    opened.append(dst[pool_id])
                legs_opened.append(TransferLeg(leg.copy_plan, src, dst))
        except BaseException:
            self._memories.release(opened)
            raise
        return legs_opened

    async def _leg(
        self, deployment: str, request: wire.TransferRequest, receiver_rank: int, now: datetime
    ) -> Leg:
        key = PlanKey(
            deployment,
            request.sender,
            request.receiver,
            receiver_rank,
            request.sender_dp_rank,
            request.prompt_tokens,
        )
        served = await self._plans.get(key, now=now)
        copy_plan = self._copy_plan(served)
        senders = {rank for rank, _ in sending_pools(copy_plan)}
        wanted = [(request.sender, rank, served.sender_generations[rank]) for rank in senders]
        wanted.append((request.receiver, receiver_rank, served.receiver_generation))
        pools = await self._pools(deployment, wanted)
        return Leg(
            copy_plan,
            receiver_rank,
            {
                (rank, pool.pool_id): pool
                for rank in senders
                for pool in pools[request.sender, rank]
            },
            {pool.pool_id: pool for pool in pools[request.receiver, receiver_rank]},
            {rank: served.sender_generations[rank] for rank in senders},
            served.receiver_generation,
        )

    def _copy_plan(self, served: ServedPlan) -> CopyPlan:
        fingerprint = served.plan.fingerprint
        copy_plan = self._copy_plans.get(fingerprint)
        if copy_plan is None:
            copy_plan = CopyPlan.from_plan(served.plan)
            self._copy_plans[fingerprint] = copy_plan
        return copy_plan

    async def _pools(
        self, deployment: str, wanted: Sequence[RankAt]
    ) -> dict[tuple[str, int], tuple[Pool, ...]]:
        """Each rank's pools at the generation its plan was built from."""
        try:
            registrations = await self._plans.registrations.at(deployment, wanted)
        except RegistrationMoved as moved:
            raise PlanUnavailable(f"{moved} (while the job was checked)") from None
        return {(reg.instance, reg.rank): reg.pools for reg in registrations}

    def _open(self, deployment: str, pool: Pool, at: RankAt) -> PoolMemory:
        instance, rank, generation = at
        owner = PoolOwner(deployment, instance, rank, generation)
        try:
            return self._memories.open_pool(pool.memory, pool, owner)
        except PoolMemoryError as error:
            raise error.of_rank(instance, rank) from error


def job_memories(legs: Iterable[TransferLeg]) -> list[PoolMemory]:
    """Every pool use of a job's legs, as ``LegResolver.open`` took them (one per leg and pool)."""
    return [memory for leg in legs for memory in (*leg.src_pools.values(), *leg.dst_pools.values())]


def sending_pools(plan: CopyPlan, *, state: bool | None = None) -> list[tuple[int, int]]:
    """(sender rank, pool) of every copy; ``state`` True/False keeps state/block views only."""
    return sorted(
        {
            (peer.rank, view.src_pool)
            for peer in plan.senders
            for view in peer.copies
            if state is None or view.state is state
        }
    )


def receiving_pools(plan: CopyPlan, *, state: bool | None = None) -> list[int]:
    return sorted(
        {
            view.dst_pool
            for peer in plan.senders
            for view in peer.copies
            if state is None or view.state is state
        }
    )


def _block_targets(request: wire.TransferRequest, leg: Leg) -> Iterator[_BlockTarget]:
    """Block lists against block-view pools, the state slots against state-view pools. Block ids
    outside a view's window are checked too: a list names slots of the request either way."""
    plan = leg.copy_plan
    src_state = () if request.src_state_slot is None else (request.src_state_slot,)
    dst_state = () if request.dst_state_slot is None else (request.dst_state_slot,)
    for state, src_ids, dst_ids in (
        (False, request.src_blocks, request.dst_blocks),
        (True, src_state, dst_state),
    ):
        src_name, dst_name = ("src_state_slot", "dst_state_slot") if state else BLOCK_LISTS
        for rank, pool_id in sending_pools(plan, state=state):
            pool = leg.sender_pools[rank, pool_id]
            yield src_name, src_ids, request.sender, rank, pool
        for pool_id in receiving_pools(plan, state=state):
            pool = leg.receiver_pools[pool_id]
            yield dst_name, dst_ids, request.receiver, leg.receiver_rank, pool


def _check_blocks(request: wire.TransferRequest, leg: Leg) -> None:
    """Every block id and state slot within every pool it addresses; names the id, the pool and
    its rank. A plan that moves state needs the state slots (the engine says so by name)."""
    for name, blocks, instance, rank, pool in _block_targets(request, leg):
        if not blocks or (min(blocks) >= 0 and max(blocks) < pool.num_slots):
            continue
        index = next(i for i, block in enumerate(blocks) if not 0 <= block < pool.num_slots)
        field, what = (f"{name}[{index}]", "block id") if name in BLOCK_LISTS else (name, "slot")
        raise TransferValidationError(
            field,
            f"{what} {blocks[index]} is outside pool {pool.pool_id} of {instance} rank {rank} "
            f"(num_slots {pool.num_slots})",
        )
