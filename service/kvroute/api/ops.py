"""Operational endpoints: liveness, readiness, Prometheus metrics and the spec itself."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvroute.api.clock import app_now
from kvroute.api.keys import (
    inventory_key,
    lifecycle_key,
    metrics_key,
    sessionmaker_key,
    settings_key,
    spec_text_key,
)
from kvroute.api.problems import DEFAULT_RETRY_AFTER_S
from kvroute.api.transfers import transfer_checks
from kvroute.control import kv_paths

log = logging.getLogger(__name__)


async def healthz(request: web.Request) -> web.Response:
    # Liveness touches nothing: if the loop answers, restarting the process would not help.
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    app = request.app
    checks = {
        "database": await _database_check(request),
        "draining": "draining for shutdown" if app[lifecycle_key].draining else "ok",
        **transfer_checks(app),
    }
    ready = all(result == "ok" for result in checks.values())
    return web.json_response(
        {"status": "ready" if ready else "unready", "checks": checks},
        status=200 if ready else 503,
        headers={} if ready else {"Retry-After": str(DEFAULT_RETRY_AFTER_S)},
    )


async def _database_check(request: web.Request) -> str:
    timeout = request.app[settings_key].readiness_timeout_seconds
    try:
        async with asyncio.timeout(timeout):
            await request.app[inventory_key].ping()
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except Exception as exc:  # any failure means "not ready"; the reason is the answer
        return f"{exc.__class__.__name__}: {exc}".splitlines()[0][:200]
    return "ok"


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    gauges = app[metrics_key]
    try:
        async with asyncio.timeout(app[settings_key].readiness_timeout_seconds):
            counts = await app[inventory_key].rank_counts(now=app_now(app))
            paths = await kv_paths.all_state_counts(app[sessionmaker_key], now=app_now(app))
    except Exception:
        # A scrape must not fail with the database; the rank gauges keep their last values.
        log.warning("could not refresh the rank gauges", exc_info=True)
        gauges.database_up.set(0)
    else:
        gauges.set_rank_counts(counts)
        for deployment, states in paths.items():
            gauges.set_path_states(deployment, states)
        gauges.database_up.set(1)
    return web.Response(
        body=generate_latest(gauges.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def openapi_spec(request: web.Request) -> web.Response:
    return web.Response(body=request.app[spec_text_key], content_type="application/yaml")
