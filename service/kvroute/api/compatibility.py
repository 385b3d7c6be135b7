"""``GET /v1/deployments/{d}/compatibility``: the matrix from ``kvroute.control.compatibility``,
as JSON or (``format=svg``) as its picture."""

from __future__ import annotations

from aiohttp import web

from kvroute.api.clock import app_now
from kvroute.api.keys import registry_key, validated_key
from kvroute.control.answers import deployment_matrix
from kvroute.pictures import compatibility_svg


async def get_compatibility(request: web.Request) -> web.Response:
    deployment = request[validated_key].path["deployment"]
    registry = request.app[registry_key]
    matrix = await deployment_matrix(registry, deployment, now=app_now(request.app))
    if request[validated_key].query.get("format", "json") == "svg":
        return web.Response(text=compatibility_svg(matrix.document()), content_type="image/svg+xml")
    return web.Response(body=matrix.body, content_type="application/json", charset="utf-8")
