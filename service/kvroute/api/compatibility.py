"""``GET /v1/deployments/{d}/compatibility``: the matrix from ``kvroute.control.compatibility``."""

from __future__ import annotations

from aiohttp import web

from kvroute.api.keys import plan_service_key, sessionmaker_key, validated_key
from kvroute.api.registration import utcnow
from kvroute.control.compatibility import deployment_matrix


async def get_compatibility(request: web.Request) -> web.Response:
    deployment = request[validated_key].path["deployment"]
    matrix = await deployment_matrix(
        request.app[sessionmaker_key],
        request.app[plan_service_key].registrations,
        deployment,
        now=utcnow(),
    )
    return web.json_response(matrix)
