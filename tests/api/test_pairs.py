"""Topology-aware pairing over HTTP, on both databases: ranks declare domains, the deployment's
pairing policy requires or prefers pairs within them, and the pairs answer lists, per generation
instance, the context instances it may pair with (best first) and why each other one may not."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute import wire
from kvroute.client import AsyncKvrouteClient
from tests.api.conftest import ADMIN, WORKER, WORKER_TOKEN, register
from tests.api.documents import rank_document
from tests.api.test_compatibility import admit_without_checks, matrix, pair

Client = TestClient[web.Request, web.Application]
DEPLOYMENT = "/v1/deployments/llama"
PAIRS = DEPLOYMENT + "/pairs"
MODEL = {"name": "llama", "revision": "r1"}


def placed(role: str = "context", tp_size: int = 1, tp_rank: int = 0, **topology: str):
    document = rank_document(role=role, tp_size=tp_size, tp_rank=tp_rank)
    document["model"] = MODEL
    if topology:
        document["topology"] = topology
    return document


async def policy(client: Client, pairing: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
    response = await client.patch(DEPLOYMENT, json={"pairing": pairing}, headers=ADMIN)
    return response.status, await response.json(content_type=None)


async def pairs(client: Client, query: str = "") -> dict[str, Any]:
    response = await client.get(PAIRS + query, headers=WORKER)
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def fleet(client: Client) -> None:
    """Context instances around gen0 (zone a, rack r1) and gen1 (zone b)."""
    for name, doc in (
        ("ctx0", placed(zone="a", rack="r1")),
        ("ctx1", placed(zone="a", rack="r2")),
        ("ctx2", placed(zone="b", rack="r9")),
        ("ctx5", placed(zone="a", rack="r1")),
        ("gen0", placed("generation", zone="a", rack="r1")),
        ("gen1", placed("generation", zone="b")),
    ):
        status, body = await register(client, name, 0, doc)
        assert status == 201, body
    # ctx3 is missing its rank 1; ctx4 serves another revision (admitted under older rules).
    assert (await register(client, "ctx3", 0, placed(tp_size=2, zone="a", rack="r1")))[0] == 201
    other = placed(zone="a", rack="r1")
    other["model"] = {**MODEL, "revision": "r2"}
    await admit_without_checks(client, "ctx4", 0, other)


def by_instance(body: dict[str, Any], name: str) -> dict[str, Any]:
    return next(item for item in body["generation"] if item["instance"] == name)


async def test_required_and_preferred_domains_order_and_exclude_pairs(client: Client) -> None:
    await fleet(client)
    status, deployment = await policy(client, {"require": ["zone"], "prefer": ["rack"]})
    assert status == 200, deployment
    assert deployment["pairing"] == {"require": ["zone"], "prefer": ["rack"]}
    body = await pairs(client)
    assert body["pairing"] == {"require": ["zone"], "prefer": ["rack"]}
    gen0 = by_instance(body, "gen0")
    assert gen0["domains"] == {"rack": "r1", "zone": "a"}
    assert gen0["pairs"] == [
        {"context": "ctx0", "preference": 1, "shared_domains": ["rack", "zone"]},
        {"context": "ctx5", "preference": 1, "shared_domains": ["rack", "zone"]},
        {"context": "ctx1", "preference": 2, "shared_domains": ["zone"]},
    ]
    excluded = {item["context"]: item for item in gen0["excluded"]}
    assert list(excluded) == ["ctx2", "ctx3", "ctx4"]
    assert excluded["ctx2"]["code"] == "topology_domain_required"
    assert (excluded["ctx2"]["field"], excluded["ctx2"]["local"], excluded["ctx2"]["peer"]) == (
        "topology.zone",
        "a",
        "b",
    )
    assert excluded["ctx3"]["code"] == "instance_incomplete"
    assert (excluded["ctx3"]["local"], excluded["ctx3"]["peer"]) == ([], [1])
    revision = excluded["ctx4"]
    assert (revision["code"], revision["field"]) == ("model_revision_mismatch", "model.revision")
    assert (revision["local"], revision["peer"]) == ("r1", "r2")
    gen1 = by_instance(body, "gen1")
    assert [item["context"] for item in gen1["pairs"]] == ["ctx2"]
    assert gen1["pairs"][0]["shared_domains"] == ["zone"]


async def test_preference_alone_orders_without_excluding(client: Client) -> None:
    await fleet(client)
    await policy(client, {"prefer": ["rack", "zone"]})
    gen1 = by_instance(await pairs(client, "?generation=gen1"), "gen1")
    # gen1 declares no rack: sharing its zone is the best it gets.
    assert [(p["context"], p["preference"]) for p in gen1["pairs"]] == [
        ("ctx2", 1),
        ("ctx0", 2),
        ("ctx1", 2),
        ("ctx5", 2),
    ]
    assert {item["code"] for item in gen1["excluded"]} == {
        "instance_incomplete",
        "model_revision_mismatch",
    }


async def test_without_a_policy_every_compatible_pair_is_allowed_by_name(client: Client) -> None:
    await fleet(client)
    body = await pairs(client)
    assert body["pairing"] == {"require": [], "prefer": []}
    gen0 = by_instance(body, "gen0")
    assert [(p["context"], p["preference"]) for p in gen0["pairs"]] == [
        ("ctx0", 1),
        ("ctx1", 1),
        ("ctx2", 1),
        ("ctx5", 1),
    ]
    assert "pairing" not in pair(await matrix(client), "ctx0", "gen0")


async def test_an_instance_spanning_racks_shares_no_rack(client: Client) -> None:
    await register(client, "ctx0", 0, placed(zone="a", rack="r1"))
    await register(client, "gen0", 0, placed("generation", 2, 0, zone="a", rack="r1"))
    await register(client, "gen0", 1, placed("generation", 2, 1, zone="a", rack="r2"))
    await policy(client, {"require": ["rack"]})
    gen0 = by_instance(await pairs(client), "gen0")
    assert gen0["domains"] == {"rack": ["r1", "r2"], "zone": "a"}
    assert gen0["pairs"] == []
    (exclusion,) = gen0["excluded"]
    assert (exclusion["code"], exclusion["local"], exclusion["peer"]) == (
        "topology_domain_required",
        ["r1", "r2"],
        "r1",
    )
    assert "several (r1, r2)" in exclusion["detail"]


async def test_the_matrix_shows_the_pairing_of_each_pair(client: Client) -> None:
    await fleet(client)
    await policy(client, {"require": ["zone"], "prefer": ["rack"]})
    body = await matrix(client)
    assert pair(body, "ctx0", "gen0")["pairing"] == {
        "allowed": True,
        "shared_domains": ["rack", "zone"],
    }
    refused = pair(body, "ctx2", "gen0")
    assert refused["status"] == "compatible"
    assert refused["pairing"]["allowed"] is False
    assert refused["pairing"]["exclusion"]["code"] == "topology_domain_required"
    assert pair(body, "ctx4", "gen0")["pairing"]["allowed"] is False


async def test_policies_are_checked_stored_and_cleared(client: Client) -> None:
    assert (await policy(client, {"require": ["zone"]}))[0] == 404  # no such deployment yet
    await register(client, "ctx0", 0, placed(zone="a"))
    status, problem = await policy(client, {"require": ["zone"], "prefer": ["zone"]})
    assert (status, problem["code"], problem["field"]) == (
        422,
        "invalid_document",
        "pairing.prefer",
    )
    status, problem = await policy(client, {"require": ["Zone!"]})
    assert status in (400, 422)
    status, problem = await policy(client, {"require": ["zone"], "extra": 1})
    assert status in (400, 422)
    read = await (await client.get(DEPLOYMENT, headers=ADMIN)).json()
    assert "pairing" not in read  # nothing stored by the refusals
    assert (await policy(client, {"require": ["zone"]}))[0] == 200
    read = await (await client.get(DEPLOYMENT, headers=ADMIN)).json()
    assert read["pairing"] == {"require": ["zone"], "prefer": []}
    status, cleared = await policy(client, None)
    assert status == 200
    assert "pairing" not in cleared
    worker = await client.patch(DEPLOYMENT, json={"pairing": None}, headers=WORKER)
    assert worker.status == 403


async def test_the_pairs_of_an_unknown_instance_or_deployment_are_404(client: Client) -> None:
    assert (await client.get(PAIRS, headers=WORKER)).status == 404
    await register(client, "ctx0", 0, placed())
    assert (await client.get(PAIRS + "?generation=gen9", headers=WORKER)).status == 404
    assert (await client.get(PAIRS + "?generation=ctx0", headers=WORKER)).status == 404


async def test_routers_read_the_pairs_through_the_client(client: Client) -> None:
    await fleet(client)
    await policy(client, {"require": ["zone"], "prefer": ["rack"]})
    url = str(client.make_url("/"))
    async with AsyncKvrouteClient(url, token=WORKER_TOKEN) as kvroute:
        answer = await kvroute.pairs("llama", generation="gen0")
    assert isinstance(answer, wire.Pairs)
    (gen0,) = answer.generation
    assert [choice.context for choice in gen0.pairs] == ["ctx0", "ctx5", "ctx1"]
    assert gen0.excluded[0] == wire.PairExclusion(
        context="ctx2",
        code="topology_domain_required",
        detail=gen0.excluded[0].detail,
        field="topology.zone",
        local="a",
        peer="b",
    )
