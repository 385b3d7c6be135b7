"""Bad requests get a precise 4xx problem, never a 500 (malformed, oversize, wrong types)."""

from __future__ import annotations

import pytest

from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.documents import rank_document

PROBLEM = "application/problem+json"


async def test_malformed_json_is_400(client):
    response = await client.put(
        rank_path("ctx0", 0),
        data=b'{"role": "context",',
        headers={**WORKER, "Content-Type": "application/json"},
    )
    assert response.status == 400
    assert response.content_type == PROBLEM
    assert (await response.json(content_type=None))["code"] == "malformed_json"


async def test_oversize_body_is_413(make_client):
    client = await make_client(max_body_bytes=2048)
    document = rank_document(num_layers=64)  # well above 2 KiB of JSON
    response = await client.put(rank_path("ctx0", 0), json=document, headers=WORKER)
    assert response.status == 413
    problem = await response.json(content_type=None)
    assert problem["status"] == 413
    assert "2048" in problem["detail"]


async def test_non_json_body_is_415(client):
    response = await client.put(
        rank_path("ctx0", 0), data=b"role=context", headers={**WORKER, "Content-Type": "text/plain"}
    )
    assert response.status == 415
    assert response.content_type == PROBLEM


async def test_missing_body_is_400(client):
    response = await client.put(rank_path("ctx0", 0), headers=WORKER)
    assert response.status in (400, 415)
    assert response.content_type == PROBLEM


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda doc: doc.update(tp_size="4"), "tp_size"),
        (lambda doc: doc["attention"].update(head_dim=-1), "attention.head_dim"),
        (
            lambda doc: doc["views"][0]["layers"][0].update(offset="zero"),
            "views[0].layers[0].offset",
        ),
        (lambda doc: doc["pools"][0].pop("num_slots"), "pools[0].num_slots"),
        (lambda doc: doc.update(surprise=1), ""),
        (lambda doc: doc.update(views=[doc["views"][0]] * 257), "views"),
    ],
)
async def test_schema_violations_are_422_naming_the_field(client, mutate, field):
    document = rank_document()
    mutate(document)
    status, problem = await register(client, "ctx0", 0, document)
    assert status == 422
    assert problem["code"] == "schema_violation"
    assert problem["field"] == field
    assert any(error["field"] == field for error in problem["errors"])


async def test_bad_path_parameters(client):
    not_a_number = await client.get("/v1/deployments/llama/instances/ctx0/ranks/x", headers=ADMIN)
    assert not_a_number.status == 400
    assert (await not_a_number.json(content_type=None))["field"] == "path.rank"
    bad_name = await client.get("/v1/deployments/-bad/instances", headers=ADMIN)
    assert bad_name.status == 422
    assert (await bad_name.json(content_type=None))["field"] == "path.deployment"
    too_big = await client.get("/v1/rejections?limit=100000", headers=ADMIN)
    assert too_big.status == 422


async def test_unknown_route_and_method_are_problems(client):
    missing = await client.get("/v2/anything", headers=ADMIN)
    assert (missing.status, missing.content_type) == (404, PROBLEM)
    wrong_method = await client.patch(rank_path("ctx0", 0), headers=ADMIN)
    assert (wrong_method.status, wrong_method.content_type) == (405, PROBLEM)
    assert "PUT" in wrong_method.headers["Allow"]


async def test_request_id_is_echoed_or_generated(client):
    echoed = await client.get("/healthz", headers={"X-Request-ID": "trace-42"})
    assert echoed.headers["X-Request-ID"] == "trace-42"
    generated = await client.get("/v2/x", headers={"X-Request-ID": "bad id with spaces"})
    request_id = generated.headers["X-Request-ID"]
    assert request_id != "bad id with spaces"
    assert (await generated.json(content_type=None))["request_id"] == request_id


async def test_undeclared_query_parameter_is_422(client):
    response = await client.get("/v1/rejections?limt=5", headers=ADMIN)
    assert response.status == 422
    assert (await response.json(content_type=None))["field"] == "query.limt"


async def test_body_sent_to_an_operation_without_one_is_ignored(client):
    await register(client, "ctx0", 0, rank_document())
    response = await client.post(
        rank_path("ctx0", 0) + "/heartbeat",
        data=b"not json at all",
        headers={**WORKER, "Content-Type": "application/json"},
    )
    assert response.status == 200
