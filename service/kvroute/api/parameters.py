"""Path and query parameters checked against the spec's own parameter schemas.

Per operation, the spec's declared parameters become one JSON schema (``{"path": {...},
"query": {...}}`` with their schemas and ``required`` lists), compiled once by ``jsonschema_rs``
like the body schemas. A request's raw strings are first checked for spelling
(``spec.StrictParameter``), integers and booleans are then read as such, and the object is
validated: microseconds where openapi-core spent milliseconds resolving each parameter's schema
again on every request (a fleet's registrations and heartbeats each name a new URL).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import jsonschema_rs

from kvroute.api.bodies import MAX_REPORTED_ERRORS, field_errors

LOCATIONS = ("path", "query")


class ParameterSchemaError(Exception):
    """Parameters that break their schema; ``errors`` are ``{"field", "message"}``, first first."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        super().__init__(errors[0]["message"])
        self.errors = errors


@dataclass(frozen=True)
class OperationParameters:
    integers: frozenset[tuple[str, str]]  # (location, name) of integer parameters
    validator: Any  # jsonschema_rs validator of {"path": {...}, "query": {...}}
    booleans: frozenset[tuple[str, str]] = frozenset()  # spelled "true" or "false" (checked)

    def unmarshal(
        self, path: Mapping[str, str], query: Mapping[str, str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Typed path and query parameters; raises ``ParameterSchemaError``."""
        typed = {
            location: {name: self._read(location, name, value) for name, value in raw.items()}
            for location, raw in (("path", path), ("query", query))
        }
        errors = list(islice(self.validator.iter_errors(typed), MAX_REPORTED_ERRORS))
        if errors:
            raise ParameterSchemaError(field_errors(errors))
        return typed["path"], typed["query"]

    def _read(self, location: str, name: str, value: str) -> int | bool | str:
        if (location, name) in self.integers:
            return int(value)
        if (location, name) in self.booleans:
            return value == "true"
        return value


def operation_parameters(
    spec: Mapping[str, Any], operations: set[tuple[str, str]]
) -> dict[tuple[str, str], OperationParameters]:
    """(METHOD, path template) -> the compiled check of its path and query parameters."""
    compiled = {}
    for method, path in operations:
        item = spec["paths"][path]
        declared = [*item.get("parameters", []), *item[method.lower()].get("parameters", [])]
        schemas: dict[str, dict[str, Any]] = {
            location: {"type": "object", "properties": {}, "required": []} for location in LOCATIONS
        }
        integers, booleans = set(), set()
        for parameter in (resolve(spec, node) for node in declared):
            location = parameter["in"]
            if location not in LOCATIONS:
                continue
            schema = resolve(spec, parameter.get("schema", {}))
            schemas[location]["properties"][parameter["name"]] = schema
            if parameter.get("required", False):
                schemas[location]["required"].append(parameter["name"])
            if schema.get("type") == "integer":
                integers.add((location, parameter["name"]))
            elif schema.get("type") == "boolean":
                booleans.add((location, parameter["name"]))
        root = {"type": "object", "properties": schemas}
        compiled[(method, path)] = OperationParameters(
            frozenset(integers), jsonschema_rs.Draft202012Validator(root), frozenset(booleans)
        )
    return compiled


def resolve(spec: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    """A node with its local ``$ref`` (``#/components/...``) followed."""
    reference = node.get("$ref")
    if reference is None:
        return node
    target: Any = spec
    for part in reference.removeprefix("#/").split("/"):
        target = target[part]
    return resolve(spec, target)
