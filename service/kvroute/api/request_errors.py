"""Request-validation failures as problem+json: the renderers the error table uses for them.

400 when the request cannot be parsed (a parameter of the wrong type or spelling), 404/405 for an
unknown path or method, 422 when it parses but breaks the schema or names an undeclared parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from openapi_core.casting.schemas.exceptions import CastError
from openapi_core.exceptions import OpenAPIError
from openapi_core.templating.paths.exceptions import OperationNotFound, PathError
from openapi_core.validation.request.exceptions import ParameterValidationError
from openapi_core.validation.schemas.exceptions import InvalidSchemaValue

from kvroute.api.bodies import field_path, schema_problem
from kvroute.api.problems import Problem
from kvroute.api.spec import AliasedParameter, UnknownQueryParameter

# What the validation middleware raises for a request the spec refuses.
REQUEST_ERRORS = (UnknownQueryParameter, AliasedParameter, OpenAPIError)
_REQUIRED = re.compile(r"^'(?P<name>.+)' is a required property$")


def request_problem(error: Exception) -> Problem:
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
