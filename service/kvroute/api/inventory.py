"""Read-only views of the registry for operators: deployments, instances, refusals.

Expired ranks stay visible (state ``expired``) until the reaper removes them, so an operator
can see a worker that stopped heartbeating. Reads go through ``control.Inventory``, the instance
deletion through ``control.Registry``.
"""

from __future__ import annotations

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now
from kvroute.api.keys import inventory_key, registry_key, validated_key
from kvroute.api.transfers import pools_deleted


async def list_deployments(request: web.Request) -> web.Response:
    deployments = await request.app[inventory_key].deployments(now=app_now(request.app))
    return web.json_response({"deployments": [wire.to_json(item) for item in deployments]})


async def get_deployment(request: web.Request) -> web.Response:
    name = request[validated_key].path["deployment"]
    record = await request.app[inventory_key].deployment(name, now=app_now(request.app))
    return web.json_response(wire.to_json(record))


async def list_instances(request: web.Request) -> web.Response:
    name = request[validated_key].path["deployment"]
    instances = await request.app[inventory_key].instances(name, now=app_now(request.app))
    return web.json_response(
        {"deployment": name, "instances": [wire.to_json(item) for item in instances]}
    )


async def get_instance(request: web.Request) -> web.Response:
    path = request[validated_key].path
    record = await request.app[inventory_key].instance(
        path["deployment"], path["instance"], now=app_now(request.app)
    )
    return web.json_response(wire.to_json(record))


async def delete_instance(request: web.Request) -> web.Response:
    path = request[validated_key].path
    await request.app[registry_key].delete_instance(
        path["deployment"], path["instance"], now=app_now(request.app)
    )
    pools_deleted(request.app, path["deployment"], path["instance"], None)
    return web.Response(status=204)


async def list_rejections(request: web.Request) -> web.Response:
    limit = request[validated_key].query.get("limit", 100)
    rejections = await request.app[inventory_key].rejections(limit)
    return web.json_response({"rejections": [wire.to_json(item) for item in rejections]})
