"""Request-validation failures as problem+json: the renderers the error table uses for them.

400 when a parameter cannot be read as what it claims (a rank in Arabic-Indic digits, an
identifier with a newline), 404 for an operation the spec does not declare, 422 when parameters
read fine but break their schema or one is not declared at all.
"""

from __future__ import annotations

from kvroute.api.bodies import schema_problem
from kvroute.api.parameters import ParameterSchemaError
from kvroute.api.problems import Problem
from kvroute.api.spec import AliasedParameter, UndeclaredOperation, UnknownQueryParameter

# What the validation middleware raises for a request the spec refuses.
REQUEST_ERRORS = (
    UnknownQueryParameter,
    AliasedParameter,
    ParameterSchemaError,
    UndeclaredOperation,
)


def request_problem(error: Exception) -> Problem:
    if isinstance(error, UnknownQueryParameter):
        field = f"query.{error.name}"
        return Problem(
            422, "Unprocessable Content", str(error), "unknown_parameter", {"field": field}
        )
    if isinstance(error, AliasedParameter):
        field = f"{error.location}.{error.name}"
        if error.malformed:
            return Problem(400, "Bad Request", str(error), "malformed_parameter", {"field": field})
        return schema_problem([{"field": field, "message": str(error)}])
    if isinstance(error, ParameterSchemaError):
        return schema_problem(error.errors)
    return Problem(404, "Not Found", str(error), "not_found")
