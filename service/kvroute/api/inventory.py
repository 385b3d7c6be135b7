"""Read-only views of the registry for operators: deployments, instances, refusals.

Expired ranks stay visible (state ``expired``) until the reaper removes them, so an operator
can see a worker that stopped heartbeating.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvroute.api.clock import app_now
from kvroute.api.keys import sessionmaker_key, validated_key
from kvroute.store import registry
from kvroute.store.records import (
    DeploymentSummary,
    InstanceSummary,
    RankSummary,
    RejectionRecord,
)


async def list_deployments(request: web.Request) -> web.Response:
    deployments = await registry.list_deployments(
        request.app[sessionmaker_key], now=app_now(request.app)
    )
    return web.json_response({"deployments": [deployment_json(item) for item in deployments]})


async def get_deployment(request: web.Request) -> web.Response:
    name = request[validated_key].path["deployment"]
    record = await registry.get_deployment(
        request.app[sessionmaker_key], name, now=app_now(request.app)
    )
    return web.json_response(
        {
            "name": record.name,
            "created_at": record.created_at.isoformat(),
            "live_ranks": record.live_ranks,
            "expired_ranks": record.expired_ranks,
            "instances": [instance_json(item) for item in record.instances],
        }
    )


async def list_instances(request: web.Request) -> web.Response:
    name = request[validated_key].path["deployment"]
    instances = await registry.list_instances(
        request.app[sessionmaker_key], name, now=app_now(request.app)
    )
    return web.json_response(
        {"deployment": name, "instances": [instance_json(item) for item in instances]}
    )


async def get_instance(request: web.Request) -> web.Response:
    path = request[validated_key].path
    record = await registry.get_instance(
        request.app[sessionmaker_key],
        path["deployment"],
        path["instance"],
        now=app_now(request.app),
    )
    body = instance_json(record.summary)
    body["deployment"] = record.summary.deployment
    body["ranks"] = [rank_summary_json(rank) for rank in record.ranks]
    return web.json_response(body)


async def delete_instance(request: web.Request) -> web.Response:
    path = request[validated_key].path
    await registry.delete_instance(
        request.app[sessionmaker_key], path["deployment"], path["instance"]
    )
    return web.Response(status=204)


async def list_rejections(request: web.Request) -> web.Response:
    limit = request[validated_key].query.get("limit", 100)
    rejections = await registry.list_rejections(request.app[sessionmaker_key], limit)
    return web.json_response({"rejections": [rejection_json(item) for item in rejections]})


def deployment_json(summary: DeploymentSummary) -> dict[str, Any]:
    return {
        "name": summary.name,
        "created_at": summary.created_at.isoformat(),
        "instances": summary.instances,
        "live_ranks": summary.live_ranks,
        "expired_ranks": summary.expired_ranks,
    }


def instance_json(summary: InstanceSummary) -> dict[str, Any]:
    return {
        "name": summary.name,
        "role": summary.role,
        "tp_size": summary.tp_size,
        "pp_size": summary.pp_size,
        "attention_dp": summary.attention_dp,
        "dp_size": summary.dp_size,
        "created_at": summary.created_at.isoformat(),
        "live_ranks": summary.live_ranks,
        "expired_ranks": summary.expired_ranks,
    }


def rank_summary_json(summary: RankSummary) -> dict[str, Any]:
    return {
        "rank": summary.rank,
        "role": summary.role,
        "generation": summary.generation,
        "state": summary.lease,
        "registered_at": summary.registered_at.isoformat(),
        "lease_expires_at": summary.lease_expires_at.isoformat(),
    }


def rejection_json(record: RejectionRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "at": record.at.isoformat(),
        "deployment": record.deployment,
        "instance": record.instance,
        "rank": record.rank,
        "stage": record.stage,
        "code": record.code,
        "field": record.field,
        "detail": record.detail,
        "problem": record.problem,
    }
