"""The OpenAPI contract as the running service sees it.

``api_spec/openapi.yaml`` is the source of truth; the package reaches it as the resource
``kvroute/api/openapi.yaml`` (a link in the source tree, a copied file in an installed
wheel), so an editable checkout and a container image load the same document.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml
from aiohttp import web
from openapi_core import OpenAPI
from openapi_core.contrib.aiohttp import AIOHTTPOpenAPIWebRequest
from openapi_core.unmarshalling.request.unmarshallers import (
    V31RequestBodyUnmarshaller,
    V31RequestParametersUnmarshaller,
)

SPEC_RESOURCE = ("kvroute.api", "openapi.yaml")


def spec_bytes() -> bytes:
    package, name = SPEC_RESOURCE
    return resources.files(package).joinpath(name).read_bytes()


def load_spec(text: bytes) -> OpenAPI:
    """Parse and check the document (a broken spec fails at startup, not per request)."""
    return OpenAPI.from_dict(yaml.safe_load(text))


@dataclass(frozen=True)
class ValidatedRequest:
    """What validation unmarshalled: path/query parameters and the JSON body."""

    path: Mapping[str, Any]
    query: Mapping[str, Any]
    body: Any


class SpecValidator:
    """Parameter and body unmarshallers for one spec, built once per app.

    Security requirements are deliberately not checked here: auth is its own middleware
    and is off on a loopback-only server.
    """

    def __init__(self, spec: OpenAPI) -> None:
        self._parameters = V31RequestParametersUnmarshaller(spec.spec)
        self._body = V31RequestBodyUnmarshaller(spec.spec)

    def unmarshal(
        self, request: web.Request, body: bytes | None
    ) -> tuple[Sequence[Exception], ValidatedRequest]:
        adapted = AIOHTTPOpenAPIWebRequest(request, body=body)
        parameters = self._parameters.unmarshal(adapted)
        if parameters.errors:
            return parameters.errors, ValidatedRequest({}, {}, None)
        payload = self._body.unmarshal(adapted)
        validated = ValidatedRequest(
            path=parameters.parameters.path,
            query=parameters.parameters.query,
            body=payload.body,
        )
        return payload.errors, validated


def spec_operations(spec: Mapping[str, Any]) -> set[tuple[str, str]]:
    """Every (METHOD, path template) the document declares."""
    methods = {"get", "put", "post", "delete", "patch", "head", "options"}
    return {
        (method.upper(), path)
        for path, item in spec["paths"].items()
        for method in item
        if method in methods
    }
