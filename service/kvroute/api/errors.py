"""The error boundary: domain and library exceptions become problem+json in exactly one place.

Handlers and the other middlewares raise (``GeometryError``, the store's ``NotFound``,
``ProblemError``, aiohttp's ``HTTPException``); this middleware maps each through one table.
Anything unmapped is a bug: it is logged with the request id and answered 500 without a
traceback, so bad input can never surface as a 500 unless the code is wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from kvroute.api.keys import problem_key, request_id_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.geometry import GeometryError
from kvroute.store.errors import Conflict, NotFound

log = logging.getLogger(__name__)

# Stage of a geometry refusal -> status: the document alone is wrong (422), or it disagrees
# with what is already registered (409; a plan request naming ranks that cannot pair, too).
GEOMETRY_STATUS: dict[str, int] = {
    "schema": 422,
    "self": 422,
    "instance": 409,
    "peer": 409,
    "plan": 409,
}

_GEOMETRY_MEMBERS = ("field", "local", "peer", "peer_instance", "peer_rank")


def geometry_problem(exc: GeometryError) -> Problem:
    body = exc.to_problem()
    extras = {name: body.get(name) for name in _GEOMETRY_MEMBERS}
    return Problem(
        status=GEOMETRY_STATUS.get(exc.stage, 422),
        title=body["title"],
        detail=body["detail"],
        code=body["code"],
        extras=extras,
    )


def http_problem(exc: web.HTTPException, request: web.Request) -> Problem:
    headers = {
        name: exc.headers[name] for name in ("Allow", "WWW-Authenticate") if name in exc.headers
    }
    if exc.status == 404:
        detail = f"no resource at {request.path}"
    elif exc.status == 405:
        detail = (
            f"{request.method} is not allowed on {request.path}; allowed: {headers.get('Allow')}"
        )
    elif exc.status == 413:
        detail = f"the body exceeds the limit of {request.client_max_size} bytes"
    else:
        detail = exc.text or exc.reason
    return Problem(
        status=exc.status,
        title=exc.reason,
        detail=detail,
        code=exc.reason.lower().replace(" ", "_"),
        headers=headers,
    )


def _not_found(exc: Exception) -> Problem:
    return Problem(status=404, title="Not Found", detail=str(exc), code="not_found")


def _conflict(exc: Exception) -> Problem:
    return Problem(status=409, title="Conflict", detail=str(exc), code="conflict")


def _database_unavailable(exc: Exception) -> Problem:
    log.warning("database unavailable: %s", exc.__class__.__name__)
    return Problem(
        status=503,
        title="Service Unavailable",
        detail="the database is unreachable; retry later",
        code="database_unavailable",
    )


# Checked in order; the first matching entry renders the answer.
PROBLEM_TABLE: tuple[
    tuple[type[Exception] | tuple[type[Exception], ...], Callable[[Any], Problem]], ...
] = (
    (ProblemError, lambda exc: exc.problem),
    (GeometryError, geometry_problem),
    (NotFound, _not_found),
    (Conflict, _conflict),
    ((OperationalError, PoolTimeoutError, ConnectionError), _database_unavailable),
)


def to_problem(exc: Exception) -> Problem | None:
    for kinds, render in PROBLEM_TABLE:
        if isinstance(exc, kinds):
            return render(exc)
    return None


@web.middleware
async def error_boundary(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.get(request_id_key)
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        problem = http_problem(exc, request)
    except Exception as exc:
        found = to_problem(exc)
        if found is None:
            log.exception("unhandled error in %s %s", request.method, request.path)
            found = Problem(
                status=500,
                title="Internal Server Error",
                detail=f"unexpected error; quote request id {request_id} when reporting it",
                code="internal_error",
            )
        problem = found
    request[problem_key] = problem
    return problem.to_response(request_id=request_id)
