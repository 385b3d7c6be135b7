"""Engine lease handlers: grant, renew, read and revoke one lease that keeps many ranks.

Handlers only translate: the validated request becomes a call into ``kvroute.control.registry``,
whose records become ``kvroute.wire.EngineLease`` JSON.
"""

from __future__ import annotations

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now
from kvroute.api.keys import registry_key, validated_key
from kvroute.api.transfers import pools_deleted
from kvroute.store.records import LeaseRecord


def _answer(record: LeaseRecord, status: int = 200) -> web.Response:
    lease = wire.EngineLease(
        deployment=record.deployment,
        lease_id=record.lease_id,
        lease_seconds=record.lease_seconds,
        lease_expires_at=record.lease_expires_at,
        ranks=tuple(wire.LeasedRank(instance, rank) for instance, rank in record.ranks),
    )
    return web.json_response(wire.to_json(lease), status=status)


def _address(request: web.Request) -> tuple[str, str]:
    path = request[validated_key].path
    return path["deployment"], path["lease_id"]


async def grant_lease(request: web.Request) -> web.Response:
    validated = request[validated_key]
    record = await request.app[registry_key].grant_lease(
        validated.path["deployment"],
        validated.body["lease_seconds"],
        now=app_now(request.app),
    )
    return _answer(record, status=201)


async def renew_lease(request: web.Request) -> web.Response:
    deployment, lease_id = _address(request)
    record = await request.app[registry_key].renew_lease(
        deployment, lease_id, now=app_now(request.app)
    )
    return _answer(record)


async def get_lease(request: web.Request) -> web.Response:
    deployment, lease_id = _address(request)
    return _answer(await request.app[registry_key].lease(deployment, lease_id))


async def revoke_lease(request: web.Request) -> web.Response:
    deployment, lease_id = _address(request)
    ranks = await request.app[registry_key].revoke_lease(
        deployment, lease_id, now=app_now(request.app)
    )
    for instance, rank in ranks:
        pools_deleted(request.app, deployment, instance, rank)
    return web.Response(status=204)
