"""Operations: probes, metrics, the served spec, graceful drain."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvroute.api import create_app
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
    assert "kvroute_live_ranks 1.0" in text
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
    assert (await client.get("/metrics")).status == 200


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
