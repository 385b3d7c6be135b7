"""Geometry refused at the boundary: the right status and problem, and nothing stored."""

from __future__ import annotations

from typing import Any

from tests.api.conftest import ADMIN, rank_path, register, snapshot
from tests.api.documents import rank_document


async def _refused(client, instance: str, rank: int, document: dict[str, Any]) -> dict[str, Any]:
    """Registers, expecting a refusal that leaves every admin-visible listing unchanged."""
    before = await snapshot(client)
    status, problem = await register(client, instance, rank, document)
    assert await snapshot(client) == before
    assert problem["status"] == status
    return problem


async def test_peer_head_dim_mismatch_is_409_naming_both_values(client):
    await register(client, "ctx0", 0, rank_document(head_dim=16))
    problem = await _refused(client, "gen0", 0, rank_document(role="generation", head_dim=32))
    assert problem["status"] == 409
    assert problem["code"] == "head_dim_mismatch"
    assert (problem["local"], problem["peer"]) == (32, 16)
    assert (problem["peer_instance"], problem["peer_rank"]) == ("ctx0", 0)
    assert problem["field"] == "attention.head_dim"
    assert problem["type"].endswith("head-dim-mismatch")


async def test_draft_layer_mismatch_is_reported_before_head_geometry(client):
    await register(client, "ctx0", 0, rank_document(num_draft_layers=1, head_dim=16))
    # Wrong on both counts: the draft-layer count is checked first.
    document = rank_document(role="generation", num_draft_layers=0, head_dim=32)
    problem = await _refused(client, "gen0", 0, document)
    assert (problem["status"], problem["code"], problem["field"]) == (
        409,
        "draft_layers_mismatch",
        "num_draft_layers",
    )
    assert (problem["local"], problem["peer"]) == (0, 1)


async def test_instance_layout_mismatch_is_409(client):
    await register(client, "ctx0", 0, rank_document(tp_size=2, tp_rank=0))
    document = rank_document(tp_size=2, tp_rank=1, tokens_per_block=8)
    problem = await _refused(client, "ctx0", 1, document)
    assert (problem["status"], problem["code"]) == (409, "instance_layout_mismatch")
    assert problem["field"] == "tokens_per_block"
    assert (problem["local"], problem["peer"]) == (8, 4)


async def test_rank_number_must_match_tp_rank(client):
    problem = await _refused(client, "ctx0", 1, rank_document(tp_size=2, tp_rank=0))
    assert (problem["status"], problem["code"], problem["field"]) == (409, "rank_mismatch", "rank")


async def test_self_inconsistent_view_is_422(client):
    document = rank_document()
    document["views"][0]["bytes_per_layer"] += 1  # no longer divisible by buffers and heads
    problem = await _refused(client, "ctx0", 0, document)
    assert problem["status"] == 422
    assert problem["field"].startswith("views[0]")
    assert problem["code"] in {
        "bytes_per_layer_not_divisible",
        "view_outside_slot",
        "views_overlap",
    }


async def test_prefill_context_parallel_chunks_on_a_generation_rank_are_refused(client):
    document = rank_document(role="generation")
    document["cp_size"] = 2
    document["cp_layout"] = "zigzag"
    problem = await _refused(client, "gen0", 0, document)
    assert (problem["status"], problem["code"], problem["field"]) == (
        422,
        "context_parallel_layout_unsupported",
        "cp_layout",
    )
    assert (problem["local"], problem["peer"]) == ("zigzag", "interleaved")


async def test_unknown_dtype_is_a_422_schema_refusal(client):
    document = rank_document()
    document["attention"]["dtype"] = "float7"
    problem = await _refused(client, "ctx0", 0, document)
    assert (problem["status"], problem["code"], problem["field"]) == (
        422,
        "invalid_document",
        "attention.dtype",
    )


async def test_rejected_peer_is_invisible_and_logged(client):
    await register(client, "ctx0", 0, rank_document(head_dim=16))
    await _refused(client, "gen0", 0, rank_document(role="generation", head_dim=32))
    assert (await client.get(rank_path("gen0", 0), headers=ADMIN)).status == 404
    assert (await client.get("/v1/deployments/llama/instances/gen0", headers=ADMIN)).status == 404

    log = (await (await client.get("/v1/rejections", headers=ADMIN)).json())["rejections"]
    assert [(r["instance"], r["rank"], r["code"]) for r in log] == [
        ("gen0", 0, "head_dim_mismatch")
    ]
    assert log[0]["problem"]["peer"] == 16


async def test_rejection_log_is_newest_first_and_limited(client):
    await register(client, "ctx0", 0, rank_document(head_dim=16))
    for rank in range(3):
        doc = rank_document(role="generation", tp_size=4, tp_rank=rank, head_dim=32)
        await register(client, "gen0", rank, doc)
    response = await client.get("/v1/rejections?limit=2", headers=ADMIN)
    ranks = [item["rank"] for item in (await response.json())["rejections"]]
    assert ranks == [2, 1]


async def test_refusals_are_counted_in_metrics(client):
    refusals = 2
    await register(client, "ctx0", 0, rank_document(head_dim=16))
    for _ in range(refusals):
        await register(client, "gen0", 0, rank_document(role="generation", head_dim=32))
    text = await (await client.get("/metrics")).text()
    rejected = 'kvroute_rejections_total{code="head_dim_mismatch",deployment="llama"}'
    assert f"{rejected} {float(refusals)}" in text
    assert f'kvroute_registrations_total{{result="rejected"}} {float(refusals)}' in text
    assert 'kvroute_registrations_total{result="created"} 1.0' in text
