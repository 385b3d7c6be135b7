"""The error boundary: domain and library exceptions become problem+json in exactly one place.

Handlers and the other middlewares raise (``GeometryError``, the store's ``NotFound``, the data
plane's refusals, the validation middleware's request errors, ``ProblemError``, aiohttp's
``HTTPException``, a driver's error); this middleware maps each through one table, the only place
a domain error meets an HTTP status. Database outages are 503 with their own codes: ``database_busy`` when the database
answered too slowly (statement or lock timeout, SQLite lock starvation), ``database_unavailable``
when it could not be reached; the log line names the cause. Every 503 carries ``Retry-After``.
Anything unmapped is a bug: it is logged with the request id and answered 500 without a
traceback, so bad input can never surface as a 500 unless the code is wrong.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from kvroute.api.keys import problem_key, request_id_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.request_errors import REQUEST_ERRORS, request_problem
from kvroute.geometry import GeometryError
from kvroute.store.errors import Conflict, NotFound
from kvroute.store.faults import DATABASE_ERRORS, database_fault
from kvroute.transfer.errors import (
    PoolDraining,
    PoolMemoryError,
    PoolsExhausted,
    QueueFull,
    TransferValidationError,
    UnknownJob,
)

log = logging.getLogger(__name__)

# Stage of a geometry refusal -> status: the document alone is wrong (422), or it disagrees
# with what is already registered (409; a plan request naming ranks that cannot pair, too).
GEOMETRY_STATUS: dict[str, int] = {
    "schema": 422,
    "self": 422,
    "instance": 409,
    "peer": 409,
    "plan": 409,
    "plan_document": 422,
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
    return Problem(
        status=409, title="Conflict", detail=str(exc), code=getattr(exc, "code", "conflict")
    )


# Seconds a client should wait: a slow database recovers sooner than an unreachable one.
BUSY_RETRY_AFTER_S = 1
UNAVAILABLE_RETRY_AFTER_S = 2


def _database_problem(exc: Exception) -> Problem | None:
    fault = database_fault(exc)
    if fault is None:
        return None  # a driver error that is not an outage (integrity, syntax): a bug, 500
    if fault.busy:
        detail = "the database did not answer in time (busy or locked); retry shortly"
        code, retry_after = "database_busy", BUSY_RETRY_AFTER_S
    else:
        detail, code = "the database is unreachable; retry later", "database_unavailable"
        retry_after = UNAVAILABLE_RETRY_AFTER_S
    log.warning("%s: %s", code.replace("_", " "), fault.cause)
    return Problem(
        status=503,
        title="Service Unavailable",
        detail=detail,
        code=code,
        headers={"Retry-After": str(retry_after)},
    )


def _pool_memory(exc: PoolMemoryError) -> Problem:
    extras: dict[str, Any] = {"pool": exc.pool_id, "backend": exc.backend, "reason": exc.reason}
    if exc.instance is not None:
        extras |= {"instance": exc.instance, "rank": exc.rank}
    return _unprocessable(exc, "pool_memory_unavailable", extras)


def _invalid_transfer(exc: TransferValidationError) -> Problem:
    return _unprocessable(exc, exc.code, {"field": exc.field, **exc.extras})


def _queue_full(exc: QueueFull) -> Problem:
    retry = str(max(1, math.ceil(exc.retry_after)))
    return Problem(429, "Too Many Requests", str(exc), "queue_full", headers={"Retry-After": retry})


def _pool_draining(exc: PoolDraining) -> Problem:
    return Problem(503, "Service Unavailable", str(exc), "draining", headers={"Retry-After": "1"})


def _pools_exhausted(exc: PoolsExhausted) -> Problem:
    retry = str(max(1, math.ceil(exc.retry_after)))
    log.warning("transfer refused: %s", exc)
    return Problem(
        503, "Service Unavailable", str(exc), "pools_exhausted", headers={"Retry-After": retry}
    )


def _unprocessable(exc: Exception, code: str, extras: dict[str, Any]) -> Problem:
    return Problem(422, "Unprocessable Content", str(exc), code, extras=extras)


# Checked in order; the first entry whose type matches and whose renderer answers (a renderer
# may decline with None) renders the answer.
PROBLEM_TABLE: tuple[
    tuple[type[Exception] | tuple[type[Exception], ...], Callable[[Any], Problem | None]], ...
] = (
    (ProblemError, lambda exc: exc.problem),
    (GeometryError, geometry_problem),
    (REQUEST_ERRORS, request_problem),
    ((NotFound, UnknownJob), _not_found),
    (Conflict, _conflict),
    (PoolMemoryError, _pool_memory),
    (TransferValidationError, _invalid_transfer),
    (QueueFull, _queue_full),
    (PoolDraining, _pool_draining),
    (PoolsExhausted, _pools_exhausted),
    (DATABASE_ERRORS, _database_problem),
)


def to_problem(exc: Exception) -> Problem | None:
    for kinds, render in PROBLEM_TABLE:
        if isinstance(exc, kinds) and (problem := render(exc)) is not None:
            return problem
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
