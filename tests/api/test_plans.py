"""Plans over HTTP on both databases: shape, formats, ETags, batches, refusals and cache validity.

The deployment is the example of docs/api.md "Plans" in miniature: context TP4 and generation TP2 with 8 target KV
heads and one draft layer of 1 head, so generation rank 0 hears from context ranks 0 and 1.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvroute.control.plan_answers import PLAN_BUILD_BUCKETS_SECONDS
from kvroute.geometry import Plan
from kvroute.pictures import plan_svg
from kvroute.render import plan_text
from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.documents import rank_document
from tests.clock import ManualClock

Client = TestClient[web.Request, web.Application]
PLANS = "/v1/deployments/llama/plans"
PLAN_SETS = "/v1/deployments/llama/plan-sets"
SVG = "{http://www.w3.org/2000/svg}"


def ctx_doc(rank: int, **changes: Any) -> dict[str, Any]:
    return rank_document(tp_size=4, tp_rank=rank, num_draft_layers=1, **changes)


def gen_doc(rank: int, **changes: Any) -> dict[str, Any]:
    return rank_document(role="generation", tp_size=2, tp_rank=rank, num_draft_layers=1, **changes)


async def deploy(client: Client, *, ctx_lease: int = 30, gen_lease: int = 30) -> None:
    for rank in range(4):
        assert (await register(client, "ctx0", rank, ctx_doc(rank, lease_seconds=ctx_lease)))[
            0
        ] == 201
    for rank in range(2):
        assert (await register(client, "gen0", rank, gen_doc(rank, lease_seconds=gen_lease)))[
            0
        ] == 201


async def fetch(
    client: Client, rank: int = 0, *, headers: dict[str, str] | None = None, **params: str
) -> Any:
    query = {"sender": "ctx0", "receiver": "gen0", "receiver_rank": str(rank), **params}
    return await client.get(PLANS, params=query, headers=WORKER if headers is None else headers)


async def plan(client: Client, rank: int = 0) -> dict[str, Any]:
    response = await fetch(client, rank)
    assert response.status == 200, await response.text()
    return dict(await response.json())


async def metric(client: Client, name: str, **labels: str) -> float:
    text = await (await client.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def test_plan_names_its_writers_generations_and_fingerprint(client: Client) -> None:
    await deploy(client)
    response = await fetch(client, 0)
    assert response.status == 200
    assert response.content_type == "application/json"
    body = await response.json()
    assert body["deployment"] == "llama"
    assert body["sender"] == {
        "instance": "ctx0",
        "dp_rank": 0,
        "tp_size": 4,
        "pp_size": 1,
        "generations": {"0": 1, "1": 1, "2": 1, "3": 1},
    }
    assert body["receiver"] == {
        "instance": "gen0",
        "rank": 0,
        "tp_size": 2,
        "pp_size": 1,
        "generation": 1,
    }
    assert body["fingerprint"].startswith("sha256:")
    assert [(p["rank"], p["sends"]) for p in body["peers"]] == [(0, True), (1, True)]
    owners = [
        [view["owner"] for view in peer["views"] if view["fragments"]] for peer in body["peers"]
    ]
    assert owners == [["target", "draft"], ["target"]]
    assert body["expected_writers"] == 2
    assert response.headers["ETag"].startswith('"' + body["fingerprint"].removeprefix("sha256:"))


async def test_if_none_match_answers_304_until_the_plan_changes(client: Client) -> None:
    await deploy(client)
    etag = (await fetch(client, 0)).headers["ETag"]
    unchanged = await fetch(client, 0, headers={**WORKER, "If-None-Match": f'W/"x", {etag}'})
    assert (unchanged.status, unchanged.headers["ETag"]) == (304, etag)
    assert await unchanged.read() == b""
    assert (await register(client, "ctx0", 2, ctx_doc(2, head_dim=16, lease_seconds=29)))[0] == 200
    changed = await fetch(client, 0, headers={**WORKER, "If-None-Match": etag})
    assert changed.status == 200
    assert changed.headers["ETag"] != etag
    assert (await changed.json())["sender"]["generations"]["2"] == 2
    assert await metric(client, "kvroute_plan_requests_total", result="not_modified") == 1


async def test_changed_document_rebuilds_with_the_new_generation(client: Client) -> None:
    await deploy(client)
    before = await plan(client, 0)
    changed = ctx_doc(1)
    changed["pools"][0]["num_slots"] = 32
    status, registered = await register(client, "ctx0", 1, changed)
    assert (status, registered["generation"]) == (200, 2)
    after = await plan(client, 0)
    assert after["sender"]["generations"] == {"0": 1, "1": 2, "2": 1, "3": 1}
    assert after["fingerprint"] != before["fingerprint"]
    # The plan names exactly the generations the registry holds: it mixes no older document.
    for rank, generation in after["sender"]["generations"].items():
        stored = await (await client.get(rank_path("ctx0", int(rank)), headers=ADMIN)).json()
        assert stored["generation"] == generation


async def test_identical_reregistration_is_a_cache_hit(client: Client) -> None:
    await deploy(client)
    first = await fetch(client, 1)
    hits = await metric(client, "kvroute_plan_cache_hits_total")
    assert (await register(client, "ctx0", 3, ctx_doc(3)))[0] == 200
    again = await fetch(client, 1)
    assert await again.read() == await first.read()
    assert again.headers["ETag"] == first.headers["ETag"]
    assert await metric(client, "kvroute_plan_cache_hits_total") == hits + 1


async def _conflict(client: Client) -> dict[str, Any]:
    response = await fetch(client, 0)
    assert response.status == 409
    return dict(await response.json())


async def test_expired_sender_ranks_are_named(client: Client, clock: ManualClock) -> None:
    for rank in range(4):
        await register(client, "ctx0", rank, ctx_doc(rank, lease_seconds=1 if rank >= 2 else 30))
    for rank in range(2):
        await register(client, "gen0", rank, gen_doc(rank))
    assert (await fetch(client, 0)).status == 200
    clock.advance(1)
    problem = await _conflict(client)
    assert problem["detail"] == (
        "sender instance ctx0 has ranks 0,1 of 4 live (missing or expired: 2,3)"
    )
    assert await metric(client, "kvroute_plan_requests_total", result="unavailable") >= 1


async def test_expired_receiver_rank_is_named(client: Client, clock: ManualClock) -> None:
    await deploy(client, gen_lease=1)
    assert (await fetch(client, 0)).status == 200
    clock.advance(1)
    problem = await _conflict(client)
    assert problem["detail"] == "receiver instance gen0 rank 0 is expired"
    # Its own code: a worker told this keeps the plan it holds (nothing said of the sender).
    assert problem["code"] == "receiver_not_live"


async def test_deleted_ranks_make_the_plan_unavailable(client: Client) -> None:
    await deploy(client)
    await plan(client, 0)
    assert (await client.delete(rank_path("ctx0", 3), headers=ADMIN)).status == 204
    response = await fetch(client, 0)
    assert response.status == 409
    assert response.content_type == "application/problem+json"
    assert "(missing or expired: 3)" in (await response.json())["detail"]
    await register(client, "ctx0", 3, ctx_doc(3))
    assert (await client.delete(rank_path("gen0", 0), headers=ADMIN)).status == 204
    gone = await (await fetch(client, 0)).json()
    assert gone["detail"] == "receiver instance gen0 rank 0 is not registered"
    assert gone["code"] == "receiver_not_live"
    assert (await fetch(client, 1)).status == 200


async def test_text_and_svg_formats(client: Client) -> None:
    await deploy(client)
    text = await fetch(client, 0, format="text")
    assert text.content_type == "text/plain"
    table = await text.text()
    assert table.startswith("plan llama: ctx0 (dp group 0) -> gen0 rank 0 (generation 1)")
    assert "expected writers 2" in table
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [(row[0], row[2], row[3]) for row in rows] == [
        ("0", "0->0", "target"),
        ("0", "1->1", "draft"),
        ("1", "0->0", "target"),
    ]
    svg = await fetch(client, 1, format="svg")
    assert svg.content_type == "image/svg+xml"
    root = ET.fromstring(await svg.text())
    assert root.tag == f"{SVG}svg"
    cells = [title.text for title in root.iter(f"{SVG}title")]
    assert "head 4, layers 0-3: sender rank 2" in cells
    assert "head 7, layers 0-3: sender rank 3" in cells
    assert len({svg.headers["ETag"], text.headers["ETag"]}) == 2


async def test_plan_set_holds_every_receiver_rank(client: Client) -> None:
    await deploy(client)
    params = {"sender": "ctx0", "receiver": "gen0"}
    response = await client.get(PLAN_SETS, params=params, headers=WORKER)
    assert response.status == 200
    body = await response.json()
    assert (body["deployment"], body["sender"], body["receiver"]) == ("llama", "ctx0", "gen0")
    assert body["plans"] == [await plan(client, 0), await plan(client, 1)]
    text = await client.get(PLAN_SETS, params={**params, "format": "text"}, headers=WORKER)
    assert (await text.text()).count("plan llama: ctx0") == 2

    assert (await client.delete(rank_path("gen0", 1), headers=ADMIN)).status == 204
    incomplete = await client.get(PLAN_SETS, params=params, headers=WORKER)
    assert incomplete.status == 409
    assert (await incomplete.json())["detail"] == (
        "receiver instance gen0 has ranks 0 of 2 live (missing or expired: 1)"
    )


async def test_refusals_are_problems(client: Client) -> None:
    await deploy(client)
    swapped = await client.get(
        PLANS, params={"sender": "gen0", "receiver": "ctx0", "receiver_rank": "0"}, headers=WORKER
    )
    assert swapped.status == 409
    problem = await swapped.json()
    assert (problem["code"], problem["field"]) == ("plan_roles_invalid", "sender")
    unknown = await client.get(
        PLANS, params={"sender": "ctx9", "receiver": "gen0", "receiver_rank": "0"}, headers=WORKER
    )
    assert unknown.status == 404
    assert "ctx9" in (await unknown.json())["detail"]
    typo = await fetch(client, 0, fromat="svg")
    assert (typo.status, (await typo.json())["field"]) == (422, "query.fromat")
    bad_format = await fetch(client, 0, format="png")
    assert bad_format.status in (400, 422)
    assert (await client.get(PLANS, params={"sender": "ctx0"}, headers=WORKER)).status in (400, 422)
    assert await metric(client, "kvroute_plan_requests_total", result="incompatible") == 1
    assert await metric(client, "kvroute_plan_requests_total", result="not_found") == 1


async def test_plan_endpoints_need_the_worker_token(client: Client) -> None:
    await deploy(client)
    pair = {"sender": "ctx0", "receiver": "gen0"}
    for path, query in ((PLANS, {**pair, "receiver_rank": "0"}), (PLAN_SETS, pair)):
        assert (await client.get(path, params=query)).status == 401
        for token in (WORKER, ADMIN):
            assert (await client.get(path, params=query, headers=token)).status == 200


async def test_plan_metrics_are_exported(client: Client) -> None:
    await deploy(client)
    built = await plan(client, 0)
    await plan(client, 0)
    text = await (await client.get("/metrics")).text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {
        "kvroute_plan_requests",
        "kvroute_plan_cache_hits",
        "kvroute_plan_build_seconds",
    } <= set(families)
    assert await metric(client, "kvroute_plan_requests_total", result="ok") == 2
    assert await metric(client, "kvroute_plan_cache_hits_total") == 1
    assert await metric(client, "kvroute_plan_build_seconds_count") == 1
    bounds = [
        s.labels["le"] for s in families["kvroute_plan_build_seconds"].samples if "le" in s.labels
    ]
    assert len(bounds) == len(PLAN_BUILD_BUCKETS_SECONDS) + 1
    assert await metric(client, "kvroute_plan_fragments_sum") == built["fragments_per_block"]


async def test_the_period_form_is_asked_for_and_tagged_apart(client: Client) -> None:
    await deploy(client)
    block = await fetch(client)
    period = await fetch(client, fragments="period")
    assert period.status == 200, await period.text()
    block_doc, period_doc = await block.json(), await period.json()
    assert period.headers["ETag"] != block.headers["ETag"]
    assert period.headers["ETag"].endswith('-json-period"')
    for by_block, by_period in zip(block_doc["peers"], period_doc["peers"], strict=True):
        for view_block, view_period in zip(by_block["views"], by_period["views"], strict=True):
            assert "period_fragments" not in view_block
            assert "fragments" not in view_period
            assert (view_period["period_tokens"], view_period["src_blocks_per_period"]) == (4, 1)
            assert view_period["bytes_per_block"] == view_block["bytes_per_block"]
    again = await fetch(
        client, fragments="period", headers={**WORKER, "If-None-Match": period.headers["ETag"]}
    )
    assert again.status == 304
    sets = await client.get(
        PLAN_SETS,
        params={"sender": "ctx0", "receiver": "gen0", "fragments": "period"},
        headers=WORKER,
    )
    assert sets.status == 200
    assert all(
        "period_fragments" in view
        for plan_doc in (await sets.json())["plans"]
        for peer in plan_doc["peers"]
        for view in peer["views"]
    )


async def test_every_format_of_a_form_renders_the_document_of_that_form(client: Client) -> None:
    """The table and the picture are rendered from the typed plan; a worker renders the JSON it
    fetched, read back: both must be the same, in the block and the period form."""
    await deploy(client)
    for form in ({}, {"fragments": "period"}):
        document = await (await fetch(client, **form)).json()
        read = Plan.from_json(document)
        text = await fetch(client, format="text", **form)
        svg = await fetch(client, format="svg", **form)
        assert (text.status, svg.status) == (200, 200)
        assert await text.text() == plan_text(read)
        assert await svg.text() == plan_svg(read)


async def test_different_block_sizes_plan_by_period_over_http(client: Client) -> None:
    for rank in range(4):
        assert (await register(client, "ctx0", rank, ctx_doc(rank)))[0] == 201
    for rank in range(2):
        document = gen_doc(rank, tokens_per_block=16)
        assert (await register(client, "gen0", rank, document))[0] == 201

    document = await plan(client)

    views = [view for peer in document["peers"] for view in peer["views"]]
    assert views
    assert all(view["period_tokens"] == 16 for view in views)
    assert all((v["src_blocks_per_period"], v["dst_blocks_per_period"]) == (4, 1) for v in views)
    assert document["fanin_bounce_safe"] is False
    text = await (await fetch(client, format="text")).text()
    assert "period view 0: 16 tokens = 4 sender blocks of 4 -> 1 receiver blocks of 16" in text


async def test_a_zigzag_context_plan_is_built_per_prompt_length(client: Client) -> None:
    for cp_rank in range(2):
        document = rank_document(num_draft_layers=1)
        document.update(cp_size=2, cp_rank=cp_rank, cp_layout="zigzag")
        assert (await register(client, "ctx0", cp_rank, document))[0] == 201
    generation = rank_document(role="generation", num_draft_layers=1)
    assert (await register(client, "gen0", 0, generation))[0] == 201
    instance = await client.get("/v1/deployments/llama/instances/ctx0", headers=ADMIN)
    assert (await instance.json())["cp_size"] == 2
    listed = await client.get("/v1/deployments/llama/instances", headers=ADMIN)
    assert {i["name"]: i["cp_size"] for i in (await listed.json())["instances"]} == {
        "ctx0": 2,
        "gen0": 1,
    }
    missing = await fetch(client, 0)
    assert missing.status == 422
    problem = await missing.json()
    assert (problem["code"], problem["field"], problem["local"], problem["peer"]) == (
        "prompt_tokens_required",
        "prompt_tokens",
        None,
        "zigzag",
    )
    bodies = {}
    for prompt in (9, 10, 9):
        response = await fetch(client, 0, prompt_tokens=str(prompt))
        assert response.status == 200, await response.text()
        bodies.setdefault(prompt, []).append(await response.json())
    assert bodies[9][0] == bodies[9][1]  # cached per prompt length
    assert bodies[9][0]["fingerprint"] != bodies[10][0]["fingerprint"]
    for prompt, (body, *_) in bodies.items():
        assert body["prompt_tokens"] == prompt
        views = [v for peer in body["peers"] for v in peer["views"]]
        # Every prompt token once, from the CP rank holding it.
        held = sorted(
            t
            for v in views
            if v["dst_view"] == 0
            for f in v["period_fragments"]
            for t in range(f[5], f[5] + f[6])
        )
        assert set(held) == set(range(prompt))
        assert len(set(Counter(held).values())) == 1  # each token in every moved row once
        assert {v["src_cp"]["layout"] for v in views} == {"zigzag"}


def _with_scales(document: dict[str, Any]) -> dict[str, Any]:
    """The rank's KV view and, after it in the slot, 4-bit block scales of its heads: half a byte
    per token-head, so its bytes per layer are not whole token rows."""
    kv = document["views"][0]
    heads, layers = kv["num_kv_heads"], kv["layers"]
    per_layer = 2 * heads * document["tokens_per_block"] // 2
    pool = document["pools"][0]
    at = pool["slot_bytes"]
    scales = {
        **{key: kv[key] for key in ("pool_id", "kind", "owner", "num_kv_heads", "total_kv_heads")},
        "view_id": 2,
        "roles": ["key_block_scale", "value_block_scale"],
        "dtype": "float4_e2m1",
        "buffers_per_layer": 2,
        "bytes_per_layer": per_layer,
        "layers": [
            {"layer": s["layer"], "offset": at + i * per_layer} for i, s in enumerate(layers)
        ],
    }
    pool["slot_bytes"] = pool["slot_stride"] = at + len(layers) * per_layer
    return document | {"views": [*document["views"], scales]}


async def test_sub_byte_rows_keep_their_block_form_in_a_period_answer_and_say_so(
    client: Client,
) -> None:
    """Issue 35: such a pair has no period form; the answer is 200, the ordinary pairs in their
    period form and this one in its block form, marked ``token_rows: false``, and the client's
    plan reader takes it (a worker may re-cut exactly the pairs without the mark)."""
    for rank in range(4):
        assert (await register(client, "ctx0", rank, _with_scales(ctx_doc(rank))))[0] == 201
    for rank in range(2):
        assert (await register(client, "gen0", rank, _with_scales(gen_doc(rank))))[0] == 201

    for form in ("block", "period"):
        response = await fetch(client, fragments=form)
        assert response.status == 200, await response.text()
        document = await response.json()
        views = [view for peer in document["peers"] for view in peer["views"]]
        scales = [view for view in views if view["src_view"] == 2]
        others = [view for view in views if view["src_view"] != 2]
        assert scales
        assert others
        assert all(v["token_rows"] is False and "fragments" in v for v in scales)
        assert all("token_rows" not in v for v in others)
        assert all(("period_fragments" in v) is (form == "period") for v in others)
        plan_read = Plan.from_json(document)
        read = {v.src_view: v.token_rows for p in plan_read.peers for v in p.views}
        assert read == {0: True, 1: True, 2: False}
        assert plan_read.to_json(period=form == "period") == document
