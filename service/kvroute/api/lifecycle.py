"""Resource lifetimes and graceful drain.

One cleanup context per resource: each creates its resource, stores it under its key,
yields, and tears it down; aiohttp runs a teardown only when that resource's startup
succeeded. Shutdown (``kvroute serve`` on SIGTERM, see ``cli/serve``) first sets ``draining``:
readiness answers 503 while requests are still served for ``KVROUTE_DRAIN_SECONDS``. Then the
listener closes and ``stopping`` refuses mutations still arriving on open connections, aiohttp waits
for in-flight handlers, and the contexts unwind in reverse: the transfer pool finishes or fails its
jobs, the reaper stops, the engine is disposed. Each reaper round also refreshes the planner's
statistics of the tables a fleet grows (``store.statistics``).
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
    event_hub_key,
    lifecycle_key,
    metrics_key,
    reaper_key,
    registry_key,
    sessionmaker_key,
    settings_key,
)
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.transfers import sweep_pools
from kvroute.control.events import EventHub
from kvroute.store.engine import create_engine, dispose, make_sessionmaker
from kvroute.store.records import RankName

log = logging.getLogger(__name__)

MUTATING_METHODS = frozenset({"PUT", "POST", "PATCH", "DELETE"})
# How often the event hub reads the log without a signal: SQLite has no cross-process signal;
# PostgreSQL's NOTIFY is the signal and this only a safety net.
SQLITE_POLL_SECONDS = 0.25
POSTGRES_POLL_SECONDS = 1.0


async def database_context(app: web.Application) -> AsyncIterator[None]:
    settings = app[settings_key]
    engine = create_engine(settings.database_url, settings.database_timeouts)
    app[engine_key] = engine
    app[sessionmaker_key] = make_sessionmaker(engine)
    yield
    await dispose(engine)


async def events_context(app: web.Application) -> AsyncIterator[None]:
    """The event hub (after ``plan_context``: it tells the registry's changes to the hub)."""
    settings = app[settings_key]
    hub = EventHub(
        app[sessionmaker_key],
        clock=lambda: app_now(app),
        poll_seconds=SQLITE_POLL_SECONDS if settings.is_sqlite else POSTGRES_POLL_SECONDS,
    )
    app[event_hub_key] = hub
    app[registry_key].changed = hub.poke
    hub.start()
    yield
    await hub.close()


async def close_event_streams(app: web.Application) -> None:
    """``on_shutdown``: following event streams never end by themselves; end them before the
    drain waits."""
    await app[event_hub_key].close()


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
        await _refresh_statistics(app)


async def _refresh_statistics(app: web.Application) -> None:
    """The planner's statistics of the tables a fleet grows (``store.statistics``)."""
    try:
        analyzed = await app[registry_key].refresh_statistics()
    except Exception:  # the plans only get slower: never a reason to stop the reaper
        log.warning("refreshing the planner's statistics failed", exc_info=True)
        return
    if analyzed:
        log.debug("analyzed %s", ", ".join(analyzed))


async def _reap_round(
    app: web.Application, *, since: datetime, now: datetime, grace: timedelta
) -> None:
    """Reports the leases that ended since the last round, removes the long-expired ranks."""
    metrics = app[metrics_key]
    done = await app[registry_key].reap(since=since, now=now, grace=grace)
    await sweep_pools(app, now)  # pools of ranks that expired, or changed on another replica
    metrics.database_up.set(1)
    metrics.count_expired(done.expired)
    metrics.set_rank_counts(done.counts)
    # Engine leases that ended with their ranks (reaped above, or never attached any).
    await app[registry_key].reap_engine_leases(cutoff=now - grace)
    for name, ended in done.expired:
        log.warning(
            "lease expired: %s (no heartbeat since its lease ended at %s)",
            name,
            ended.isoformat(),
            extra={"fields": {"event": "lease_expired", **_rank_fields(name)}},
        )
    if removed := done.reaped:
        log.info(
            "reaped %d ranks whose lease expired over %gs ago: %s",
            len(removed),
            grace.total_seconds(),
            ", ".join(map(str, removed)),
            extra={"fields": {"event": "ranks_reaped", "ranks": list(map(_rank_fields, removed))}},
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
