"""Hybrid registrations and plans over HTTP on both databases: the new document members pass the
spec, plans carry state transfers and windows in the spec's shape, text and SVG show them, and an
incompatible hybrid instance is refused with its code, field and both values."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.api.conftest import WORKER, register
from tests.hybrid import HYBRID
from tests.world import Side, layout_rank

Client = TestClient[web.Request, web.Application]
SPEC = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml").read_text()
)
CTX = Side("context", 4, (6,), tokens_per_block=4, shared_state_pool=True, seed=1)
GEN = Side("generation", 2, (3, 3), tokens_per_block=4, seed=2)


def _plan_validator() -> jsonschema.Draft202012Validator:
    """The spec's Plan schema (OpenAPI 3.1 schemas are JSON Schema 2020-12)."""
    registry: Registry[Any] = Registry().with_resource(
        "urn:kvroute", DRAFT202012.create_resource(SPEC)
    )
    return jsonschema.Draft202012Validator(
        {"$ref": "urn:kvroute#/components/schemas/Plan"}, registry=registry
    )


async def _deploy(client: Client, gen: Side = GEN, name: str = "gen0") -> list[tuple[int, Any]]:
    for rank in range(CTX.tp_size):
        status, body = await register(client, "ctx0", rank, layout_rank(CTX, HYBRID, rank).doc)
        assert status in (200, 201), body
    return [
        await register(client, name, rank, layout_rank(gen, HYBRID, rank).doc)
        for rank in range(gen.tp_size * gen.pp_size)
    ]


async def _plan(client: Client, rank: int, fmt: str = "json") -> Any:
    query = {"sender": "ctx0", "receiver": "gen0", "receiver_rank": str(rank), "format": fmt}
    response = await client.get("/v1/deployments/llama/plans", params=query, headers=WORKER)
    assert response.status == 200, await response.text()
    return await response.json() if fmt == "json" else await response.text()


async def test_hybrid_plans_carry_state_and_windows_in_the_spec_shape(client: Client) -> None:
    assert [status for status, _ in await _deploy(client)] == [201] * 4
    validator = _plan_validator()
    for rank in range(4):
        plan = await _plan(client, rank)
        validator.validate(plan)
        states = [s for p in plan["peers"] for s in p.get("states", [])]
        assert {s["mapper"] for s in states} == {"ssm", "conv"}
        # Each generation rank of TP2 holds half the state: two context ranks of TP4 write it.
        assert {tuple(s["mamba_tp"]["src"]) for s in states} == {
            (4, 2 * (rank % 2)),
            (4, 2 * (rank % 2) + 1),
        }
        windows = [v["window"] for p in plan["peers"] for v in p["views"] if "window" in v]
        if rank >= 2:  # the second PP stage holds the windowed attention layer 5
            assert windows
            assert all(w["tokens"] == 6 for w in windows)
    text = await _plan(client, 3, "text")
    assert "recurrent state, once per request slot" in text
    assert "window 3->3: last 6 tokens" in text
    assert "state view 0 (target, ssm, ssm, per request)" in await _plan(client, 3, "svg")


async def test_an_incompatible_hybrid_instance_is_refused_naming_the_field(client: Client) -> None:
    await _deploy(client)
    wider = [replace(HYBRID[0], unit=8), *HYBRID[1:]]
    document = layout_rank(replace(GEN, seed=3), wider, 0).doc
    status, problem = await register(client, "gen1", 0, document)
    assert status == 409
    assert (problem["code"], problem["field"], problem["local"], problem["peer"]) == (
        "ssm_bytes_per_head_mismatch", "views[0].ssm_bytes_per_head", 8, 4,
    )  # fmt: skip
    assert problem["peer_instance"] == "ctx0"


async def test_members_outside_their_kind_or_the_schema_are_422(client: Client) -> None:
    document = layout_rank(CTX, HYBRID, 0).doc
    stray = copy.deepcopy(document)
    stray["views"][2]["conv_sections"] = [8]
    status, problem = await register(client, "ctx0", 0, stray)
    assert (status, problem["code"], problem["field"]) == (
        422,
        "invalid_document",
        "views[2].conv_sections",
    )
    empty = copy.deepcopy(document)
    empty["views"][1]["conv_sections"] = []
    status, problem = await register(client, "ctx0", 0, empty)
    assert status == 422


async def test_state_slots_and_prompt_length_outside_the_schema_are_422(client: Client) -> None:
    body = {"sender": "ctx0", "receiver": "gen0", "receiver_ranks": [0], "src_blocks": [0],
            "dst_blocks": [0]}  # fmt: skip
    for member, value in (("src_state_slot", -1), ("dst_state_slot", "1"), ("prompt_tokens", 0)):
        response = await client.post(
            "/v1/deployments/llama/transfers", json=body | {member: value}, headers=WORKER
        )
        problem = await response.json()
        assert response.status == 422, problem
        assert [error["field"] for error in problem["errors"]] == [member]
