"""The matrix and pairs answers are kept rendered per deployment (``kvroute.control.answers``):
every change of what they show must reach the next answer, on both databases. Each step reads
both answers first (so a rendering is cached), changes one thing, and reads them again."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.test_compatibility import matrix, pair
from tests.api.test_pairs import pairs, placed, policy
from tests.clock import ManualClock

Client = TestClient[web.Request, web.Application]


def cell(body: dict[str, Any], context: str, generation: str = "gen0") -> str:
    return str(pair(body, context, generation)["status"])


def choices(body: dict[str, Any], generation: str = "gen0") -> list[str]:
    (answer,) = [item for item in body["generation"] if item["instance"] == generation]
    return [choice["context"] for choice in answer["pairs"]]


async def test_registration_and_re_registration_reach_the_next_answers(client: Client) -> None:
    assert (await register(client, "ctx0", 0, placed()))[0] == 201
    assert (await register(client, "gen0", 0, placed("generation")))[0] == 201
    assert cell(await matrix(client), "ctx0") == "compatible"
    assert choices(await pairs(client)) == ["ctx0"]

    assert (await register(client, "ctx1", 0, placed()))[0] == 201
    assert cell(await matrix(client), "ctx1") == "compatible"
    assert choices(await pairs(client)) == ["ctx0", "ctx1"]
    assert choices(await pairs(client, "?generation=gen0")) == ["ctx0", "ctx1"]

    # A new document for gen0 (a new generation) moves it into zone a: its domains change.
    assert (await register(client, "gen0", 0, placed("generation", zone="a")))[0] == 200
    (answer,) = (await pairs(client))["generation"]
    assert answer["domains"] == {"zone": "a"}


async def test_deletion_reaches_the_next_answers(client: Client) -> None:
    assert (await register(client, "ctx0", 0, placed()))[0] == 201
    for rank in range(2):  # ctx1 is TP2: it stays, incomplete, when one rank is deleted
        assert (await register(client, "ctx1", rank, placed(tp_size=2, tp_rank=rank)))[0] == 201
    assert (await register(client, "gen0", 0, placed("generation")))[0] == 201
    assert cell(await matrix(client), "ctx1") == "compatible"
    assert choices(await pairs(client)) == ["ctx0", "ctx1"]

    assert (await client.delete(rank_path("ctx1", 1), headers=ADMIN)).status == 204
    assert cell(await matrix(client), "ctx1") == "incomplete"
    assert choices(await pairs(client)) == ["ctx0"]

    deleted = await client.delete("/v1/deployments/llama/instances/ctx1", headers=ADMIN)
    assert deleted.status == 204
    body = await matrix(client)
    assert [item["instance"] for item in body["context"]] == ["ctx0"]
    assert [item["context"] for item in body["pairs"]] == ["ctx0"]


async def test_an_expiry_reaches_the_next_answers_before_any_reaper(
    client: Client, clock: ManualClock
) -> None:
    for name, role in (("ctx0", "context"), ("gen0", "generation")):
        assert (await register(client, name, 0, {**placed(role), "lease_seconds": 10}))[0] == 201
    clock.advance(6)
    renewed = await client.post(rank_path("gen0", 0) + "/heartbeat", headers=WORKER)
    assert renewed.status == 200
    # A renewal changes nothing either answer shows.
    assert cell(await matrix(client), "ctx0") == "compatible"
    assert choices(await pairs(client)) == ["ctx0"]

    clock.advance(4)  # ctx0's lease ends now; gen0's renewed one runs on
    body = await matrix(client)
    assert cell(body, "ctx0") == "incomplete"
    assert body["context"][0]["missing_ranks"] == [0]
    assert choices(await pairs(client)) == []


async def test_a_pairing_policy_reaches_the_next_answers(client: Client) -> None:
    assert (await register(client, "ctx0", 0, placed(zone="b")))[0] == 201
    assert (await register(client, "gen0", 0, placed("generation", zone="a")))[0] == 201
    assert "pairing" not in pair(await matrix(client), "ctx0", "gen0")
    assert choices(await pairs(client)) == ["ctx0"]

    assert (await policy(client, {"require": ["zone"]}))[0] == 200
    assert pair(await matrix(client), "ctx0", "gen0")["pairing"]["allowed"] is False
    assert choices(await pairs(client)) == []
