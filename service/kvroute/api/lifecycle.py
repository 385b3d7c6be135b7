"""Resource lifetimes and graceful drain.

One cleanup context per resource: each creates its resource, stores it under its key,
yields, and tears it down; aiohttp runs a teardown only when that resource's startup
succeeded. Shutdown first flips ``draining`` (readiness answers 503 and mutating requests
are refused), then aiohttp waits for in-flight handlers, then the contexts unwind in
reverse: the reaper stops before the engine is disposed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import timedelta

from aiohttp import web
from aiohttp.typedefs import Handler

from kvroute.api.keys import (
    engine_key,
    lifecycle_key,
    metrics_key,
    reaper_key,
    sessionmaker_key,
    settings_key,
)
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.registration import utcnow
from kvroute.store import registry
from kvroute.store.engine import create_engine, dispose, make_sessionmaker

log = logging.getLogger(__name__)

MUTATING_METHODS = frozenset({"PUT", "POST", "PATCH", "DELETE"})


async def database_context(app: web.Application) -> AsyncIterator[None]:
    engine = create_engine(app[settings_key].database_url)
    app[engine_key] = engine
    app[sessionmaker_key] = make_sessionmaker(engine)
    yield
    await dispose(engine)


async def reaper_context(app: web.Application) -> AsyncIterator[None]:
    app[reaper_key] = asyncio.create_task(_reap_forever(app), name="kvroute-lease-reaper")
    yield
    app[reaper_key].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await app[reaper_key]


async def _reap_forever(app: web.Application) -> None:
    settings = app[settings_key]
    grace = timedelta(seconds=settings.lease_grace_seconds)
    while True:
        await asyncio.sleep(settings.reaper_interval_seconds)
        try:
            now = utcnow()
            reaped = await registry.reap_expired(app[sessionmaker_key], now=now, grace=grace)
            live = await registry.count_live_ranks(app[sessionmaker_key], now=now)
        except Exception:
            # A database outage must not kill the reaper; the next round retries.
            log.warning("lease reaper round failed", exc_info=True)
            continue
        app[metrics_key].live_ranks.set(live)
        if reaped:
            log.info(
                "reaped %d ranks whose lease expired over %gs ago", reaped, grace.total_seconds()
            )


async def start_draining(app: web.Application) -> None:
    """``on_shutdown``: stop taking work before in-flight requests are awaited."""
    app[lifecycle_key].draining = True
    log.info("draining: readiness is 503 and mutating requests are refused")


@web.middleware
async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method in MUTATING_METHODS and request.app[lifecycle_key].draining:
        raise ProblemError(
            Problem(
                503,
                "Service Unavailable",
                "kvroute is shutting down; retry against another replica",
                "draining",
                headers={"Retry-After": "1"},
            )
        )
    return await handler(request)
