"""Model identity fencing over HTTP, on both databases: a rolling update that mixes revisions is
refused at registration with the field and both values, nothing stored, and the compatibility
matrix names a mixed pair admitted under older rules."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.api.conftest import ADMIN, rank_path, register, snapshot
from tests.api.documents import rank_document
from tests.api.test_compatibility import admit_without_checks, matrix, pair

Client = TestClient[web.Request, web.Application]
MODEL = {"name": "meta-llama/Llama-3.1-8B", "revision": "945c8663", "tokenizer_digest": "sha256:t1"}


def named(role: str = "context", **model: Any) -> dict[str, Any]:
    document = rank_document(role=role)
    document["model"] = {**MODEL, **model}
    return document


async def test_a_peer_of_another_revision_is_409_naming_both_values(client: Client) -> None:
    status, _ = await register(client, "ctx0", 0, named())
    assert status == 201
    before = await snapshot(client)
    status, problem = await register(client, "gen0", 0, named("generation", revision="0e9e39f2"))
    assert status == problem["status"] == 409
    assert (problem["code"], problem["field"]) == ("model_revision_mismatch", "model.revision")
    assert (problem["local"], problem["peer"]) == ("0e9e39f2", "945c8663")
    assert (problem["peer_instance"], problem["peer_rank"]) == ("ctx0", 0)
    assert problem["type"].endswith("model-revision-mismatch")
    assert await snapshot(client) == before  # nothing stored
    rejections = await (await client.get("/v1/rejections", headers=ADMIN)).json()
    assert rejections["rejections"][0]["code"] == "model_revision_mismatch"


async def test_another_tokenizer_and_kv_format_are_refused_by_their_own_codes(client) -> None:
    document = named()
    document["kv_quantization"] = {"kv_dtype": "fp8_e4m3", "scale_layout": "per_tensor"}
    await register(client, "ctx0", 0, document)
    status, problem = await register(
        client, "gen0", 0, named("generation", tokenizer_digest="sha256:t2")
    )
    assert (status, problem["code"], problem["local"], problem["peer"]) == (
        409,
        "tokenizer_mismatch",
        "sha256:t2",
        "sha256:t1",
    )
    other = named("generation")
    other["kv_quantization"] = {"kv_dtype": "fp8_e5m2", "scale_layout": "per_tensor"}
    status, problem = await register(client, "gen0", 0, other)
    assert (status, problem["code"], problem["field"]) == (
        409,
        "kv_dtype_mismatch",
        "kv_quantization.kv_dtype",
    )
    assert (problem["local"], problem["peer"]) == ("fp8_e5m2", "fp8_e4m3")


async def test_identity_is_stored_and_read_back_as_given(client: Client) -> None:
    document = named()
    status, _ = await register(client, "ctx0", 0, document)
    assert status == 201
    stored = await (await client.get(rank_path("ctx0", 0), headers=ADMIN)).json()
    assert stored["document"]["model"] == MODEL
    # Unnamed peers and peers naming fewer members are admitted: old workers keep working.
    assert (await register(client, "gen0", 0, rank_document(role="generation")))[0] == 201
    partial = rank_document(role="generation")
    partial["model"] = {"name": MODEL["name"]}
    assert (await register(client, "gen1", 0, partial))[0] == 201


async def test_the_matrix_names_a_mixed_revision_pair(client: Client) -> None:
    await register(client, "ctx0", 0, named())
    await register(client, "gen0", 0, named("generation"))
    await admit_without_checks(client, "gen1", 0, named("generation", revision="new"))
    body = await matrix(client)
    assert pair(body, "ctx0", "gen0")["status"] == "compatible"
    refusal = pair(body, "ctx0", "gen1")["refusal"]
    assert (refusal["code"], refusal["field"]) == ("model_revision_mismatch", "model.revision")
    assert (refusal["local"], refusal["peer"]) == ("new", "945c8663")


async def test_a_malformed_identity_is_refused_before_anything(client: Client) -> None:
    document = rank_document()
    document["model"] = {"revision": "with space"}
    status, problem = await register(client, "ctx0", 0, document)
    assert status in (400, 422)
    assert "model" in problem["detail"]
    document["model"] = {}
    status, problem = await register(client, "ctx0", 0, document)
    assert status in (400, 422)
