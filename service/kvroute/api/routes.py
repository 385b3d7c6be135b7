"""The route table: every operation with its handler and access scope.

One table feeds both the router and the auth middleware, so an operation cannot exist
without a declared scope; a test checks the table against ``api_spec/openapi.yaml``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from kvroute.api import (
    compatibility,
    console,
    events,
    inventory,
    kv_paths,
    leases,
    ops,
    pairing,
    plans,
    preflight,
    registration,
    transfers,
)
from kvroute.api.keys import route_scopes_key
from kvroute.api.scopes import Scope

RANK = "/v1/deployments/{deployment}/instances/{instance}/ranks/{rank}"
INSTANCE = "/v1/deployments/{deployment}/instances/{instance}"
DEPLOYMENT = "/v1/deployments/{deployment}"
TRANSFER = "/v1/transfers/{job_id}"
LEASE = "/v1/deployments/{deployment}/leases/{lease_id}"


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    scope: Scope


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("PUT", RANK, registration.put_rank, Scope.WORKER),
    Endpoint("GET", RANK, registration.get_rank, Scope.WORKER),
    Endpoint("DELETE", RANK, registration.delete_rank, Scope.ADMIN),
    Endpoint("POST", RANK + "/heartbeat", registration.heartbeat, Scope.WORKER),
    # Engine leases: one lease keeps many ranks; revoking it removes them (like a rank delete).
    Endpoint("POST", DEPLOYMENT + "/leases", leases.grant_lease, Scope.WORKER),
    Endpoint("GET", LEASE, leases.get_lease, Scope.WORKER),
    Endpoint("POST", LEASE + "/heartbeat", leases.renew_lease, Scope.WORKER),
    Endpoint("DELETE", LEASE, leases.revoke_lease, Scope.ADMIN),
    Endpoint("GET", "/v1/deployments", inventory.list_deployments, Scope.ADMIN),
    Endpoint("GET", "/v1/deployments/{deployment}", inventory.get_deployment, Scope.ADMIN),
    Endpoint("PATCH", DEPLOYMENT, pairing.patch_deployment, Scope.ADMIN),
    Endpoint(
        "GET", "/v1/deployments/{deployment}/instances", inventory.list_instances, Scope.ADMIN
    ),
    Endpoint("GET", INSTANCE, inventory.get_instance, Scope.ADMIN),
    Endpoint("DELETE", INSTANCE, inventory.delete_instance, Scope.ADMIN),
    Endpoint("GET", "/v1/rejections", inventory.list_rejections, Scope.ADMIN),
    Endpoint("GET", DEPLOYMENT + "/plans", plans.get_plan, Scope.WORKER),
    Endpoint("GET", DEPLOYMENT + "/plan-sets", plans.get_plan_set, Scope.WORKER),
    # Questions that store nothing: a dry-run admission and a model pre-flight.
    Endpoint(
        "POST", DEPLOYMENT + "/admission-checks", preflight.post_admission_check, Scope.WORKER
    ),
    Endpoint("POST", "/v1/preflight", preflight.post_preflight, Scope.WORKER),
    Endpoint("GET", DEPLOYMENT + "/compatibility", compatibility.get_compatibility, Scope.ADMIN),
    Endpoint("GET", DEPLOYMENT + "/pairs", pairing.get_pairs, Scope.WORKER),
    # KV integrity: workers report each path's canary or sampled digest; routers read them.
    Endpoint("POST", DEPLOYMENT + "/kv-paths", kv_paths.post_kv_path, Scope.WORKER),
    Endpoint("GET", DEPLOYMENT + "/kv-paths", kv_paths.get_kv_paths, Scope.WORKER),
    Endpoint("POST", DEPLOYMENT + "/kv-digests", kv_paths.post_kv_digest, Scope.WORKER),
    Endpoint("GET", DEPLOYMENT + "/kv-digests", kv_paths.get_kv_digests, Scope.WORKER),
    # Watch instead of poll: the deployment's changes as server-sent events, resumable.
    Endpoint("GET", DEPLOYMENT + "/events", events.stream_events, Scope.WORKER),
    Endpoint("POST", DEPLOYMENT + "/transfers", transfers.post_transfer, Scope.WORKER),
    Endpoint("GET", DEPLOYMENT + "/transfers", transfers.list_transfers, Scope.ADMIN),
    Endpoint("GET", TRANSFER, transfers.get_transfer, Scope.WORKER),
    Endpoint("DELETE", TRANSFER, transfers.delete_transfer, Scope.WORKER),
    Endpoint("GET", "/healthz", ops.healthz, Scope.PUBLIC),
    Endpoint("GET", "/readyz", ops.readyz, Scope.PUBLIC),
    Endpoint("GET", "/metrics", ops.metrics, Scope.PUBLIC),
    Endpoint("GET", "/v1/openapi.yaml", ops.openapi_spec, Scope.PUBLIC),
    # The console's static files; the data they show comes from the admin-scoped API.
    Endpoint("GET", "/", console.root, Scope.PUBLIC),
    Endpoint("GET", "/ui/", console.index, Scope.PUBLIC),
    Endpoint("GET", "/ui/{asset}", console.console_file, Scope.PUBLIC),
)


def add_endpoints(app: web.Application, endpoints: tuple[Endpoint, ...] = ENDPOINTS) -> None:
    """Registers the endpoints and their scopes (later features pass their own tables)."""
    scopes = app.setdefault(route_scopes_key, {})
    for endpoint in endpoints:
        # add_route, unlike add_get, adds no HEAD twin: the spec declares none.
        app.router.add_route(endpoint.method, endpoint.path, endpoint.handler)
        scopes[(endpoint.method, endpoint.path)] = endpoint.scope
