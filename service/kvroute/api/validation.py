"""Every request is validated against ``api_spec/openapi.yaml`` before a handler runs.

openapi-core ships only request adapters for aiohttp; this middleware is the glue. It
checks parameters and the body (security is the auth middleware's job, which can be off),
turns each failure into problem+json naming the offending field, and stores what it
unmarshalled under ``validated_key``. The split: 400 when the request cannot be parsed
(malformed JSON, a parameter of the wrong type), 415 for a body that is not JSON, 422 when
it parses but breaks the schema.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from openapi_core.casting.schemas.exceptions import CastError
from openapi_core.deserializing.media_types.exceptions import MediaTypeDeserializeError
from openapi_core.templating.media_types.exceptions import MediaTypeNotFound
from openapi_core.templating.paths.exceptions import OperationNotFound, PathError
from openapi_core.validation.request.exceptions import (
    MissingRequestBodyError,
    ParameterValidationError,
)
from openapi_core.validation.schemas.exceptions import InvalidSchemaValue

from kvroute.api.keys import spec_validator_key, validated_key
from kvroute.api.problems import Problem, ProblemError
from kvroute.api.spec import UnknownQueryParameter

# Probes and scrapes must answer even when the spec machinery is the thing that is broken.
UNVALIDATED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
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
    if isinstance(error, OperationNotFound):
        return Problem(405, "Method Not Allowed", str(error), "method_not_allowed")
    if isinstance(error, PathError):
        return Problem(404, "Not Found", str(error), "not_found")
    if isinstance(cause, MediaTypeNotFound):
        detail = f"the body must be application/json, not {cause.mimetype}"
        return Problem(415, "Unsupported Media Type", detail, "unsupported_media_type")
    if isinstance(cause, MediaTypeDeserializeError):
        return Problem(400, "Bad Request", "the body is not valid JSON", "malformed_json")
    if isinstance(error, MissingRequestBodyError):
        return Problem(400, "Bad Request", "a JSON body is required", "missing_body")
    if isinstance(error, ParameterValidationError):
        return _parameter_problem(error, cause)
    if isinstance(cause, InvalidSchemaValue):
        return _schema_problem(_field_errors("", cause.schema_errors))
    return Problem(400, "Bad Request", str(error), "invalid_request")


def _parameter_problem(error: ParameterValidationError, cause: BaseException | None) -> Problem:
    name = f"{error.location}.{error.name}"
    if isinstance(cause, CastError):
        detail = f"{error.location} parameter {error.name!r}: {cause.value!r} is not a {cause.type}"
        return Problem(400, "Bad Request", detail, "malformed_parameter", extras={"field": name})
    if isinstance(cause, InvalidSchemaValue):
        return _schema_problem(_field_errors(name, cause.schema_errors))
    return Problem(
        422, "Unprocessable Content", str(error), "invalid_parameter", extras={"field": name}
    )


def _schema_problem(errors: list[dict[str, str]]) -> Problem:
    first = errors[0]
    detail = f"{first['field'] or 'body'}: {first['message']}"
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more)"
    return Problem(
        422,
        "Unprocessable Content",
        detail,
        "schema_violation",
        extras={"field": first["field"], "errors": errors},
    )


def _field_errors(prefix: str, schema_errors: Iterable[Any]) -> list[dict[str, str]]:
    """jsonschema errors -> ``{"field": "pools[0].slot_bytes", "message": ...}``."""
    found = []
    for error in schema_errors:
        path = list(error.absolute_path)
        required = _REQUIRED.match(error.message) if error.validator == "required" else None
        if required is not None:
            path.append(required.group("name"))
        found.append({"field": field_path(prefix, path), "message": error.message})
    # Deepest first: "pools[0].pool_id is not an integer" says more than "body is invalid".
    found.sort(key=lambda item: -item["field"].count(".") - item["field"].count("["))
    return found or [{"field": prefix, "message": "invalid value"}]


def field_path(prefix: str, parts: Iterable[object]) -> str:
    text = prefix
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text


@web.middleware
async def validation_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.match_info.route.resource is None or request.path in UNVALIDATED_PATHS:
        return await handler(request)
    body = await request.read() if request.body_exists else None
    errors, validated = request.app[spec_validator_key].unmarshal(request, body)
    _raise_first(errors)
    request[validated_key] = validated
    return await handler(request)
