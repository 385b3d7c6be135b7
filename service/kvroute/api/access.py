"""Request ids, structured logs and the one access line (plus latency metric) per request.

The request id comes from ``X-Request-ID`` when the client sent a sane one, else it is
generated; it is echoed on the response, put in every problem body and bound to a
contextvar so every log line written while handling the request carries it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from datetime import UTC, datetime

from aiohttp import web
from aiohttp.typedefs import Handler

from kvroute.api.keys import metrics_key, problem_key, request_id_key

REQUEST_ID_HEADER = "X-Request-ID"
# Client-chosen ids end up in logs: accept only short, printable tokens.
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# Unmatched paths share one label so scanners cannot blow up metric cardinality.
UNMATCHED_ROUTE = "<unmatched>"

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvroute_request_id", default=None
)
access_log = logging.getLogger("kvroute.access")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra={"http": {...}}`` and ``{"fields": {...}}`` are merged in."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        entry.update(getattr(record, "http", {}))
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class ConsoleFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s [%(request_id)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = {**getattr(record, "http", {}), **getattr(record, "fields", {})}
        return line + "".join(f" {key}={value}" for key, value in fields.items())


def configure_logging(*, log_format: str, level: str) -> None:
    """Route every logger to stdout in the chosen format (called once, by the CLI)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Alembic announces each of its plugins at INFO on every migration run.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


def route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED_ROUTE


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = offered if _CLIENT_REQUEST_ID.match(offered) else uuid.uuid4().hex
    request[request_id_key] = request_id
    token = current_request_id.set(request_id)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        response.headers[REQUEST_ID_HEADER] = request_id
        return response
    except web.HTTPException as exc:
        status = exc.status
        exc.headers[REQUEST_ID_HEADER] = request_id
        raise
    finally:
        elapsed = time.perf_counter() - started
        route = route_label(request)
        request.app[metrics_key].http_duration.labels(
            route=route, method=request.method, status_class=f"{status // 100}xx"
        ).observe(elapsed)
        fields: dict[str, object] = {
            "request_id": request_id,
            "method": request.method,
            "path": request.path,
            "route": route,
            "status": status,
            "duration_ms": round(elapsed * 1000, 3),
            "remote": request.remote,
        }
        problem = request.get(problem_key)
        if problem is not None:
            # Why it was refused, in the line itself: no join with the response body needed.
            fields["code"] = problem.code
            if problem.extras.get("field") is not None:
                fields["field"] = problem.extras["field"]
        access_log.info("%s %s %d", request.method, request.path, status, extra={"http": fields})
        current_request_id.reset(token)
