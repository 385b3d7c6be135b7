"""KV integrity per transfer path: ``POST /v1/deployments/{d}/kv-paths`` (a worker reports a canary
or digest outcome) and ``GET`` of the same (every path, judged against the live registrations);
``POST``/``GET .../kv-digests`` (producer ranks' digests of sampled requests, which the consumer
ranks read to compare). All go through ``kvroute.control.kv_paths``."""

from __future__ import annotations

from aiohttp import web

from kvroute import wire
from kvroute.api.clock import app_now
from kvroute.api.keys import metrics_key, sessionmaker_key, validated_key
from kvroute.control import kv_paths


async def post_kv_path(request: web.Request) -> web.Response:
    validated = request[validated_key]
    body = validated.body
    path = await kv_paths.report_path(
        request.app[sessionmaker_key],
        validated.path["deployment"],
        body,
        now=app_now(request.app),
    )
    if path.source == "digest" and path.reported == "failed":
        request.app[metrics_key].count_digest_mismatch(path.producer, path.consumer)
    return web.json_response(wire.to_json(path), status=201)


async def get_kv_paths(request: web.Request) -> web.Response:
    validated = request[validated_key]
    paths = await kv_paths.read_paths(
        request.app[sessionmaker_key], validated.path["deployment"], now=app_now(request.app)
    )
    return web.json_response(wire.to_json(paths))


async def post_kv_digest(request: web.Request) -> web.Response:
    validated = request[validated_key]
    await kv_paths.put_digest(
        request.app[sessionmaker_key],
        validated.path["deployment"],
        validated.body,
        now=app_now(request.app),
    )
    return web.Response(status=204)


async def get_kv_digests(request: web.Request) -> web.Response:
    validated = request[validated_key]
    answer = await kv_paths.get_digests(
        request.app[sessionmaker_key],
        validated.path["deployment"],
        validated.query["producer"],
        validated.query["request_id"],
    )
    return web.json_response(answer)
