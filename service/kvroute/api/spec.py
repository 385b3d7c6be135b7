"""The OpenAPI contract as the running service sees it.

``api_spec/openapi.yaml`` is the source of truth; the package reaches it as the resource
``kvroute/api/openapi.yaml`` (a link in the source tree, a copied file in an installed
wheel), so an editable checkout and a container image load the same document.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml
from aiohttp import web
from openapi_core import OpenAPI
from openapi_core.contrib.aiohttp import AIOHTTPOpenAPIWebRequest
from openapi_core.unmarshalling.request.unmarshallers import V31RequestParametersUnmarshaller
from openapi_core.validation.request.validators import V31RequestBodyValidator

SPEC_RESOURCE = ("kvroute.api", "openapi.yaml")
# Parameter results remembered per (operation, path, query): hot reads (plans, heartbeats) repeat
# the same URL, and openapi-core spends ~2 ms per parameter resolving its schema again.
PARAMETER_CACHE_SIZE = 4096


def spec_bytes() -> bytes:
    package, name = SPEC_RESOURCE
    return resources.files(package).joinpath(name).read_bytes()


def load_spec(text: bytes) -> tuple[dict[str, Any], OpenAPI]:
    """Parse and check the document (a broken spec fails at startup, not per request)."""
    document = yaml.safe_load(text)
    return document, OpenAPI.from_dict(document)


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


class SpecValidator:
    """Parameter and body unmarshallers for one spec, built once per app.

    Security requirements are deliberately not checked here: auth is its own middleware
    and is off on a loopback-only server.
    """

    def __init__(self, spec: OpenAPI, document: Mapping[str, Any]) -> None:
        self._parameters = V31RequestParametersUnmarshaller(spec.spec)
        # Validate-only for bodies: unmarshalling a registration document node by node costs
        # ~15x more than validating it, and the JSON is the document the handler needs anyway.
        self._body = V31RequestBodyValidator(spec.spec)
        self._query_names = declared_query_parameters(document)
        self._url_only = url_only_operations(document)
        self._parameters_seen: OrderedDict[tuple[str, ...], ValidatedRequest] = OrderedDict()
        self._with_body = {
            (method, path)
            for method, path in spec_operations(document)
            if "requestBody" in document["paths"][path][method.lower()]
        }

    def unmarshal(
        self, request: web.Request, body: bytes | None
    ) -> tuple[Sequence[Exception], ValidatedRequest]:
        resource = request.match_info.route.resource
        operation = (request.method, resource.canonical if resource else "")
        allowed = self._query_names.get(operation, frozenset())
        unknown = sorted(set(request.query) - allowed)
        if unknown:
            return [UnknownQueryParameter(unknown[0])], ValidatedRequest({}, {}, None)
        if operation not in self._with_body and operation in self._url_only:
            # The URL alone decides the result: no body to check, no header parameters.
            key = (*operation, request.path, request.query_string)
            seen = self._parameters_seen.get(key)
            if seen is None:
                errors, seen = self._unmarshal(request, operation, None)
                if errors:
                    return errors, seen
                self._parameters_seen[key] = seen
                if len(self._parameters_seen) > PARAMETER_CACHE_SIZE:
                    self._parameters_seen.popitem(last=False)
            return [], seen
        return self._unmarshal(request, operation, body)

    def _unmarshal(
        self, request: web.Request, operation: tuple[str, str], body: bytes | None
    ) -> tuple[Sequence[Exception], ValidatedRequest]:
        adapted = AIOHTTPOpenAPIWebRequest(request, body=body)
        parameters = self._parameters.unmarshal(adapted)
        if parameters.errors:
            return parameters.errors, ValidatedRequest({}, {}, None)
        if operation not in self._with_body:
            # An operation without a requestBody ignores whatever body was sent.
            return [], ValidatedRequest(
                parameters.parameters.path, parameters.parameters.query, None
            )
        errors = list(self._body.iter_errors(adapted))
        validated = ValidatedRequest(
            path=parameters.parameters.path,
            query=parameters.parameters.query,
            body=json.loads(body) if body and not errors else None,
        )
        return errors, validated


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
            _resolve(spec, parameter)["name"]
            for parameter in parameters
            if _resolve(spec, parameter)["in"] == "query"
        )
    return declared


def url_only_operations(spec: Mapping[str, Any]) -> frozenset[tuple[str, str]]:
    """Operations whose parameters all live in the path or the query string."""
    found = set()
    for method, path in spec_operations(spec):
        item = spec["paths"][path]
        parameters = [*item.get("parameters", []), *item[method.lower()].get("parameters", [])]
        if all(_resolve(spec, parameter)["in"] in ("path", "query") for parameter in parameters):
            found.add((method, path))
    return frozenset(found)


def _resolve(spec: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    reference = node.get("$ref")
    if reference is None:
        return node
    target: Any = spec
    for part in reference.removeprefix("#/").split("/"):
        target = target[part]
    return _resolve(spec, target)
