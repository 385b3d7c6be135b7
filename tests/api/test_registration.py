"""Registration lifecycle through the HTTP API: generations, reads, heartbeats, deletes."""

from __future__ import annotations

from datetime import datetime

from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.documents import rank_document


async def test_new_rank_is_created_with_generation_one(client):
    status, body = await register(client, "ctx0", 0, rank_document())
    assert status == 201
    assert body["generation"] == 1
    assert datetime.fromisoformat(body["lease_expires_at"]).tzinfo is not None


async def test_identical_document_keeps_generation_and_changed_one_advances(client):
    document = rank_document()
    await register(client, "ctx0", 0, document)
    same_status, same = await register(client, "ctx0", 0, document)
    assert (same_status, same["generation"]) == (200, 1)

    changed = rank_document()
    changed["pools"][0]["num_slots"] = 128
    changed_status, after = await register(client, "ctx0", 0, changed)
    assert (changed_status, after["generation"]) == (200, 2)

    rank = await (await client.get(rank_path("ctx0", 0), headers=WORKER)).json()
    assert rank["generation"] == 2
    assert rank["state"] == "live"
    assert rank["document"]["pools"][0]["num_slots"] == 128


async def test_compatible_peers_are_admitted_across_tp(client):
    for tp_rank in range(2):
        status, _ = await register(
            client, "ctx0", tp_rank, rank_document(tp_size=2, tp_rank=tp_rank)
        )
        assert status == 201
    status, _ = await register(client, "gen0", 0, rank_document(role="generation", tp_size=1))
    assert status == 201

    deployment = await (await client.get("/v1/deployments/llama", headers=ADMIN)).json()
    assert [(i["name"], i["role"], i["live_ranks"]) for i in deployment["instances"]] == [
        ("ctx0", "context", 2),
        ("gen0", "generation", 1),
    ]
    listing = await (await client.get("/v1/deployments", headers=ADMIN)).json()
    assert listing["deployments"][0]["live_ranks"] == 3


async def test_heartbeat_extends_the_lease(client):
    _, first = await register(client, "ctx0", 0, rank_document(lease_seconds=60))
    response = await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)
    assert response.status == 200
    renewed = await response.json()
    assert datetime.fromisoformat(renewed["lease_expires_at"]) >= datetime.fromisoformat(
        first["lease_expires_at"]
    )


async def test_heartbeat_of_unknown_rank_is_404(client):
    response = await client.post(rank_path("ghost", 3) + "/heartbeat", headers=WORKER)
    assert response.status == 404
    assert response.content_type == "application/problem+json"


async def test_delete_rank_then_instance(client):
    for tp_rank in range(2):
        await register(client, "ctx0", tp_rank, rank_document(tp_size=2, tp_rank=tp_rank))
    assert (await client.delete(rank_path("ctx0", 1), headers=ADMIN)).status == 204
    assert (await client.get(rank_path("ctx0", 1), headers=ADMIN)).status == 404
    instance = await (
        await client.get("/v1/deployments/llama/instances/ctx0", headers=ADMIN)
    ).json()
    assert [rank["rank"] for rank in instance["ranks"]] == [0]

    assert (
        await client.delete("/v1/deployments/llama/instances/ctx0", headers=ADMIN)
    ).status == 204
    gone = await client.get("/v1/deployments/llama/instances/ctx0", headers=ADMIN)
    assert gone.status == 404
    assert (await client.delete(rank_path("ctx0", 0), headers=ADMIN)).status == 404


async def test_reregistration_after_delete_never_reuses_a_generation(client):
    await register(client, "ctx0", 0, rank_document())
    await client.delete(rank_path("ctx0", 0), headers=ADMIN)
    status, body = await register(client, "ctx0", 0, rank_document())
    assert status == 201
    assert body["generation"] > 1


async def test_unknown_deployment_and_instance_are_404(client):
    for path in (
        "/v1/deployments/nope",
        "/v1/deployments/nope/instances",
        "/v1/deployments/nope/instances/ctx0",
        rank_path("ctx0", 0, "nope"),
    ):
        response = await client.get(path, headers=ADMIN)
        assert response.status == 404, path
        assert (await response.json(content_type=None))["status"] == 404
