"""The router and the OpenAPI document describe the same operations, each with a scope."""

from __future__ import annotations

from pathlib import Path

import yaml
from aiohttp import web

from kvroute.api import create_app
from kvroute.api.keys import route_scopes_key
from kvroute.api.spec import spec_bytes, spec_operations
from kvroute.settings import Settings

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


def test_every_route_has_a_declared_scope(tmp_path):
    app = _app(tmp_path)
    assert set(app[route_scopes_key]) == _router_operations(app)


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
