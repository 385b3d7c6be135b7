"""Plan endpoints: one receiver rank's plan, or every plan of a receiver instance at once.

Handlers translate the validated query into ``PlanKey`` lookups on the app's one ``PlanService``
(shared with the transfer endpoints, so both see the same cached plans) and answer encoded bytes
from ``PlanAnswers``. Refusals propagate to the error boundary: a missing or expired rank is a
``PlanUnavailable`` (409 naming the ranks), an incompatible pair a ``GeometryError`` (409), an
unknown instance ``NotFound`` (404); each is counted by result first.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvroute.api.clock import app_now
from kvroute.api.keys import (
    inventory_key,
    metrics_key,
    plan_answers_key,
    plan_service_key,
    registry_key,
    sessionmaker_key,
    settings_key,
    validated_key,
)
from kvroute.control.admissions import AdmissionMetrics
from kvroute.control.inventory import Inventory
from kvroute.control.plan_answers import MEDIA_TYPES, EncodedPlan, PlanAnswers, PlanMetrics
from kvroute.control.plans import PlanKey, PlanService, PlanUnavailable
from kvroute.control.registry import Registry
from kvroute.geometry import GeometryError
from kvroute.store.errors import NotFound


async def plan_context(app: web.Application) -> AsyncIterator[None]:
    """The registry, inventory and plan services of the app, over its sessionmaker (after
    ``database_context``): every handler and the reaper reach the store through these."""
    registry = Registry(
        app[sessionmaker_key],
        rejection_log_size=app[settings_key].rejection_log_size,
        admission_metrics=AdmissionMetrics.create(app[metrics_key].registry),
    )
    app[registry_key] = registry
    app[inventory_key] = Inventory(app[sessionmaker_key])
    service = PlanService(app[sessionmaker_key], registry.registrations)
    app[plan_service_key] = service
    app[plan_answers_key] = PlanAnswers(service, PlanMetrics.create(app[metrics_key].registry))
    yield


def _result(error: Exception) -> str:
    if isinstance(error, PlanUnavailable):
        return "unavailable"
    if isinstance(error, GeometryError):
        return "incompatible"
    return "not_found" if isinstance(error, NotFound) else "error"


async def _counted(
    request: web.Request, answer: Callable[[], Awaitable[web.Response]]
) -> web.Response:
    metrics = request.app[plan_answers_key].metrics
    try:
        response = await answer()
    except Exception as error:
        metrics.requests.labels(result=_result(error)).inc()
        raise
    metrics.requests.labels(result="ok" if response.status == 200 else "not_modified").inc()
    return response


def _matches(request: web.Request, etag: str) -> bool:
    """RFC 9110 If-None-Match with weak comparison (``W/`` prefixes ignored)."""
    offered = request.headers.get("If-None-Match")
    if offered is None:
        return False
    tags = {tag.strip().removeprefix("W/") for tag in offered.split(",")}
    return "*" in tags or etag in tags


def _plan_key(request: web.Request, receiver_rank: int) -> PlanKey:
    validated = request[validated_key]
    query = validated.query
    return PlanKey(
        validated.path["deployment"],
        query["sender"],
        query["receiver"],
        receiver_rank,
        query.get("sender_dp_rank", 0),
        query.get("prompt_tokens"),
    )


def _response(encoded: EncodedPlan, body: bytes, plan_format: str) -> web.Response:
    return web.Response(
        body=body,
        content_type=MEDIA_TYPES[plan_format],
        charset=None if plan_format == "json" else "utf-8",
        headers={"ETag": encoded.etag},
    )


async def get_plan(request: web.Request) -> web.Response:
    async def answer() -> web.Response:
        query = request[validated_key].query
        plan_format = query.get("format", "json")
        key = _plan_key(request, query["receiver_rank"])
        encoded = await request.app[plan_answers_key].answer(
            key, plan_format, now=app_now(request.app), period=query.get("fragments") == "period"
        )
        if _matches(request, encoded.etag):
            return web.Response(status=304, headers={"ETag": encoded.etag})
        return _response(encoded, encoded.body, plan_format)

    return await _counted(request, answer)


async def get_plan_set(request: web.Request) -> web.Response:
    async def answer() -> web.Response:
        validated = request[validated_key]
        plan_format = validated.query.get("format", "json")
        plans = await request.app[plan_answers_key].plan_set(
            _plan_key(request, 0),
            plan_format,
            now=app_now(request.app),
            period=validated.query.get("fragments") == "period",
        )
        if plan_format == "text":
            body = b"\n".join(plan.body for plan in plans)
        else:
            head = {
                "deployment": validated.path["deployment"],
                "sender": validated.query["sender"],
                "receiver": validated.query["receiver"],
            }
            # The plans are already encoded: splice their bytes instead of decoding them again.
            opening = json.dumps(head, separators=(",", ":")).removesuffix("}") + ',"plans":['
            body = opening.encode() + b",".join(plan.body for plan in plans) + b"]}"
        return web.Response(
            body=body,
            content_type=MEDIA_TYPES[plan_format],
            charset=None if plan_format == "json" else "utf-8",
        )

    return await _counted(request, answer)
