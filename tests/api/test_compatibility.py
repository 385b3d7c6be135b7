"""The compatibility matrix over live ranks, on both databases.

Registration refuses an incompatible rank while its peers are live, so an incompatible pair can
only be in the registry through rows admitted under laxer rules (an older kvroute). The test
writes such a row through the store's own write path, skipping the checks, exactly as it would
have been stored then.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.api.keys import sessionmaker_key
from kvroute.geometry import RankRegistration
from kvroute.store.engine import engine_of
from kvroute.store.rank_writes import write_admitted
from tests.api.conftest import ADMIN, WORKER, register
from tests.api.documents import rank_document

Client = TestClient[web.Request, web.Application]
MATRIX = "/v1/deployments/llama/compatibility"
SVG = "{http://www.w3.org/2000/svg}"


async def admit_without_checks(
    client: Client, instance: str, rank: int, doc: dict[str, Any]
) -> None:
    reg = RankRegistration.from_json(doc, deployment="llama", instance=instance, rank=rank)
    now = datetime.now(UTC)
    async with engine_of(client.app[sessionmaker_key]).begin() as connection:
        await write_admitted(connection, [(reg, None)], now)


async def matrix(client: Client) -> dict[str, Any]:
    response = await client.get(MATRIX, headers=ADMIN)
    assert response.status == 200, await response.text()
    return dict(await response.json())


def pair(body: dict[str, Any], context: str, generation: str) -> dict[str, Any]:
    return next(
        p for p in body["pairs"] if (p["context"], p["generation"]) == (context, generation)
    )


async def test_compatible_and_incompatible_pairs(client: Client) -> None:
    for rank in range(2):
        await register(client, "ctx0", rank, rank_document(tp_size=2, tp_rank=rank))
    await register(client, "gen0", 0, rank_document(role="generation"))
    # gen1's head_dim disagrees with ctx0 (the API would refuse it while ctx0 is live).
    await admit_without_checks(client, "gen1", 0, rank_document(role="generation", head_dim=32))

    body = await matrix(client)
    assert [item["instance"] for item in body["context"]] == ["ctx0"]
    assert [item["instance"] for item in body["generation"]] == ["gen0", "gen1"]
    assert pair(body, "ctx0", "gen0") == {
        "context": "ctx0",
        "generation": "gen0",
        "status": "compatible",
        "compatible": True,
    }
    refused = pair(body, "ctx0", "gen1")
    assert (refused["status"], refused["compatible"]) == ("incompatible", False)
    assert refused["refusal"] == {
        "code": "head_dim_mismatch",
        "field": "attention.head_dim",
        "detail": refused["refusal"]["detail"],
        "local": 32,
        "peer": 16,
        "generation_rank": 0,
        "context_rank": 0,
    }
    assert "ctx0 rank 0" in refused["refusal"]["detail"]


async def test_instances_with_missing_ranks_are_incomplete(client: Client) -> None:
    await register(client, "ctx0", 0, rank_document(tp_size=2, tp_rank=0))
    await register(client, "gen0", 0, rank_document(role="generation"))
    body = await matrix(client)
    assert body["context"] == [
        {
            "instance": "ctx0",
            "expected_ranks": 2,
            "live_ranks": [0],
            "missing_ranks": [1],
            "complete": False,
        }
    ]
    assert pair(body, "ctx0", "gen0") == {
        "context": "ctx0",
        "generation": "gen0",
        "status": "incomplete",
        "compatible": None,
        "missing_ranks": {"ctx0": [1]},
    }


async def test_matrix_is_admin_only_and_names_unknown_deployments(client: Client) -> None:
    await register(client, "ctx0", 0, rank_document())
    assert (await client.get(MATRIX)).status == 401
    assert (await client.get(MATRIX, headers=WORKER)).status == 403
    missing = await client.get("/v1/deployments/nope/compatibility", headers=ADMIN)
    assert missing.status == 404
    assert "'nope'" in (await missing.json())["detail"]
    alone = await matrix(client)
    assert (alone["generation"], alone["pairs"]) == ([], [])


async def test_matrix_picture_spells_out_each_refusal(client: Client) -> None:
    for rank in range(2):
        await register(client, "ctx0", rank, rank_document(tp_size=2, tp_rank=rank))
    await register(client, "gen0", 0, rank_document(role="generation"))
    await admit_without_checks(client, "gen1", 0, rank_document(role="generation", head_dim=32))
    response = await client.get(MATRIX + "?format=svg", headers=ADMIN)
    assert response.status == 200
    assert response.content_type == "image/svg+xml"
    root = ET.fromstring(await response.text())
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "[1] head_dim_mismatch" in texts
    assert (
        "[1] gen1 rank 0 <- ctx0 rank 0: head_dim_mismatch, field attention.head_dim: "
        "generation=32, context=16"
    ) in texts
    tips = [r.find(f"{SVG}title").text for r in root.iter(f"{SVG}rect") if len(r)]
    assert tips == [
        "gen0 <- ctx0: compatible",
        "gen1 rank 0 <- ctx0 rank 0: head_dim_mismatch, field attention.head_dim: "
        "generation=32, context=16",
    ]
    assert (await client.get(MATRIX + "?format=png", headers=ADMIN)).status == 422
