"""Rank registration handlers: register, read, renew and remove one rank.

Handlers only translate: the validated request becomes a ``RankRegistration`` and a call into
``kvroute.store.registry``, whose records become JSON. Refusals propagate as
``GeometryError`` to the error boundary, after being counted here.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now
from kvroute.api.keys import metrics_key, registry_key, sessionmaker_key, validated_key
from kvroute.api.transfers import pools_deleted, pools_registered
from kvroute.geometry import GeometryError, RankRegistration
from kvroute.store import registry


def rank_address(request: web.Request) -> tuple[str, str, int]:
    path = request[validated_key].path
    return path["deployment"], path["instance"], path["rank"]


async def put_rank(request: web.Request) -> web.Response:
    deployment, instance, rank = rank_address(request)
    app = request.app
    metrics = app[metrics_key]
    now = app_now(request.app)
    try:
        registration = await _parse(request, deployment, instance, rank, now)
        outcome = await app[registry_key].register(registration, now=now)
    except GeometryError as error:
        metrics.registrations.labels(result="rejected").inc()
        metrics.rejections.labels(code=error.code, deployment=deployment).inc()
        raise
    metrics.registrations.labels(result="created" if outcome.created else "accepted").inc()
    pools_registered(app, deployment, instance, rank, outcome.generation)
    answer = wire.Registered(outcome.generation, outcome.lease_expires_at)
    return web.json_response(wire.to_json(answer), status=201 if outcome.created else 200)


async def _parse(
    request: web.Request, deployment: str, instance: str, rank: int, now: datetime
) -> RankRegistration:
    """The typed registration; a malformed document is logged as a refusal like any other."""
    try:
        # Milliseconds for the largest documents the limits allow: not on the event loop.
        return await asyncio.to_thread(
            RankRegistration.from_json,
            request[validated_key].body,
            deployment=deployment,
            instance=instance,
            rank=rank,
        )
    except GeometryError as error:
        await request.app[registry_key].refuse(
            error, deployment=deployment, instance=instance, rank=rank, now=now
        )
        raise


async def get_rank(request: web.Request) -> web.Response:
    deployment, instance, rank = rank_address(request)
    record = await registry.get_rank(
        request.app[sessionmaker_key], deployment, instance, rank, now=app_now(request.app)
    )
    return web.json_response(wire.to_json(record))


async def heartbeat(request: web.Request) -> web.Response:
    deployment, instance, rank = rank_address(request)
    expires = await request.app[registry_key].heartbeat(
        deployment, instance, rank, now=app_now(request.app)
    )
    return web.json_response(wire.to_json(wire.LeaseRenewed(expires)))


async def delete_rank(request: web.Request) -> web.Response:
    deployment, instance, rank = rank_address(request)
    await registry.delete_rank(request.app[sessionmaker_key], deployment, instance, rank)
    pools_deleted(request.app, deployment, instance, rank)
    return web.Response(status=204)
