"""The registration service on both databases: generations, refusals, leases, listings."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvroute.geometry import GeometryError
from kvroute.store import registrations, registry, snapshots
from kvroute.store.engine import SessionMaker
from kvroute.store.errors import LeaseExpired, NotFound
from kvroute.store.models import PoolRow, ViewRow
from kvroute.store.registrations import RankClass, RegistrationCache, RegistrationMoved
from tests.db.conftest import dump_tables
from tests.db.documents import T0, register, registration

SHM = {"backend": "shm", "name": "kvroute-ctx0-r0-p0", "offset": 0}
INCOMPATIBLE_HEAD_DIM = {"role": "generation", "head_dim": 64}


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


async def register_context(
    sessionmaker: SessionMaker, tp_size: int = 2, **document: object
) -> None:
    for rank in range(tp_size):
        await register(
            sessionmaker, registration("llama", "ctx0", rank, tp_size=tp_size, **document), now=T0
        )


async def test_generation_is_kept_for_identical_and_bumped_for_changed_documents(
    sessionmaker: SessionMaker,
) -> None:
    first = registration("llama", "ctx0", 0, memory=SHM)
    created = await register(sessionmaker, first, now=T0)
    assert (created.generation, created.created) == (1, True)
    assert created.lease_expires_at == T0 + seconds(30)

    renewed = await register(sessionmaker, first, now=T0 + seconds(10))
    assert (renewed.generation, renewed.created) == (1, False)
    assert renewed.lease_expires_at == T0 + seconds(40)

    moved = registration("llama", "ctx0", 0, memory={**SHM, "name": "kvroute-restarted"})
    changed = await register(sessionmaker, moved, now=T0 + seconds(20))
    assert (changed.generation, changed.created) == (2, False)

    stored = await registry.get_rank(sessionmaker, "llama", "ctx0", 0, now=T0 + seconds(20))
    assert stored.generation == 2
    assert stored.document == moved.to_json()
    assert stored.state == "live"


async def test_generations_are_never_reused_after_delete(sessionmaker: SessionMaker) -> None:
    await register(sessionmaker, registration("llama", "ctx0", 0), now=T0)
    await register(sessionmaker, registration("llama", "ctx0", 0, memory=SHM), now=T0)
    await registry.delete_rank(sessionmaker, "llama", "ctx0", 0)
    with pytest.raises(NotFound):
        await registry.get_rank(sessionmaker, "llama", "ctx0", 0, now=T0)

    again = await register(sessionmaker, registration("llama", "ctx0", 0), now=T0)
    assert (again.generation, again.created) == (3, True)


async def test_refused_peer_changes_no_row_and_is_logged(
    sessionmaker: SessionMaker, engine: AsyncEngine
) -> None:
    await register_context(sessionmaker)
    before = await dump_tables(engine)

    with pytest.raises(GeometryError) as refused:
        await register(
            sessionmaker, registration("llama", "gen0", 0, **INCOMPATIBLE_HEAD_DIM), now=T0
        )

    assert (refused.value.stage, refused.value.code) == ("peer", "head_dim_mismatch")
    after = await dump_tables(engine)
    assert after.pop("rejections") != before.pop("rejections")
    assert after == before
    [logged] = await registry.list_rejections(sessionmaker)
    assert (logged.deployment, logged.instance, logged.rank) == ("llama", "gen0", 0)
    assert (logged.code, logged.stage, logged.field) == (
        "head_dim_mismatch",
        "peer",
        refused.value.field,
    )
    assert logged.problem == refused.value.to_problem()


async def test_refused_first_registration_creates_no_deployment_or_instance(
    sessionmaker: SessionMaker, engine: AsyncEngine
) -> None:
    before = await dump_tables(engine)
    # Rank 1 of a TP1 instance cannot exist: refused by the instance checks.
    with pytest.raises(GeometryError, match="rank"):
        await register(sessionmaker, registration("fresh", "ctx0", 1, tp_rank=0), now=T0)

    after = await dump_tables(engine)
    assert len(after.pop("rejections")) == 1
    before.pop("rejections")
    assert after == before
    assert await registry.list_deployments(sessionmaker, now=T0) == []


async def test_refused_re_registration_keeps_the_admitted_document(
    sessionmaker: SessionMaker, engine: AsyncEngine
) -> None:
    await register_context(sessionmaker)
    before = await dump_tables(engine)

    with pytest.raises(GeometryError) as refused:
        await register(
            sessionmaker, registration("llama", "ctx0", 1, tp_size=2, head_dim=64), now=T0
        )

    assert refused.value.stage == "instance"
    after = await dump_tables(engine)
    del after["rejections"], before["rejections"]
    assert after == before


async def test_expired_ranks_are_not_peers(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker, lease_seconds=10)
    incompatible = registration("llama", "gen0", 0, **INCOMPATIBLE_HEAD_DIM)

    with pytest.raises(GeometryError):
        await register(sessionmaker, incompatible, now=T0 + seconds(9))
    admitted = await register(sessionmaker, incompatible, now=T0 + seconds(10))

    assert admitted.created
    context = await registry.get_instance(sessionmaker, "llama", "ctx0", now=T0 + seconds(10))
    assert [rank.state for rank in context.ranks] == ["expired", "expired"]


async def test_expired_instance_ranks_do_not_pin_the_layout(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker, tp_size=2, lease_seconds=10)
    later = T0 + seconds(11)

    await register(sessionmaker, registration("llama", "ctx0", 0, tp_size=4), now=later)

    instance = await registry.get_instance(sessionmaker, "llama", "ctx0", now=later)
    assert instance.tp_size == 4
    assert (instance.live_ranks, instance.expired_ranks) == (1, 1)


async def test_heartbeat_renews_a_live_lease(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker, lease_seconds=10)

    expires = await registry.heartbeat(sessionmaker, "llama", "ctx0", 1, now=T0 + seconds(9))

    assert expires == T0 + seconds(19)
    ranks = await registry.get_instance(sessionmaker, "llama", "ctx0", now=T0 + seconds(15))
    assert [rank.state for rank in ranks.ranks] == ["expired", "live"]


async def test_heartbeat_refuses_unknown_and_expired_ranks(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker, lease_seconds=10)

    with pytest.raises(NotFound):
        await registry.heartbeat(sessionmaker, "llama", "ctx0", 7, now=T0)
    with pytest.raises(NotFound):
        await registry.heartbeat(sessionmaker, "other", "ctx0", 0, now=T0)
    with pytest.raises(LeaseExpired, match="register the rank again"):
        await registry.heartbeat(sessionmaker, "llama", "ctx0", 0, now=T0 + seconds(10))


async def test_late_heartbeat_cannot_revive_a_rank_that_was_not_a_peer(
    sessionmaker: SessionMaker,
) -> None:
    await register_context(sessionmaker, lease_seconds=10)
    await register(
        sessionmaker,
        registration("llama", "gen0", 0, **INCOMPATIBLE_HEAD_DIM),
        now=T0 + seconds(11),
    )

    # Stamped before the expiry, processed after the admission that no longer saw ctx0.
    with pytest.raises(LeaseExpired):
        await registry.heartbeat(sessionmaker, "llama", "ctx0", 0, now=T0 + seconds(9))


async def test_reaper_removes_ranks_only_after_the_grace_period(
    sessionmaker: SessionMaker, engine: AsyncEngine
) -> None:
    await register_context(sessionmaker, lease_seconds=10, memory=SHM)
    grace = seconds(5)

    assert await registry.reap_expired(sessionmaker, now=T0 + seconds(15), grace=grace) == []
    reaped = await registry.reap_expired(sessionmaker, now=T0 + seconds(16), grace=grace)
    assert [str(name) for name in reaped] == ["llama/ctx0 rank 0", "llama/ctx0 rank 1"]

    with pytest.raises(NotFound):
        await registry.get_instance(sessionmaker, "llama", "ctx0", now=T0)
    tables = await dump_tables(engine)
    assert tables["ranks"] == tables["pools"] == tables["views"] == tables["instances"] == []
    again = await register(
        sessionmaker, registration("llama", "ctx0", 0, tp_size=2), now=T0 + seconds(20)
    )
    assert (again.generation, again.created) == (2, True)


async def test_rejection_log_keeps_only_the_newest_entries(sessionmaker: SessionMaker) -> None:
    for rank in range(1, 6):  # every rank > 0 of a TP1 instance is refused
        with pytest.raises(GeometryError):
            await register(
                sessionmaker,
                registration("llama", "ctx0", rank, tp_rank=0),
                now=T0 + seconds(rank),
                rejection_log_size=3,
            )

    logged = await registry.list_rejections(sessionmaker)
    assert [entry.rank for entry in logged] == [5, 4, 3]
    assert [entry.at for entry in logged] == [T0 + seconds(r) for r in (5, 4, 3)]
    assert [entry.rank for entry in await registry.list_rejections(sessionmaker, 2)] == [5, 4]


async def test_listings_report_roles_layouts_and_lease_states(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker, tp_size=2, lease_seconds=10)
    await register(
        sessionmaker, registration("llama", "gen0", 0, role="generation"), now=T0 + seconds(5)
    )
    now = T0 + seconds(12)

    [deployment] = await registry.list_deployments(sessionmaker, now=now)
    assert (deployment.name, deployment.instances) == ("llama", 2)
    assert (deployment.live_ranks, deployment.expired_ranks) == (1, 2)

    detail = await registry.get_deployment(sessionmaker, "llama", now=now)
    assert [(i.name, i.role, i.tp_size) for i in detail.instances] == [
        ("ctx0", "context", 2),
        ("gen0", "generation", 1),
    ]
    assert (detail.live_ranks, detail.expired_ranks) == (1, 2)
    assert await registry.list_instances(sessionmaker, "llama", now=now) == list(detail.instances)

    generation = await registry.get_instance(sessionmaker, "llama", "gen0", now=now)
    assert [(r.rank, r.generation, r.state) for r in generation.ranks] == [(0, 1, "live")]
    assert await registry.count_live_ranks(sessionmaker, now=now) == 1
    assert await registry.count_live_ranks(sessionmaker, now=T0) == 3


async def test_unknown_names_raise_not_found(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker)
    missing: list[Callable[[], Awaitable[object]]] = [
        lambda: registry.get_deployment(sessionmaker, "nope", now=T0),
        lambda: registry.list_instances(sessionmaker, "nope", now=T0),
        lambda: registry.get_instance(sessionmaker, "llama", "nope", now=T0),
        lambda: registry.get_rank(sessionmaker, "llama", "ctx0", 9, now=T0),
        lambda: snapshots.instance_state(sessionmaker, "llama", "nope", now=T0),
        lambda: registry.delete_rank(sessionmaker, "llama", "ctx0", 9),
        lambda: registry.delete_instance(sessionmaker, "llama", "nope"),
    ]
    for call in missing:
        with pytest.raises(NotFound):
            await call()


async def test_live_ranks_feed_plans_in_rank_order(sessionmaker: SessionMaker) -> None:
    await register_context(sessionmaker, tp_size=2, lease_seconds=10)
    await registry.heartbeat(sessionmaker, "llama", "ctx0", 1, now=T0 + seconds(5))

    state = await snapshots.instance_state(sessionmaker, "llama", "ctx0", now=T0)
    assert list(state.live.items()) == [(0, 1), (1, 1)]
    wanted = [("ctx0", rank, generation) for rank, generation in state.live.items()]
    live = await RegistrationCache(sessionmaker).at("llama", wanted)
    assert live[1] == registration("llama", "ctx0", 1, tp_size=2, lease_seconds=10)
    later = await snapshots.instance_state(sessionmaker, "llama", "ctx0", now=T0 + seconds(12))
    assert list(later.live) == [1]


@pytest.mark.parametrize("read_chunk", [1, 512], ids=["scanning the deployment", "by keys"])
async def test_ranks_are_read_at_exactly_their_generations(
    sessionmaker: SessionMaker, monkeypatch: pytest.MonkeyPatch, read_chunk: int
) -> None:
    """More keys than ``READ_CHUNK`` are matched against a scan of the deployment, fewer by an IN
    list: the same answer either way, another deployment's ranks and other generations left out."""
    monkeypatch.setattr(registrations, "READ_CHUNK", read_chunk)
    await register_context(sessionmaker, tp_size=2)
    await register(sessionmaker, registration("mistral", "ctx0", 0, tp_size=2), now=T0)
    wanted = [("ctx0", 0, 1), ("ctx0", 1, 1)]
    parsed = await RegistrationCache(sessionmaker).at("llama", wanted)
    assert parsed == [registration("llama", "ctx0", rank, tp_size=2) for rank in (0, 1)]
    classes = await RegistrationCache(sessionmaker).classes_at("llama", wanted, topology=False)
    digest = parsed[0].class_digest
    assert classes == [RankClass("ctx0", rank, digest, None) for rank in (0, 1)]
    moved = [("ctx0", 0, 1), ("ctx0", 1, 2)]
    with pytest.raises(RegistrationMoved, match="ctx0 rank 1"):
        await RegistrationCache(sessionmaker).classes_at("llama", moved, topology=False)


async def test_pools_and_views_are_queryable_and_cascade(
    sessionmaker: SessionMaker, engine: AsyncEngine
) -> None:
    await register(sessionmaker, registration("llama", "ctx0", 0, tp_size=2, memory=SHM), now=T0)
    await register(sessionmaker, registration("llama", "ctx0", 1, tp_size=2), now=T0)

    async with engine.connect() as connection:
        pools = (await connection.execute(select(PoolRow.rank, PoolRow.memory))).all()
        views = (
            await connection.execute(
                select(ViewRow.num_kv_heads, ViewRow.first_layer, ViewRow.last_layer, ViewRow.roles)
            )
        ).all()
        no_memory = await connection.scalar(text("SELECT count(*) FROM pools WHERE memory IS NULL"))
    assert sorted(pools) == [(0, SHM), (1, None)]
    assert no_memory == 1  # SQL NULL, not the JSON literal null
    assert views == [(4, 0, 3, ["key", "value"])] * 2

    await registry.delete_instance(sessionmaker, "llama", "ctx0")
    tables = await dump_tables(engine)
    assert tables["ranks"] == tables["pools"] == tables["views"] == []
    assert len(tables["deployments"]) == 1
