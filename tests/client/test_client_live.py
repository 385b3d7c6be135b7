"""The client against a live ``kvroute serve``: sync and async, typed answers, refusals, tokens."""

from __future__ import annotations

import pytest

from kvroute.client import NO_RETRY, AsyncKvrouteClient, KvrouteClient, KvrouteError
from tests.api.documents import rank_document
from tests.client.live import ADMIN_TOKEN, WORKER_TOKEN, LiveServer

pytestmark = pytest.mark.slow


def test_sync_register_heartbeat_read_deregister(live_server: LiveServer) -> None:
    document = rank_document(tp_size=2, tp_rank=0)
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as worker:
        first = worker.register("sync", "ctx0", 0, document)
        again = worker.register("sync", "ctx0", 0, document)
        lease = worker.heartbeat("sync", "ctx0", 0)
        info = worker.get_rank("sync", "ctx0", 0)
    assert (first.created, first.generation) == (True, 1)
    assert (again.created, again.generation) == (False, 1)
    assert lease.lease_expires_at >= first.lease_expires_at
    assert (info.instance, info.rank, info.generation, info.state) == ("ctx0", 0, 1, "live")
    assert info.document["tp_size"] == 2
    with KvrouteClient(live_server.url, token=ADMIN_TOKEN) as admin:
        assert "sync" in [d.name for d in admin.deployments()]
        [instance] = admin.instances("sync")
        assert (instance.name, instance.role, instance.tp_size, instance.live_ranks) == (
            "ctx0",
            "context",
            2,
            1,
        )
        assert [r.rank for r in admin.instance("sync", "ctx0").ranks] == [0]
        admin.deregister("sync", "ctx0", 0)
        with pytest.raises(KvrouteError) as missing:
            admin.get_rank("sync", "ctx0", 0)
    assert (missing.value.status, missing.value.code) == (404, "not_found")


def test_a_zigzag_sender_s_plans_name_their_prompt_length(live_server: LiveServer) -> None:
    with KvrouteClient(live_server.url, token=WORKER_TOKEN) as worker:
        for cp_rank in range(2):
            document = rank_document()
            document.update(cp_size=2, cp_rank=cp_rank, cp_layout="zigzag")
            worker.register("zigzag", "ctx0", cp_rank, document)
        worker.register("zigzag", "gen0", 0, rank_document(role="generation"))
        with pytest.raises(KvrouteError) as missing:
            worker.get_plan("zigzag", sender="ctx0", receiver="gen0", receiver_rank=0)
        plan = worker.get_plan(
            "zigzag", sender="ctx0", receiver="gen0", receiver_rank=0, prompt_tokens=9
        )
        [listed] = worker.get_plans("zigzag", sender="ctx0", receiver="gen0", prompt_tokens=9)
    assert (missing.value.status, missing.value.code) == (422, "prompt_tokens_required")
    assert plan.plan.prompt_tokens == listed.plan.prompt_tokens == 9
    with KvrouteClient(live_server.url, token=ADMIN_TOKEN) as admin:
        cp_sizes = {i.name: i.cp_size for i in admin.instances("zigzag")}
    assert cp_sizes == {"ctx0": 2, "gen0": 1}


async def test_async_refusal_carries_problem_members(live_server: LiveServer) -> None:
    async with AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN) as worker:
        await worker.register("refuse", "ctx0", 0, rank_document(num_draft_layers=1))
        with pytest.raises(KvrouteError) as refused:
            await worker.register(
                "refuse", "gen0", 0, rank_document(role="generation", num_draft_layers=2)
            )
    error = refused.value
    assert (error.status, error.code, error.field) == (
        409,
        "draft_layers_mismatch",
        "num_draft_layers",
    )
    assert (error.local, error.peer, error.peer_instance, error.peer_rank) == (2, 1, "ctx0", 0)
    assert "num_draft_layers" in error.detail
    assert error.problem["type"].endswith("draft-layers-mismatch")
    async with AsyncKvrouteClient(live_server.url, token=ADMIN_TOKEN) as admin:
        rejections = await admin.rejections(limit=10)
    assert any(
        (r.deployment, r.instance, r.code) == ("refuse", "gen0", "draft_layers_mismatch")
        for r in rejections
    )


async def test_async_bad_document_is_422_with_field(live_server: LiveServer) -> None:
    document = rank_document()
    document["tokens_per_block"] = 0
    async with AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN) as worker:
        with pytest.raises(KvrouteError) as refused:
            await worker.register("bad", "ctx0", 0, document)
    assert refused.value.status in (400, 422)
    assert "tokens_per_block" in refused.value.detail


async def test_wrong_token_and_scope(live_server: LiveServer) -> None:
    async with AsyncKvrouteClient(live_server.url, token="not-a-valid-token-at-all") as stranger:
        with pytest.raises(KvrouteError) as unauthorized:
            await stranger.register("auth", "ctx0", 0, rank_document())
    async with AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN) as worker:
        with pytest.raises(KvrouteError) as forbidden:
            await worker.deployments()
    assert unauthorized.value.status == 401
    assert forbidden.value.status == 403


async def test_heartbeat_of_unknown_rank_is_404(live_server: LiveServer) -> None:
    async with AsyncKvrouteClient(live_server.url, token=WORKER_TOKEN) as worker:
        with pytest.raises(KvrouteError) as missing:
            await worker.heartbeat("nobody", "ctx9", 3)
    assert missing.value.not_found
    assert not missing.value.retryable


async def test_unreachable_service_raises_after_bounded_retries() -> None:
    from tests.client.live import free_port

    async with AsyncKvrouteClient(f"http://127.0.0.1:{free_port()}", retry=NO_RETRY) as client:
        with pytest.raises(KvrouteError) as unreachable:
            await client.heartbeat("d", "i", 0)
    assert unreachable.value.status is None
    assert unreachable.value.code == "unreachable"
    assert unreachable.value.retryable
