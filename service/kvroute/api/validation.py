"""Every request is validated against ``api_spec/openapi.yaml`` before a handler runs.

Parameters are first checked for how they are spelled (an identifier with a newline, a rank
written in Arabic-Indic digits or with a leading zero would otherwise alias another one), then
converted and checked against their schemas (``parameters``, compiled once per operation); bodies
go through ``bodies`` (bounded parse, first errors only), off the event loop when they are large.
Security is the auth middleware's job, which can be off. Each failure is raised to the error
boundary, which renders it as problem+json naming the offending field, and what was validated is
stored under ``validated_key``. The split: 400 when the request cannot be parsed (malformed JSON, a parameter of
the wrong type or spelling, nesting too deep), 413 for a body too large or too complex, 415 for a
body that is not JSON, 422 when it parses but breaks the schema.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler

from kvroute.api.bodies import check_body
from kvroute.api.keys import spec_validator_key, validated_key
from kvroute.api.spec import ValidatedRequest

# Probes and scrapes must answer even when the spec machinery is the thing that is broken.
UNVALIDATED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Bodies up to this size are checked on the loop (well under a millisecond); larger ones in a thread.
INLINE_BODY_BYTES = 64 * 1024


@web.middleware
async def validation_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    resource = request.match_info.route.resource
    if resource is None or request.path in UNVALIDATED_PATHS:
        return await handler(request)
    validator = request.app[spec_validator_key]
    errors, parameters = validator.parameters(request)
    if errors:
        raise errors[0]  # the error boundary renders it (``api.request_errors``)
    body = None
    rule = validator.bodies.get((request.method, resource.canonical))
    if rule is not None:
        raw = await request.read() if request.body_exists else None
        if raw is not None and len(raw) > INLINE_BODY_BYTES:
            body = await asyncio.to_thread(check_body, rule, request.content_type, raw)
        else:
            body = check_body(rule, request.content_type, raw)
    request[validated_key] = ValidatedRequest(parameters.path, parameters.query, body)
    return await handler(request)
