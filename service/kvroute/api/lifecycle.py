"""Resource lifetimes and graceful drain.

One cleanup context per resource: each creates its resource, stores it under its key,
yields, and tears it down; aiohttp runs a teardown only when that resource's startup
succeeded. Shutdown (``kvroute serve`` on SIGTERM, see ``cli/serve``) first sets ``draining``:
readiness answers 503 while requests are still served for ``KVROUTE_DRAIN_SECONDS``. Then the
listener closes and ``stopping`` refuses mutations still arriving on open connections, aiohttp waits
for in-flight handlers, and the contexts unwind in reverse: the transfer pool finishes or fails its
jobs, the reaper stops, the engine is disposed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import datetime, timedelta

from aiohttp import web
from aiohttp.typedefs import Handler

from kvroute.api.clock import app_now
from kvroute.api.keys import (
    engine_key,
    lifecycle_key,
    metrics_key,
    reaper_key,
    sessionmaker_key,
    settings_key,
)
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.transfers import sweep_pools
from kvroute.store import lease_watch, registry
from kvroute.store.engine import create_engine, dispose, make_sessionmaker
from kvroute.store.records import RankName

log = logging.getLogger(__name__)

MUTATING_METHODS = frozenset({"PUT", "POST", "PATCH", "DELETE"})


async def database_context(app: web.Application) -> AsyncIterator[None]:
    settings = app[settings_key]
    engine = create_engine(settings.database_url, settings.database_timeouts)
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
    since = app_now(app)  # expiries before this process started are not its to report
    while True:
        await asyncio.sleep(settings.reaper_interval_seconds)
        now = app_now(app)
        try:
            await _reap_round(app, since=since, now=now, grace=grace)
        except Exception:
            # A database outage must not kill the reaper; the next round retries the same window.
            log.warning("lease reaper round failed", exc_info=True)
            app[metrics_key].database_up.set(0)
            continue
        since = now


async def _reap_round(
    app: web.Application, *, since: datetime, now: datetime, grace: timedelta
) -> None:
    """Reports the leases that ended since the last round, removes the long-expired ranks."""
    sessionmaker, metrics = app[sessionmaker_key], app[metrics_key]
    expired = await lease_watch.expired_between(sessionmaker, after=since, until=now)
    reaped = await registry.reap_expired(sessionmaker, now=now, grace=grace)
    counts = await lease_watch.rank_counts(sessionmaker, now=now)
    await sweep_pools(app, now)  # pools of ranks that expired, or changed on another replica
    metrics.database_up.set(1)
    metrics.count_expired(expired)
    metrics.set_rank_counts(counts)
    for name, ended in expired:
        log.warning(
            "lease expired: %s (no heartbeat since its lease ended at %s)",
            name,
            ended.isoformat(),
            extra={"fields": {"event": "lease_expired", **_rank_fields(name)}},
        )
    if reaped:
        log.info(
            "reaped %d ranks whose lease expired over %gs ago: %s",
            len(reaped),
            grace.total_seconds(),
            ", ".join(map(str, reaped)),
            extra={"fields": {"event": "ranks_reaped", "ranks": list(map(_rank_fields, reaped))}},
        )


def _rank_fields(name: RankName) -> dict[str, str | int]:
    return {"deployment": name.deployment, "instance": name.instance, "rank": name.rank}


async def start_draining(app: web.Application) -> None:
    """``on_shutdown``: the listener is closed; stop taking work before in-flight requests end."""
    lifecycle = app[lifecycle_key]
    lifecycle.draining = lifecycle.stopping = True
    log.info("stopping: mutating requests are refused; waiting for in-flight requests")


@web.middleware
async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method in MUTATING_METHODS and request.app[lifecycle_key].stopping:
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
