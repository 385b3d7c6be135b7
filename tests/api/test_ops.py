"""Operations: probes, metrics, the served spec, graceful drain."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvroute.api import create_app
from kvroute.api.access import JsonFormatter
from kvroute.settings import Settings
from tests.api.conftest import ADMIN, WORKER, rank_path, register
from tests.api.documents import rank_document

SPEC_PATH = Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml"
# Nothing listens on port 1; connecting fails at once.
UNREACHABLE_DATABASE = "postgresql+asyncpg://postgres@127.0.0.1:1/kvroute"


async def test_healthz_and_readyz(client):
    assert await (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert await ready.json() == {
        "status": "ready",
        "checks": {"database": "ok", "draining": "ok", "transfer_pool": "ok"},
    }


async def test_metrics_expose_kvroute_families(client):
    await register(client, "ctx0", 0, rank_document())
    text = await (await client.get("/metrics")).text()
    for family in (
        "kvroute_registrations_total",
        "kvroute_rejections_total",
        "kvroute_live_ranks",
        "kvroute_http_request_duration_seconds_bucket",
        "kvroute_build_info",
    ):
        assert family in text, family
    assert 'kvroute_live_ranks{deployment="llama",instance="ctx0"} 1.0' in text
    assert "kvroute_database_up 1.0" in text
    assert "_created" not in text
    route = "/v1/deployments/{deployment}/instances/{instance}/ranks/{rank}"
    assert f'route="{route}",status_class="2xx"' in text


async def test_served_spec_is_the_contract(client):
    response = await client.get("/v1/openapi.yaml")
    assert response.status == 200
    assert yaml.safe_load(await response.read()) == yaml.safe_load(SPEC_PATH.read_bytes())


async def test_drain_refuses_mutations_and_fails_readiness(client):
    await client.app.shutdown()  # runs on_shutdown, as run_app does on SIGTERM
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["checks"]["draining"] != "ok"
    refused = await client.put(rank_path("ctx0", 0), json=rank_document(), headers=WORKER)
    assert refused.status == 503
    assert (await refused.json(content_type=None))["code"] == "draining"
    assert (await client.get("/v1/deployments", headers=ADMIN)).status == 200


async def test_unreachable_database_is_503_not_500(aiohttp_client):
    client = await aiohttp_client(
        create_app(Settings(database_url=UNREACHABLE_DATABASE, readiness_timeout_seconds=2))
    )
    ready = await client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["checks"]["database"] != "ok"
    response = await client.put(rank_path("ctx0", 0), json=rank_document())
    assert response.status == 503
    assert (await response.json(content_type=None))["code"] == "database_unavailable"
    scrape = await client.get("/metrics")
    assert scrape.status == 200
    assert "kvroute_database_up 0.0" in await scrape.text()


async def test_one_access_line_per_request_with_its_request_id(client, caplog):
    caplog.set_level("INFO", logger="kvroute.access")
    await client.get("/v1/deployments/nope", headers={**ADMIN, "X-Request-ID": "req-7"})
    lines = [record for record in caplog.records if record.name == "kvroute.access"]
    assert len(lines) == 1
    fields = lines[0].http
    assert (fields["status"], fields["route"], fields["method"]) == (
        404,
        "/v1/deployments/{deployment}",
        "GET",
    )
    assert fields["request_id"] == "req-7"


async def test_access_line_of_a_refusal_names_its_code_and_field(client, caplog):
    caplog.set_level("INFO", logger="kvroute.access")
    await register(client, "ctx0", 0, rank_document(head_dim=16))
    assert (await register(client, "gen0", 0, rank_document(role="generation", head_dim=32)))[
        0
    ] == 409
    record = [r for r in caplog.records if r.name == "kvroute.access"][-1]
    refused = record.http
    assert (refused["status"], refused["code"], refused["field"]) == (
        409,
        "head_dim_mismatch",
        "attention.head_dim",
    )
    line = JsonFormatter().format(record)
    assert '"code": "head_dim_mismatch", "field": "attention.head_dim"' in line


async def test_metrics_label_ranks_by_deployment_and_instance(client):
    for rank in range(2):
        await register(client, "ctx0", rank, rank_document(tp_size=2, tp_rank=rank))
    await register(client, "gen0", 0, rank_document(role="generation"), deployment="other")
    await client.delete(rank_path("ctx0", 1), headers=ADMIN)
    text = await (await client.get("/metrics")).text()
    assert 'kvroute_live_ranks{deployment="llama",instance="ctx0"} 1.0' in text
    assert 'kvroute_live_ranks{deployment="other",instance="gen0"} 1.0' in text
    assert 'kvroute_expired_ranks{deployment="llama",instance="ctx0"} 0.0' in text
