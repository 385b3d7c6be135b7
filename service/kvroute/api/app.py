"""The application factory: ``create_app(settings)`` wires middlewares, routes and resources.

Middleware order (outermost first) and why:

1. access: request id and the one log line / latency sample per request, so it must see the
   final status of everything below it;
2. error boundary: every exception below becomes problem+json;
3. drain: refuses mutating requests once shutdown started;
4. auth: no token, no validation detail;
5. OpenAPI validation: handlers only ever see requests that match the spec.
"""

from __future__ import annotations

from aiohttp import web

from kvroute.api.access import access_middleware
from kvroute.api.auth import auth_middleware
from kvroute.api.clock import Clock, clock_key, system_clock
from kvroute.api.errors import error_boundary
from kvroute.api.keys import (
    Lifecycle,
    lifecycle_key,
    metrics_key,
    settings_key,
    spec_text_key,
    spec_validator_key,
)
from kvroute.api.lifecycle import (
    close_event_streams,
    database_context,
    drain_middleware,
    events_context,
    reaper_context,
    start_draining,
)
from kvroute.api.metrics import Metrics
from kvroute.api.plans import plan_context
from kvroute.api.routes import add_endpoints
from kvroute.api.spec import spec_bytes, spec_validator
from kvroute.api.transfers import transfer_context
from kvroute.api.validation import validation_middleware
from kvroute.settings import Settings


def create_app(settings: Settings, *, clock: Clock = system_clock) -> web.Application:
    """The app for ``settings``; ``clock`` is where it reads the time (tests pass their own)."""
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[
            access_middleware,
            error_boundary,
            drain_middleware,
            auth_middleware,
            validation_middleware,
        ],
    )
    app[settings_key] = settings
    app[clock_key] = clock
    app[lifecycle_key] = Lifecycle()
    backend = "sqlite" if settings.is_sqlite else "postgresql"
    app[metrics_key] = Metrics.create(database_backend=backend)
    text = spec_bytes()
    app[spec_text_key] = text
    app[spec_validator_key] = spec_validator(text)
    add_endpoints(app)
    app.cleanup_ctx.append(database_context)
    app.cleanup_ctx.append(plan_context)
    app.cleanup_ctx.append(events_context)
    app.cleanup_ctx.append(reaper_context)
    app.cleanup_ctx.append(transfer_context)
    app.on_shutdown.append(start_draining)
    app.on_shutdown.append(close_event_streams)
    return app
