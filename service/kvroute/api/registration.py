"""Rank registration handlers: register, read, renew and remove one rank.

Handlers only translate: the validated request becomes a ``RankRegistration`` and a call into
``kvroute.control`` (``Registry`` writes, ``Inventory`` reads), whose records become JSON. Refusals propagate as
``GeometryError`` to the error boundary, after being counted here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now
from kvroute.api.keys import inventory_key, metrics_key, registry_key, validated_key
from kvroute.api.transfers import pools_deleted, pools_registered
from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.checks.validate import check_self

# Documents up to this size are checked on the event loop (see ``_parse``).
INLINE_BODY_BYTES = 8 * 1024


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
        outcome = await app[registry_key].register(
            registration,
            now=now,
            engine_lease=request[validated_key].query.get("engine_lease"),
            checked=True,
        )
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
    """The typed registration, self-checked and digested; a malformed document is logged as a
    refusal like any other."""
    body = request[validated_key].body
    try:
        if request.content_length is not None and request.content_length <= INLINE_BODY_BYTES:
            # A fleet rank's document (1-2 KB) is checked in a fraction of a millisecond: less
            # than a trip to a thread and back costs the event loop.
            return _checked(body, deployment=deployment, instance=instance, rank=rank)
        # Milliseconds for the largest documents the limits allow: not on the event loop, and in
        # one trip to a thread rather than two.
        return await asyncio.to_thread(
            _checked, body, deployment=deployment, instance=instance, rank=rank
        )
    except GeometryError as error:
        await request.app[registry_key].refuse(
            error, deployment=deployment, instance=instance, rank=rank, now=now
        )
        raise


def _checked(
    body: Mapping[str, Any], *, deployment: str, instance: str, rank: int
) -> RankRegistration:
    """The document parsed, then what admission's ``prepare`` does: the document's own checks and
    the digests and face admission reads under the deployment's lock (refused in that order)."""
    reg = RankRegistration.from_json(body, deployment=deployment, instance=instance, rank=rank)
    check_self(reg)
    _ = reg.class_digest, reg.canonical_digest, reg.instance_digest
    return reg


async def get_rank(request: web.Request) -> web.Response:
    deployment, instance, rank = rank_address(request)
    record = await request.app[inventory_key].rank(
        deployment, instance, rank, now=app_now(request.app)
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
    await request.app[registry_key].delete_rank(
        deployment, instance, rank, now=app_now(request.app)
    )
    pools_deleted(request.app, deployment, instance, rank)
    return web.Response(status=204)
