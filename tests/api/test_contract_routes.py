"""The router and the OpenAPI document describe the same operations, each with a scope."""

from __future__ import annotations

from pathlib import Path

import yaml
from aiohttp import web

from kvroute.api import create_app
from kvroute.api.keys import route_scopes_key
from kvroute.api.spec import spec_bytes, spec_operations
from kvroute.settings import Settings
from tests.api.conftest import ADMIN, ADMIN_TOKEN, WORKER, WORKER_TOKEN

SPEC_PATH = Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml"


def _app(tmp_path: Path) -> web.Application:
    return create_app(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/unused.db"))


def _router_operations(app: web.Application) -> set[tuple[str, str]]:
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
    }


def test_every_route_is_in_the_spec_and_vice_versa(tmp_path):
    app = _app(tmp_path)
    spec = yaml.safe_load(SPEC_PATH.read_bytes())
    assert _router_operations(app) == spec_operations(spec)


async def test_a_route_missing_from_the_scope_table_needs_the_admin_token(aiohttp_client, tmp_path):
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/unused.db",
        worker_token=WORKER_TOKEN,
        admin_token=ADMIN_TOKEN,
    )
    app = create_app(settings)

    async def unlisted(request: web.Request) -> web.Response:
        return web.Response(text="reached")

    app.router.add_get("/v1/unlisted", unlisted)  # a route added without a scope entry
    client = await aiohttp_client(app)

    assert (await client.get("/v1/unlisted")).status == 401
    assert (await client.get("/v1/unlisted", headers=WORKER)).status == 403
    # The admin token passes auth; the spec, which does not declare the route, still refuses it.
    assert (await client.get("/v1/unlisted", headers=ADMIN)).status in (404, 405)


def test_public_operations_are_the_ones_the_spec_leaves_unsecured(tmp_path):
    app = _app(tmp_path)
    spec = yaml.safe_load(SPEC_PATH.read_bytes())
    unsecured = {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method, operation in item.items()
        if isinstance(operation, dict) and operation.get("security") == []
    }
    public = {key for key, scope in app[route_scopes_key].items() if scope == "public"}
    assert public == unsecured


def test_packaged_spec_is_the_repository_spec():
    assert spec_bytes() == SPEC_PATH.read_bytes()


def test_every_operation_with_a_path_parameter_documents_the_422_its_validation_answers():
    """A path parameter outside its pattern (a deployment name with a space) is answered 422 by
    the request validator before any handler runs, so each such operation must say so."""
    spec = yaml.safe_load(SPEC_PATH.read_bytes())
    shared = spec["components"]["parameters"]
    undocumented = []
    for path, item in spec["paths"].items():
        declared = [shared[p["$ref"].rsplit("/", 1)[1]] if "$ref" in p else p
                    for p in item.get("parameters", [])]  # fmt: skip
        for method, operation in item.items():
            if method == "parameters":
                continue
            params = declared + [
                shared[p["$ref"].rsplit("/", 1)[1]] if "$ref" in p else p
                for p in operation.get("parameters", [])
            ]
            if any(p["in"] == "path" for p in params) and "422" not in operation["responses"]:
                undocumented.append(f"{method.upper()} {path}")
    assert not undocumented, undocumented
