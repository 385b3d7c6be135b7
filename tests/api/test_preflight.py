"""The questions that store nothing: ``POST .../admission-checks`` (the real admission as a dry run)
and ``POST /v1/preflight`` (``kvroute check`` for the console), on both databases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from kvroute.engines.models import parse_layout
from kvroute.engines.models.preflight import describe
from tests.api.conftest import ADMIN, WORKER, register, snapshot
from tests.models.configs import raw, spec

Client = TestClient[web.Request, web.Application]
SPEC = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml").read_text()
)


def _valid(schema: str, answer: Any) -> Any:
    """``answer`` checked against the spec's component schema ``schema`` (JSON Schema 2020-12)."""
    registry: Registry[Any] = Registry().with_resource(
        "urn:kvroute", DRAFT202012.create_resource(SPEC)
    )
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"urn:kvroute#/components/schemas/{schema}"}, registry=registry
    )
    validator.validate(answer)
    return answer


def _ranks(name: str, layout: str, role: str, instance: str) -> list[dict[str, Any]]:
    return list(describe(spec(name), parse_layout(layout, role), name=instance).documents)


async def test_dry_run_admission_answers_as_registration_and_stores_nothing(client: Client) -> None:
    for rank, document in enumerate(_ranks("llama-3.1-70b", "tp=4,tpb=32", "context", "ctx0")):
        assert (await register(client, "ctx0", rank, document))[0] == 201
    before = await snapshot(client)
    rejections = await (await client.get("/v1/rejections", headers=ADMIN)).json()
    url = "/v1/deployments/llama/admission-checks"
    good = {
        "instance": "gen9",
        "ranks": _ranks("llama-3.1-70b", "tp=2,tpb=64", "generation", "gen9"),
    }
    response = await client.post(url, json={"instances": [good]}, headers=WORKER)
    assert response.status == 200
    assert await response.json() == {"deployment": "llama", "admitted": True, "checked_ranks": 2}
    revision = {**raw("llama-3.1-70b"), "num_key_value_heads": 16}
    ranks = list(
        describe(spec(revision), parse_layout("tp=2", "generation"), name="gen9").documents
    )
    answer = await (
        await client.post(
            url, json={"instances": [{"instance": "gen9", "ranks": ranks}]}, headers=WORKER
        )
    ).json()
    refusal = answer["refusal"]
    assert (answer["admitted"], answer["checked_ranks"]) == (False, 0)
    assert (refusal["code"], refusal["status"], refusal["local"], refusal["peer"]) == (
        "total_kv_heads_mismatch",
        409,
        16,
        8,
    )
    assert (refusal["instance"], refusal["rank"], refusal["peer_instance"]) == ("gen9", 0, "ctx0")
    status, registered = await register(client, "gen9", 0, ranks[0])
    assert (status, registered["code"], registered["field"]) == (
        409,
        refusal["code"],
        refusal["field"],
    )
    assert await snapshot(client) == before
    after = await (await client.get("/v1/rejections", headers=ADMIN)).json()
    assert len(after["rejections"]) == len(rejections["rejections"]) + 1  # the real PUT only


async def test_dry_run_needs_a_token_and_a_document(client: Client) -> None:
    url = "/v1/deployments/llama/admission-checks"
    assert (await client.post(url, json={"instances": []})).status == 401
    bad = await client.post(
        url, json={"instances": [{"instance": "g", "ranks": [{}]}]}, headers=WORKER
    )
    assert bad.status == 422


async def test_preflight_gives_the_verdict_summary_and_picture(client: Client) -> None:
    body = {
        "model": raw("gpt-oss-120b"),
        "context": "tp=8,tpb=16",
        "generation": "tp=2,tpb=32",
        "rank": 1,
    }
    answer = _valid(
        "Preflight", await (await client.post("/v1/preflight", json=body, headers=WORKER)).json()
    )
    assert answer["compatible"] is True
    assert answer["summary"]["receivers"][1]["nixl_descriptors_per_block"] >= 1
    assert answer["ranks"] == {"context": 8, "generation": 2}
    assert answer["summary"]["receivers"][1]["expected_writers"] == 4
    assert answer["svg"].startswith("<svg")
    assert "gen0 rank 1" in answer["plan_text"]
    refused = await (
        await client.post("/v1/preflight", json={**body, "generation": "tp=3"}, headers=WORKER)
    ).json()
    assert (refused["compatible"], refused["refusal"]["code"]) == (False, "tp_heads_not_divisible")


async def test_preflight_names_what_it_cannot_model(client: Client) -> None:
    chunked = {**raw("llama-3.1-70b"), "attention_chunk_size": 8192}
    response = await client.post(
        "/v1/preflight",
        json={"model": chunked, "context": "tp=1", "generation": "tp=1"},
        headers=WORKER,
    )
    problem = await response.json()
    assert (response.status, problem["code"], problem["field"]) == (
        422,
        "unsupported_model_config",
        "model.attention_chunk_size",
    )
    response = await client.post(
        "/v1/preflight",
        json={"model": raw("qwen3-32b"), "context": "tp=8,pp=3", "generation": "tp=1"},
        headers=WORKER,
    )
    assert response.status == 200  # 64 layers over 3 stages is a layout
    response = await client.post(
        "/v1/preflight",
        json={"model": raw("qwen3-32b"), "context": "tp=0", "generation": "tp=1"},
        headers=WORKER,
    )
    assert ((await response.json())["code"], response.status) == ("invalid_layout", 422)


async def test_preflight_refuses_hostile_configs_and_huge_layouts_with_422(client: Client) -> None:
    llama = raw("llama-3.1-70b")
    hostile = [
        {**llama, "layer_types": [[1]] * 80},
        {**llama, "num_hidden_layers": 10**9},
        {**llama, "num_nextn_predict_layers": "one"},
        {**llama, "num_key_value_heads": -1},
        {**llama, "head_dim": 1.5},
        {**llama, "text_config": {"model_type": "gemma3_text"}},
        {
            "model_type": "jamba",
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": "x",
        },
        {"model_type": "nemotron_h", "layers_block_type": [{}], "num_hidden_layers": 1},
    ]
    for config in hostile:
        body = {"model": config, "context": "tp=1", "generation": "tp=1"}
        response = await client.post("/v1/preflight", json=body, headers=WORKER)
        problem = await response.json()
        assert (response.status, problem["code"]) == (422, "unsupported_model_config"), (
            config,
            problem,
        )
    huge = {"model": llama, "context": "tp=16,pp=32", "generation": "tp=1"}
    response = await client.post("/v1/preflight", json=huge, headers=WORKER)
    problem = await response.json()
    assert (response.status, problem["code"], problem["field"]) == (
        422,
        "invalid_layout",
        "context",
    )
