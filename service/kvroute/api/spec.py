"""The OpenAPI contract as the running service sees it.

``api_spec/openapi.yaml`` is the source of truth; the package reaches it as the resource
``kvroute/api/openapi.yaml`` (a link in the source tree, a copied file in an installed
wheel), so an editable checkout and a container image load the same document.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml
from aiohttp import web
from openapi_core import OpenAPI

from kvroute.api.bodies import body_rules
from kvroute.api.parameters import ParameterSchemaError, operation_parameters, resolve

SPEC_RESOURCE = ("kvroute.api", "openapi.yaml")
# How an integer parameter is spelled: int() would also take "١", "+1", " 1", "1_0" and "01".
CANONICAL_INTEGER = re.compile(r"0|-?[1-9][0-9]{0,17}", re.ASCII)
# How a typed parameter is spelled, and how its refusal says so; a boolean as JSON's literals, so
# "1", "yes" and "True" alias nothing.
SPELLINGS = {
    "integer": (CANONICAL_INTEGER, "a decimal integer (ASCII digits, no leading zeros)"),
    "boolean": (re.compile(r"true|false"), "true or false"),
}


def spec_bytes() -> bytes:
    package, name = SPEC_RESOURCE
    return resources.files(package).joinpath(name).read_bytes()


def load_spec(text: bytes) -> dict[str, Any]:
    """Parse the document and check it is valid OpenAPI 3.1 (openapi-core's spec validator), so a
    broken spec fails at startup rather than per request."""
    document: dict[str, Any] = yaml.safe_load(text)
    OpenAPI.from_dict(document)
    return document


@dataclass(frozen=True)
class ValidatedRequest:
    """What validation unmarshalled: path/query parameters and the JSON body."""

    path: Mapping[str, Any]
    query: Mapping[str, Any]
    body: Any


class UnknownQueryParameter(Exception):
    """A query parameter the operation does not declare (a typo would otherwise be ignored)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"query parameter {name!r} is not accepted here")
        self.name = name


class AliasedParameter(Exception):
    """A parameter spelled in a way that would alias another value (``١`` for 1, ``a\\nb``)."""

    def __init__(self, location: str, name: str, value: str, expected: str, *, malformed: bool):
        super().__init__(f"{location} parameter {name!r}: {value!r} is not {expected}")
        self.location = location
        self.name = name
        self.malformed = malformed  # unparseable (400) rather than out of the schema (422)


class UndeclaredOperation(Exception):
    """A route the app serves but the spec does not declare: refused like an unknown path."""

    def __init__(self, method: str, path: str) -> None:
        super().__init__(f"{method} {path} is not an operation of the API")


@dataclass(frozen=True)
class StrictParameter:
    """How one path or query parameter's raw text must be spelled before it is parsed."""

    location: str
    name: str
    kind: str | None  # "integer" or "boolean": spelled as ``SPELLINGS`` says
    pattern: re.Pattern[str] | None

    def check(self, value: str) -> None:
        if self.kind is not None:
            spelling, expected = SPELLINGS[self.kind]
            if not spelling.fullmatch(value):
                raise AliasedParameter(self.location, self.name, value, expected, malformed=True)
        if self.pattern is not None and not self.pattern.fullmatch(value):
            expected = f"matched by {self.pattern.pattern}"
            raise AliasedParameter(self.location, self.name, value, expected, malformed=False)


class SpecValidator:
    """Parameter unmarshallers and body rules for one spec, built once per app.

    Security requirements are deliberately not checked here: auth is its own middleware
    and is off on a loopback-only server.
    """

    def __init__(self, document: Mapping[str, Any]) -> None:
        self._query_names = declared_query_parameters(document)
        self._strict = strict_parameters(document)
        self._parameters = operation_parameters(document, spec_operations(document))
        self.bodies = body_rules(document)

    def parameters(self, request: web.Request) -> tuple[Sequence[Exception], ValidatedRequest]:
        """Path and query parameters, spelled strictly, then checked against their schemas."""
        resource = request.match_info.route.resource
        operation = (request.method, resource.canonical if resource else "")
        allowed = self._query_names.get(operation, frozenset())
        unknown = sorted(set(request.query) - allowed)
        if unknown:
            return [UnknownQueryParameter(unknown[0])], ValidatedRequest({}, {}, None)
        declared = self._parameters.get(operation)
        if declared is None:
            return [UndeclaredOperation(request.method, request.path)], ValidatedRequest(
                {}, {}, None
            )
        try:
            self._check_spelling(request, operation)
            path, query = declared.unmarshal(dict(request.match_info), dict(request.query))
        except (AliasedParameter, ParameterSchemaError) as error:
            return [error], ValidatedRequest({}, {}, None)
        return [], ValidatedRequest(path, query, None)

    def _check_spelling(self, request: web.Request, operation: tuple[str, str]) -> None:
        for parameter in self._strict.get(operation, ()):
            if parameter.location == "path":
                values = [request.match_info.get(parameter.name, "")]
            else:
                values = request.query.getall(parameter.name, [])
                if len(values) > 1:
                    raise AliasedParameter(
                        "query", parameter.name, values[1], "given once", malformed=True
                    )
            for value in values:
                parameter.check(value)


@functools.lru_cache(maxsize=4)
def spec_validator(text: bytes) -> SpecValidator:
    """The checked validator of one spec text. Checking takes most of a second and its verdict
    depends on the bytes only, so a process that builds apps again (the test suite builds
    hundreds) checks each text once; the validator holds compiled schemas and is never mutated."""
    return SpecValidator(load_spec(text))


def strict_parameters(
    spec: Mapping[str, Any],
) -> dict[tuple[str, str], tuple[StrictParameter, ...]]:
    """(METHOD, path template) -> the spelling rules of its integer, boolean and patterned
    parameters."""
    rules = {}
    for method, path in spec_operations(spec):
        item = spec["paths"][path]
        parameters = [*item.get("parameters", []), *item[method.lower()].get("parameters", [])]
        found = []
        for parameter in (resolve(spec, node) for node in parameters):
            schema = resolve(spec, parameter.get("schema", {}))
            pattern = schema.get("pattern")
            if parameter["in"] not in ("path", "query"):
                continue
            kind = schema.get("type") if schema.get("type") in SPELLINGS else None
            if kind is not None or pattern is not None:
                found.append(
                    StrictParameter(
                        parameter["in"],
                        parameter["name"],
                        kind,
                        # ECMA-262 semantics: ASCII classes, and "$" only at the very end.
                        re.compile(pattern, re.ASCII) if pattern is not None else None,
                    )
                )
        rules[(method, path)] = tuple(found)
    return rules


def spec_operations(spec: Mapping[str, Any]) -> set[tuple[str, str]]:
    """Every (METHOD, path template) the document declares."""
    methods = {"get", "put", "post", "delete", "patch", "head", "options"}
    return {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method in item
        if method in methods
    }


def declared_query_parameters(spec: Mapping[str, Any]) -> dict[tuple[str, str], frozenset[str]]:
    """(METHOD, path template) -> names of the query parameters the operation declares."""
    declared = {}
    for method, path in spec_operations(spec):
        item = spec["paths"][path]
        parameters = [*item.get("parameters", []), *item[method.lower()].get("parameters", [])]
        declared[(method, path)] = frozenset(
            resolve(spec, parameter)["name"]
            for parameter in parameters
            if resolve(spec, parameter)["in"] == "query"
        )
    return declared
