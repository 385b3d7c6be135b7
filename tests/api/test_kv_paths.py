"""KV integrity per transfer path over HTTP, on both databases: workers report canary and digest
outcomes, the pairs answer leaves out a pair with a failed path, a re-registration makes the
outcome stale (and lifts the exclusion), and events and metrics show failures."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from kvroute.client.integrity import path_report
from kvroute.client.kv_digest import Grid, KvDigest, Mismatch
from kvroute.client.kv_rows import RowKey
from kvroute.client.kv_state import StateKey
from tests.api.conftest import ADMIN, WORKER, register
from tests.api.test_pairs import by_instance, pairs, placed

Client = TestClient[web.Request, web.Application]
PATHS = "/v1/deployments/llama/kv-paths"
ELEMENT = {"layer": 3, "head": 5, "kv": "V", "token": 17, "detail": "layer 3 head 5 V, token 17"}


async def report(client: Client, **members: Any) -> tuple[int, dict[str, Any]]:
    body = {"producer": "ctx0", "consumer": "gen0", "consumer_rank": 0, "source": "canary"}
    response = await client.post(PATHS, json=body | members, headers=WORKER)
    return response.status, await response.json(content_type=None)


async def paths(client: Client) -> list[dict[str, Any]]:
    response = await client.get(PATHS, headers=WORKER)
    assert response.status == 200, await response.text()
    return list((await response.json())["paths"])


async def two_pairs(client: Client) -> None:
    for name, doc in (
        ("ctx0", placed()),
        ("ctx1", placed()),
        ("gen0", placed("generation")),
    ):
        status, body = await register(client, name, 0, doc)
        assert status == 201, body


async def test_a_failed_canary_excludes_the_pair_until_a_side_registers_again(
    client: Client,
) -> None:
    await two_pairs(client)
    status, body = await report(client, state="attested", cost_ms=4.5)
    assert status == 201, body
    assert (body["state"], body["producer_generations"], body["cost_ms"]) == (
        "attested",
        {"0": 1},
        4.5,
    )
    assert [c["context"] for c in by_instance(await pairs(client), "gen0")["pairs"]] == [
        "ctx0",
        "ctx1",
    ]
    status, body = await report(client, state="failed", element=ELEMENT)
    assert status == 201, body
    gen0 = by_instance(await pairs(client), "gen0")
    assert [c["context"] for c in gen0["pairs"]] == ["ctx1"]
    (excluded,) = gen0["excluded"]
    assert excluded["context"] == "ctx0"
    assert excluded["code"] == "kv_path_failed"
    assert "layer 3 head 5 V, token 17" in excluded["detail"]
    assert excluded["local"] == {"rank": 0, "element": ELEMENT}
    (path,) = await paths(client)
    assert (path["state"], path["reported"], path["element"]) == ("failed", "failed", ELEMENT)
    # A request whose digests agree (or another canary) over the same registrations does not
    # lift the failure: the worker is answered with it, and the pair stays out.
    status, body = await report(client, state="attested", source="digest")
    assert (status, body["state"], body["source"], body["element"]) == (
        201,
        "failed",
        "canary",
        ELEMENT,
    )
    assert [c["context"] for c in by_instance(await pairs(client), "gen0")["pairs"]] == ["ctx1"]
    # The producer registers again (a changed document, a new generation): the failure no
    # longer holds, the pair is routable, and the path waits for its next canary.
    changed = placed()
    changed["pools"][0]["num_slots"] += 1
    status, _ = await register(client, "ctx0", 0, changed)
    assert status == 200
    (path,) = await paths(client)
    assert (path["state"], path["reported"], path["producer_generations"]) == (
        "stale",
        "failed",
        {"0": 1},
    )
    assert [c["context"] for c in by_instance(await pairs(client), "gen0")["pairs"]] == [
        "ctx0",
        "ctx1",
    ]
    status, body = await report(client, state="attested")
    assert (status, body["state"], body["producer_generations"]) == (201, "attested", {"0": 2})


async def test_a_digest_mismatch_counts_and_appends_an_event(client: Client) -> None:
    await two_pairs(client)
    status, body = await report(client, state="failed", source="digest", element=ELEMENT)
    assert status == 201, body
    metrics = await (await client.get("/metrics")).text()
    assert 'kvroute_kv_digest_mismatch_total{consumer="gen0",producer="ctx0"} 1.0' in metrics
    assert 'kvroute_kv_path_attestations{deployment="llama",state="failed"} 1.0' in metrics
    params = {"since": "0", "follow": "false"}
    response = await client.get("/v1/deployments/llama/events", headers=WORKER, params=params)
    text = await response.text()
    assert "kv_path_failed" in text, text


async def test_reports_of_paths_that_are_not_live_or_malformed_are_4xx(client: Client) -> None:
    await two_pairs(client)
    status, body = await report(client, state="attested", producer="nobody")
    assert status == 404, body
    assert "nobody" in body["detail"]
    status, body = await report(client, state="attested", consumer_rank=3)
    assert status == 404, body
    status, body = await report(client, state="maybe")
    assert (status, body["detail"]) == (422, 'state: "maybe" is not one of "attested" or "failed"')
    status, body = await report(client, state="failed", element={"layer": 1})
    assert status == 422, body
    assert "element" in body["detail"], body


async def test_producer_digests_are_stored_per_rank_and_read_by_request(client: Client) -> None:
    digests = "/v1/deployments/llama/kv-digests"
    digest = {"tokens": [0, 40], "chunk": 256, "rows": [["target", "key,value", 0, 1, 0, ["00ff"]]]}
    for rank in (1, 0, 1):
        body = {"producer": "ctx0", "request_id": "req-1", "rank": rank, "digest": digest}
        response = await client.post(digests, json=body, headers=WORKER)
        assert response.status == 204, await response.text()
    query = {"producer": "ctx0", "request_id": "req-1"}
    response = await client.get(digests, params=query, headers=WORKER)
    body = await response.json()
    assert [item["rank"] for item in body["ranks"]] == [0, 1]
    assert body["ranks"][0]["digest"] == digest
    response = await client.get(digests, params={**query, "request_id": "other"}, headers=WORKER)
    assert (await response.json())["ranks"] == []
    bad = {"producer": "ctx0", "request_id": "req-1", "rank": 0, "digest": {"tokens": [0]}}
    response = await client.post(digests, json=bad, headers=WORKER)
    assert response.status == 422
    response = await client.get(digests, params={"producer": "ctx0"}, headers=WORKER)
    assert response.status == 422
    assert "request_id" in (await response.json())["detail"]


async def test_state_elements_and_hybrid_digests_are_accepted(client: Client) -> None:
    """What a hybrid worker sends: a failed state canary naming the conv part and byte, and a
    digest with a windowed series' first token and state units (``client.kv_digest``'s JSON)."""
    await two_pairs(client)
    key = StateKey("target", "conv", "conv", 4, 1, 3)
    element = path_report("ctx0", "gen0", 0, "canary", Mismatch(key, byte=7))["element"]
    status, body = await report(client, state="failed", element=element)
    assert status == 201, body
    detail = "target conv layer 4 conv section 1 part 3, byte 7"
    assert body["element"] == {
        "layer": 4, "head": 3, "state": "conv", "section": 1, "byte": 7, "detail": detail,
    }  # fmt: skip
    row = RowKey("target", "key,value", 5, 0, 1)
    digest = KvDigest((0, 40), 8, {row: [1, 2]}, {row: 30}, {key: 0xFF})
    upload = {"producer": "ctx0", "request_id": "req-2", "rank": 0, "digest": digest.to_json()}
    response = await client.post("/v1/deployments/llama/kv-digests", json=upload, headers=WORKER)
    assert response.status == 204, await response.text()
    query = {"producer": "ctx0", "request_id": "req-2"}
    response = await client.get("/v1/deployments/llama/kv-digests", params=query, headers=WORKER)
    assert KvDigest.from_json((await response.json())["ranks"][0]["digest"]) == digest
    # A window cut on a grid (every 4 tokens back from the prompt's end) names its series.
    digest.grid, digest.gridded = Grid(4, 40), {row}
    upload = {**upload, "request_id": "req-3", "digest": digest.to_json()}
    response = await client.post("/v1/deployments/llama/kv-digests", json=upload, headers=WORKER)
    assert response.status == 204, await response.text()
    query["request_id"] = "req-3"
    response = await client.get("/v1/deployments/llama/kv-digests", params=query, headers=WORKER)
    assert KvDigest.from_json((await response.json())["ranks"][0]["digest"]) == digest
    upload["digest"]["grid"]["step"] = 0
    response = await client.post("/v1/deployments/llama/kv-digests", json=upload, headers=WORKER)
    assert response.status == 422
    assert "step" in (await response.json())["detail"]


async def test_an_instance_deleted_for_good_takes_its_paths_with_it(client: Client) -> None:
    """Deleting an instance (or its last rank) drops the paths it is a side of; the others stay."""
    await two_pairs(client)
    for producer in ("ctx0", "ctx1"):
        status, body = await report(client, producer=producer, state="failed", element=ELEMENT)
        assert status == 201, body
    deleted = await client.delete("/v1/deployments/llama/instances/ctx0/ranks/0", headers=ADMIN)
    assert deleted.status == 204
    assert [p["producer"] for p in await paths(client)] == ["ctx1"]
    deleted = await client.delete("/v1/deployments/llama/instances/gen0", headers=ADMIN)
    assert deleted.status == 204
    assert await paths(client) == []
