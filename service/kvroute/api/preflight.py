"""Questions that store nothing: would these ranks be admitted, and would this model layout work?

``POST /v1/deployments/{d}/admission-checks`` runs the real admission (``control.Registry.dry_run``:
the same reads and checks as a registration, in a read-only transaction) for the ranks of one or two
new instances against the deployment's live ranks. ``POST /v1/preflight`` is ``kvroute check``
for the console: a pasted config.json and two layouts, answered with the verdict, the plan summary
and a generation rank's plan as a table and a picture. Both answer 200 with a verdict; a refusal
is an answer here, not an error. Worker scope: asking is not registering.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kvroute.api.clock import app_now
from kvroute.api.errors import GEOMETRY_STATUS
from kvroute.api.keys import registry_key, validated_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.engines.models import (
    LayoutError,
    UnsupportedConfig,
    UnsupportedLayout,
    model_spec,
    normalize,
    parse_layout,
)
from kvroute.engines.models.preflight import GENERATION, admit, describe, summary
from kvroute.geometry import GeometryError, RankRegistration
from kvroute.pictures import plan_svg
from kvroute.render import plan_text

# Ranks per side the endpoint derives and plans: seconds of CPU at this size (kvroute check has
# no such bound); a fleet's instances are far smaller.
MAX_PREFLIGHT_RANKS = 256


def refusal_json(error: GeometryError, instance: str | None, rank: int | None) -> dict[str, Any]:
    """The problem members registration would answer, with its status and the rank it hit."""
    return {
        **error.to_problem(),
        "status": GEOMETRY_STATUS.get(error.stage, 422),
        "instance": instance,
        "rank": rank,
    }


async def post_admission_check(request: web.Request) -> web.Response:
    deployment = request[validated_key].path["deployment"]
    candidates: list[RankRegistration] = []
    answer: dict[str, Any] = {"deployment": deployment, "admitted": True}
    for entry in request[validated_key].body["instances"]:
        for rank, document in enumerate(entry["ranks"]):
            try:
                candidates.append(
                    await asyncio.to_thread(
                        RankRegistration.from_json,
                        document,
                        deployment=deployment,
                        instance=entry["instance"],
                        rank=rank,
                    )
                )
            except GeometryError as error:
                answer.update(admitted=False, refusal=refusal_json(error, entry["instance"], rank))
                answer["checked_ranks"] = len(candidates)
                return web.json_response(answer)
    keys = [reg.key for reg in candidates]
    if len(set(keys)) != len(keys):
        raise ProblemError(
            Problem(
                422, "Unprocessable Content", "an instance is named twice", "duplicate_instance"
            )
        )
    checked, refusal = await request.app[registry_key].dry_run(candidates, now=app_now(request.app))
    answer["checked_ranks"] = checked
    if refusal is not None:
        refused = candidates[checked]
        answer.update(admitted=False, refusal=refusal_json(refusal, refused.instance, refused.rank))
    return web.json_response(answer)


async def post_preflight(request: web.Request) -> web.Response:
    body = request[validated_key].body
    return web.json_response(await asyncio.to_thread(preflight, body))


def _invalid(field: str, detail: str, code: str) -> ProblemError:
    return ProblemError(
        Problem(422, "Unprocessable Content", f"{field}: {detail}", code, {"field": field})
    )


def preflight(body: dict[str, Any]) -> dict[str, Any]:
    """``kvroute check`` on a request body (configs as mappings, layouts as strings)."""
    specs = {}
    for key in ("model", "generation_model", "draft", "generation_draft"):
        if body.get(key) is None:
            continue
        try:
            specs[key] = model_spec(normalize(body[key]))
        except UnsupportedConfig as error:
            raise _invalid(f"{key}.{error.key}", error.reason, "unsupported_model_config") from None
    try:
        layouts = {side: parse_layout(body[side], side) for side in ("context", "generation")}
    except LayoutError as error:
        raise _invalid("layout", str(error), "invalid_layout") from None
    for side, layout in layouts.items():
        if layout.ranks > MAX_PREFLIGHT_RANKS:
            detail = (
                f"{layout.ranks} ranks; this endpoint plans at most {MAX_PREFLIGHT_RANKS} per side"
            )
            raise _invalid(side, detail, "invalid_layout")
    model = specs["model"]
    draft = specs.get("draft")
    try:
        context = describe(model, layouts["context"], draft=draft)
        generation = describe(
            specs.get("generation_model", model),
            layouts["generation"],
            draft=specs.get("generation_draft", draft),
            name=GENERATION,
        )
    except (UnsupportedConfig, UnsupportedLayout) as error:
        raise _invalid(error.key, error.reason, "unsupported_layout") from None
    except LayoutError as error:
        raise _invalid("layout", str(error), "invalid_layout") from None
    verdict = admit(context, generation)
    answer: dict[str, Any] = {
        "compatible": verdict.compatible,
        "ranks": {"context": len(context.documents), "generation": len(generation.documents)},
    }
    if verdict.refusal is not None:
        answer["refusal"] = refusal_json(verdict.refusal, verdict.instance, verdict.rank)
        return answer
    answer["summary"] = summary(verdict, layouts["generation"].tpb, body.get("prompt_tokens", 8192))
    rank = body.get("rank", 0)
    if rank >= len(verdict.plans):
        raise _invalid(
            "rank", f"the generation instance has {len(verdict.plans)} ranks", "invalid_rank"
        )
    plan = verdict.plans[rank]
    answer.update(rank=rank, plan_text=plan_text(plan), svg=plan_svg(plan))
    return answer
