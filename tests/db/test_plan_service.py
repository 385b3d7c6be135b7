"""The plan service on both databases: plans name their generations and are never stale."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvroute.control.plans import PlanKey, PlanService, PlanUnavailable
from kvroute.geometry import GeometryError
from kvroute.store import registry
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import NotFound
from tests.db.documents import T0, register, registration

KEY = PlanKey("llama", "ctx0", "gen0", 0)


async def _deploy(sm: SessionMaker, *, ctx_tp: int = 4, gen_tp: int = 2, lease: int = 30) -> None:
    for rank in range(ctx_tp):
        reg = registration("llama", "ctx0", rank, tp_size=ctx_tp, lease_seconds=lease)
        await register(sm, reg, now=T0)
    for rank in range(gen_tp):
        reg = registration(
            "llama", "gen0", rank, role="generation", tp_size=gen_tp, lease_seconds=lease
        )
        await register(sm, reg, now=T0)


async def test_plan_names_generations_and_is_cached(sessionmaker: SessionMaker) -> None:
    await _deploy(sessionmaker)
    service = PlanService(sessionmaker)
    first = await service.get(KEY, now=T0)
    assert (first.cached, first.document["expected_writers"]) == (False, 2)
    assert first.document["sender"]["generations"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert first.document["receiver"]["generation"] == 1
    again = await service.get(KEY, now=T0)
    assert again.cached
    assert again.document is first.document


async def test_reregistration_invalidates_and_the_new_plan_names_the_new_generation(
    sessionmaker: SessionMaker,
) -> None:
    await _deploy(sessionmaker)
    service = PlanService(sessionmaker)
    before = await service.get(KEY, now=T0)
    changed = registration("llama", "ctx0", 2, tp_size=4, num_slots=32)  # a changed document
    outcome = await register(sessionmaker, changed, now=T0)
    assert outcome.generation == 2
    after = await service.get(KEY, now=T0)
    assert not after.cached
    assert after.document["sender"]["generations"] == {"0": 1, "1": 1, "2": 2, "3": 1}
    assert after.plan.fingerprint != before.plan.fingerprint  # pool geometry is a plan input


async def test_identical_reregistration_keeps_the_cached_plan(sessionmaker: SessionMaker) -> None:
    await _deploy(sessionmaker)
    service = PlanService(sessionmaker)
    await service.get(KEY, now=T0)
    await register(sessionmaker, registration("llama", "ctx0", 1, tp_size=4), now=T0)
    assert (await service.get(KEY, now=T0)).cached


async def test_expired_sender_rank_is_named(sessionmaker: SessionMaker) -> None:
    await _deploy(sessionmaker, lease=10)
    service = PlanService(sessionmaker)
    await service.get(KEY, now=T0)
    later = T0 + timedelta(seconds=8)
    for rank in (0, 1):
        await registry.heartbeat(sessionmaker, "llama", "ctx0", rank, now=later)
    await registry.heartbeat(sessionmaker, "llama", "gen0", 0, now=later)
    with pytest.raises(
        PlanUnavailable,
        match=r"sender instance ctx0 has ranks 0,1 of 4 live \(missing or expired: 2,3\)",
    ):
        await service.get(KEY, now=T0 + timedelta(seconds=12))


async def test_deleted_or_expired_receiver_and_unknown_instances(
    sessionmaker: SessionMaker,
) -> None:
    await _deploy(sessionmaker)
    service = PlanService(sessionmaker)
    await service.get(KEY, now=T0)
    await registry.delete_rank(sessionmaker, "llama", "gen0", 0)
    with pytest.raises(PlanUnavailable, match="receiver instance gen0 rank 0 is not registered"):
        await service.get(KEY, now=T0)
    with pytest.raises(NotFound):
        await service.get(PlanKey("llama", "ctx9", "gen0", 0), now=T0)


async def test_roles_must_run_context_to_generation(sessionmaker: SessionMaker) -> None:
    await _deploy(sessionmaker)
    with pytest.raises(GeometryError) as refused:
        await PlanService(sessionmaker).get(PlanKey("llama", "gen0", "ctx0", 0), now=T0)
    assert refused.value.code == "plan_roles_invalid"


async def test_two_services_sharing_a_database_never_serve_a_stale_plan(
    sessionmaker: SessionMaker,
) -> None:
    await _deploy(sessionmaker)
    replica_a, replica_b = PlanService(sessionmaker), PlanService(sessionmaker)
    await replica_a.get(KEY, now=T0)
    await register(
        sessionmaker,
        registration("llama", "gen0", 0, role="generation", tp_size=2, num_slots=8),
        now=T0,
    )
    assert (await replica_b.get(KEY, now=T0)).receiver_generation == 2
    served = await replica_a.get(KEY, now=T0)
    assert (served.cached, served.receiver_generation) == (False, 2)
