"""Bearer-token scopes: worker for its own registration work, admin for everything."""

from __future__ import annotations

import pytest

from tests.api.conftest import ADMIN, WORKER, rank_path
from tests.api.documents import rank_document

INSTANCE = "/v1/deployments/llama/instances/ctx0"


async def test_missing_and_invalid_tokens_are_401(client):
    for headers in (
        {},
        {"Authorization": "Bearer wrong-token-000000000"},
        {"Authorization": "Basic x"},
    ):
        response = await client.put(rank_path("ctx0", 0), json=rank_document(), headers=headers)
        assert response.status == 401
        assert response.content_type == "application/problem+json"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/deployments"),
        ("GET", "/v1/deployments/llama"),
        ("GET", "/v1/deployments/llama/instances"),
        ("GET", INSTANCE),
        ("DELETE", INSTANCE),
        ("DELETE", rank_path("ctx0", 0)),
        ("GET", "/v1/rejections"),
    ],
)
async def test_worker_token_cannot_reach_admin_operations(client, method, path):
    response = await client.request(method, path, headers=WORKER)
    assert response.status == 403
    assert (await response.json(content_type=None))["code"] == "insufficient_scope"


async def test_worker_token_registers_renews_and_reads(client):
    assert (
        await client.put(rank_path("ctx0", 0), json=rank_document(), headers=WORKER)
    ).status == 201
    assert (await client.post(rank_path("ctx0", 0) + "/heartbeat", headers=WORKER)).status == 200
    assert (await client.get(rank_path("ctx0", 0), headers=WORKER)).status == 200


async def test_admin_token_also_covers_worker_operations(client):
    assert (
        await client.put(rank_path("ctx0", 0), json=rank_document(), headers=ADMIN)
    ).status == 201
    assert (await client.get(INSTANCE, headers=ADMIN)).status == 200


async def test_probes_metrics_and_spec_need_no_token(client):
    for path in ("/healthz", "/readyz", "/metrics", "/v1/openapi.yaml"):
        assert (await client.get(path)).status == 200, path


async def test_without_tokens_auth_is_off(make_client):
    client = await make_client(worker_token=None, admin_token=None)
    assert (await client.put(rank_path("ctx0", 0), json=rank_document())).status == 201
    assert (await client.get("/v1/deployments")).status == 200
