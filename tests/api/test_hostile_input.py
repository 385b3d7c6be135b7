"""Hostile requests: identifiers that alias others, bodies built to be expensive or to crash a parser.

Each answer is a 4xx problem+json naming the problem, and an aliased identifier stores nothing
under the name it would have aliased.
"""

from __future__ import annotations

import json

import pytest

from kvroute.api.bodies import MAX_JSON_DEPTH, MAX_REPORTED_ERRORS
from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.documents import rank_document

PROBLEM = "application/problem+json"
JSON = {**WORKER, "Content-Type": "application/json"}


async def _problem(response) -> dict:
    assert response.content_type == PROBLEM
    return dict(await response.json(content_type=None))


async def test_a_newline_in_a_path_identifier_is_refused_not_stripped(client):
    response = await client.put(
        "/v1/deployments/a%0Ab/instances/ctx0/ranks/0", json=rank_document(), headers=WORKER
    )
    assert response.status == 422
    assert (await _problem(response))["field"] == "path.deployment"
    stored = await client.get("/v1/deployments/ab/instances/ctx0/ranks/0", headers=WORKER)
    assert stored.status == 404
    trailing = await client.put(
        "/v1/deployments/llama/instances/ctx0%0A/ranks/0", json=rank_document(), headers=WORKER
    )
    assert trailing.status == 422
    assert (await _problem(trailing))["field"] == "path.instance"


@pytest.mark.parametrize("spelling", ["%D9%A1", "01", "+1", "%201", "1_0", "%EF%BC%91"])
async def test_a_rank_spelled_other_than_in_ascii_digits_is_400(client, spelling):
    response = await client.put(
        f"/v1/deployments/llama/instances/ctx0/ranks/{spelling}",
        json=rank_document(),
        headers=WORKER,
    )
    assert response.status == 400
    problem = await _problem(response)
    assert (problem["code"], problem["field"]) == ("malformed_parameter", "path.rank")
    assert (await client.get(rank_path("ctx0", 1), headers=WORKER)).status == 404


async def test_query_parameters_are_spelled_strictly_and_given_once(client):
    plans = "/v1/deployments/llama/plans?sender=ctx0&receiver=gen0"
    arabic = await client.get(plans + "&receiver_rank=%D9%A1", headers=WORKER)
    assert arabic.status == 400
    assert (await _problem(arabic))["field"] == "query.receiver_rank"
    newline = await client.get(
        "/v1/deployments/llama/plans?sender=ctx0%0A&receiver=gen0&receiver_rank=0", headers=WORKER
    )
    assert newline.status == 422
    assert (await _problem(newline))["field"] == "query.sender"
    twice = await client.get(plans + "&receiver_rank=0&receiver_rank=1", headers=WORKER)
    assert twice.status == 400
    assert (await _problem(twice))["field"] == "query.receiver_rank"


async def test_a_body_name_with_a_trailing_newline_is_refused(client):
    body = {
        "sender": "ctx0\n",
        "receiver": "gen0",
        "receiver_ranks": [0],
        "src_blocks": [0],
        "dst_blocks": [0],
    }
    response = await client.post("/v1/deployments/llama/transfers", json=body, headers=WORKER)
    assert response.status == 422
    assert (await _problem(response))["field"] == "sender"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 50_000 + b"]" * 50_000, id="50000-arrays"),
        pytest.param(b'{"a":' * 20_000 + b"1" + b"}" * 20_000, id="20000-objects"),
        pytest.param(
            b'{"role": "context", "x": '
            + b"[" * (MAX_JSON_DEPTH + 1)
            + b"]" * (MAX_JSON_DEPTH + 1)
            + b"}",
            id="just-past-the-depth-limit",
        ),
    ],
)
async def test_deeply_nested_json_is_400_not_500(client, body):
    response = await client.put(rank_path("ctx0", 0), data=body, headers=JSON)
    assert response.status == 400
    assert (await _problem(response))["code"] == "nesting_too_deep"


async def test_a_hundred_thousand_layers_are_refused_before_validation(client):
    document = rank_document()
    document["views"][0]["layers"] = [{"layer": i, "offset": 0} for i in range(100_000)]
    response = await client.put(rank_path("ctx0", 0), json=document, headers=WORKER)
    assert response.status == 413
    assert (await _problem(response))["code"] == "body_too_complex"


async def test_a_body_with_thousands_of_errors_reports_a_bounded_few(client):
    document = rank_document()
    document["views"][0]["layers"] = [{"layer": -1, "offset": -1} for _ in range(1000)]
    response = await client.put(rank_path("ctx0", 0), json=document, headers=WORKER)
    assert response.status == 422
    problem = await _problem(response)
    assert len(problem["errors"]) == MAX_REPORTED_ERRORS
    assert problem["field"].startswith("views[0].layers[")
    assert len(problem["detail"]) < 300


async def test_an_oversized_list_is_named_without_echoing_it(client):
    document = rank_document()
    document["views"][0]["layers"] = [{"layer": 0, "offset": 0}] * 5000
    response = await client.put(rank_path("ctx0", 0), json=document, headers=WORKER)
    assert response.status == 422
    problem = await _problem(response)
    assert problem["field"] == "views[0].layers"
    assert problem["detail"] == "views[0].layers: has more than 1024 items"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"1" * 5000])
async def test_non_json_numbers_are_malformed(client, literal):
    document = json.dumps(rank_document()).replace('"tp_size": 1', '"tp_size": LITERAL')
    body = document.encode().replace(b"LITERAL", literal)
    response = await client.put(rank_path("ctx0", 0), data=body, headers=JSON)
    assert response.status == 400
    assert (await _problem(response))["code"] == "malformed_json"


async def test_layer_slots_over_all_views_are_bounded(client):
    document = rank_document(num_layers=4)
    view = document["views"][0]
    document["views"] = [
        dict(view, view_id=i, layers=[{"layer": 0, "offset": 0}] * 1024) for i in range(5)
    ]
    status, problem = await register(client, "ctx0", 0, document)
    assert status == 422
    assert (problem["code"], problem["field"]) == ("invalid_document", "views")
    assert (await client.get("/v1/deployments", headers=ADMIN)).status == 200
