"""Every request is validated against ``api_spec/openapi.yaml`` before a handler runs.

openapi-core ships only request adapters for aiohttp; this middleware is the glue. Parameters are
first checked for how they are spelled (an identifier with a newline, a rank written in
Arabic-Indic digits or with a leading zero would otherwise alias another one), then unmarshalled by
openapi-core; bodies go through ``bodies`` (bounded parse, first errors only), off the event loop
when they are large. Security is the auth middleware's job, which can be off. Each failure becomes
problem+json naming the offending field, and what was unmarshalled is stored under
``validated_key``. The split: 400 when the request cannot be parsed (malformed JSON, a parameter of
the wrong type or spelling, nesting too deep), 413 for a body too large or too complex, 415 for a
body that is not JSON, 422 when it parses but breaks the schema.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from openapi_core.casting.schemas.exceptions import CastError
from openapi_core.templating.paths.exceptions import OperationNotFound, PathError
from openapi_core.validation.request.exceptions import ParameterValidationError
from openapi_core.validation.schemas.exceptions import InvalidSchemaValue

from kvroute.api.bodies import check_body, field_path, schema_problem
from kvroute.api.keys import spec_validator_key, validated_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.spec import AliasedParameter, UnknownQueryParameter, ValidatedRequest

# Probes and scrapes must answer even when the spec machinery is the thing that is broken.
UNVALIDATED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Bodies up to this size are checked on the loop (well under a millisecond); larger ones in a thread.
INLINE_BODY_BYTES = 64 * 1024
_REQUIRED = re.compile(r"^'(?P<name>.+)' is a required property$")


def _raise_first(errors: Sequence[Exception]) -> None:
    if errors:
        raise ProblemError(_problem(errors[0]))


def _problem(error: Exception) -> Problem:
    cause = error.__cause__
    if isinstance(error, UnknownQueryParameter):
        field = f"query.{error.name}"
        return Problem(
            422, "Unprocessable Content", str(error), "unknown_parameter", {"field": field}
        )
    if isinstance(error, AliasedParameter):
        return _aliased_problem(error)
    if isinstance(error, OperationNotFound):
        return Problem(405, "Method Not Allowed", str(error), "method_not_allowed")
    if isinstance(error, PathError):
        return Problem(404, "Not Found", str(error), "not_found")
    if isinstance(error, ParameterValidationError):
        return _parameter_problem(error, cause)
    return Problem(400, "Bad Request", str(error), "invalid_request")


def _aliased_problem(error: AliasedParameter) -> Problem:
    field = f"{error.location}.{error.name}"
    if error.malformed:
        return Problem(400, "Bad Request", str(error), "malformed_parameter", {"field": field})
    return schema_problem([{"field": field, "message": str(error)}])


def _parameter_problem(error: ParameterValidationError, cause: BaseException | None) -> Problem:
    name = f"{error.location}.{error.name}"
    if isinstance(cause, CastError):
        detail = f"{error.location} parameter {error.name!r}: {cause.value!r} is not a {cause.type}"
        return Problem(400, "Bad Request", detail, "malformed_parameter", extras={"field": name})
    if isinstance(cause, InvalidSchemaValue):
        return schema_problem(_field_errors(name, cause.schema_errors))
    return Problem(
        422, "Unprocessable Content", str(error), "invalid_parameter", extras={"field": name}
    )


def _field_errors(prefix: str, schema_errors: Iterable[Any]) -> list[dict[str, str]]:
    """jsonschema errors of a parameter -> ``{"field": "query.limit", "message": ...}``."""
    found = []
    for error in schema_errors:
        path = list(error.absolute_path)
        required = _REQUIRED.match(error.message) if error.validator == "required" else None
        if required is not None:
            path.append(required.group("name"))
        found.append({"field": field_path(prefix, path), "message": error.message})
    return found or [{"field": prefix, "message": "invalid value"}]


@web.middleware
async def validation_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    resource = request.match_info.route.resource
    if resource is None or request.path in UNVALIDATED_PATHS:
        return await handler(request)
    validator = request.app[spec_validator_key]
    errors, parameters = validator.parameters(request)
    _raise_first(errors)
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
