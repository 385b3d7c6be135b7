"""Pairing: ``GET /v1/deployments/{d}/pairs`` for routers (worker scope) and the deployment's
pairing policy, ``PATCH /v1/deployments/{d}`` (admin). Both go through ``kvroute.control.pairing``.
"""

from __future__ import annotations

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now
from kvroute.api.keys import registry_key, sessionmaker_key, validated_key
from kvroute.control.pairing import deployment_pairs, set_pairing


async def get_pairs(request: web.Request) -> web.Response:
    validated = request[validated_key]
    registry = request.app[registry_key]
    answer = await deployment_pairs(
        registry,
        validated.path["deployment"],
        now=app_now(request.app),
        generation=validated.query.get("generation"),
    )
    return web.Response(body=answer.body, content_type="application/json", charset="utf-8")


async def patch_deployment(request: web.Request) -> web.Response:
    name = request[validated_key].path["deployment"]
    record = await set_pairing(
        request.app[sessionmaker_key],
        name,
        request[validated_key].body["pairing"],
        now=app_now(request.app),
    )
    return web.json_response(wire.to_json(record))
