"""Bearer-token auth with two scopes.

The worker token covers what a worker does for itself (register, heartbeat, read its rank);
the admin token covers everything. Tokens are compared in constant time. With no tokens
configured auth is off, which ``Settings`` only allows on a loopback address.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler

from kvroute.api.keys import route_scopes_key, settings_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.scopes import Scope

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kvroute"'}


def _matches(offered: str, token: str) -> bool:
    return hmac.compare_digest(offered.encode(), token.encode())


def granted_scope(request: web.Request) -> Scope:
    """The scope the request's bearer token grants; raises 401 when there is none."""
    settings = request.app[settings_key]
    scheme, _, offered = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not offered.strip():
        raise ProblemError(
            Problem(
                401,
                "Unauthorized",
                "send Authorization: Bearer <token>",
                "unauthorized",
                headers=_CHALLENGE,
            )
        )
    offered = offered.strip()
    if settings.admin_token is not None and _matches(
        offered, settings.admin_token.get_secret_value()
    ):
        return Scope.ADMIN
    if settings.worker_token is not None and _matches(
        offered, settings.worker_token.get_secret_value()
    ):
        return Scope.WORKER
    raise ProblemError(
        Problem(
            401,
            "Unauthorized",
            "the bearer token is not valid",
            "invalid_token",
            headers=_CHALLENGE,
        )
    )


def required_scope(request: web.Request) -> Scope:
    resource = request.match_info.route.resource
    if resource is None:
        # Unmatched path or method: let the router's 404/405 through without a token check.
        return Scope.PUBLIC
    return request.app[route_scopes_key].get((request.method, resource.canonical), Scope.ADMIN)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    required = required_scope(request)
    if required is Scope.PUBLIC or not request.app[settings_key].auth_enabled:
        return await handler(request)
    granted = granted_scope(request)
    if granted is Scope.WORKER and required is Scope.ADMIN:
        resource = request.match_info.route.resource  # matched: unmatched routes are public
        template = resource.canonical if resource is not None else request.path
        raise ProblemError(
            Problem(
                403,
                "Forbidden",
                f"{request.method} {template} needs the admin token",
                "insufficient_scope",
            )
        )
    return await handler(request)
