"""Request bodies: parsed and checked against the spec at a cost bounded before the full check.

A body goes through four gates, each cheaper than the next and each answering the first problem:

1. a count of the separators in the raw bytes bounds how many JSON values it can hold (413 past
   ``MAX_JSON_VALUES``) before anything is parsed;
2. ``json.loads`` (400 ``malformed_json``; nesting deeper than the parser's recursion limit is 400
   ``nesting_too_deep``, never a RecursionError);
3. an iterative walk bounds the depth (``MAX_JSON_DEPTH``) and the exact value count;
4. the operation's schema, compiled once per app with ``jsonschema_rs`` (a few milliseconds for the
   largest document the limits allow, where the pure-Python validator took seconds), reporting at
   most ``MAX_REPORTED_ERRORS`` errors instead of every error of a hostile body.

The caller runs ``check`` off the event loop: parsing a 4 MiB body holds the GIL for tens of
milliseconds, which is nothing next to a probe, but must not be spent on the loop itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import jsonschema_rs

from kvroute.api.problems import Problem, ProblemError

JSON_MEDIA_TYPE = "application/json"
# Our schemas nest at most 6 levels; anything much deeper is not a kvroute document.
MAX_JSON_DEPTH = 32
# Two lists of 65536 block ids (a transfer request) plus room; a registration needs ~25k at most.
MAX_JSON_VALUES = 1 << 18
MAX_REPORTED_ERRORS = 8
MAX_MESSAGE_CHARS = 200


@dataclass(frozen=True)
class BodyRule:
    """What one operation accepts: a JSON body matching ``validator``, required or not."""

    validator: Any  # jsonschema_rs.Draft202012Validator
    required: bool


def body_rules(document: Mapping[str, Any]) -> dict[tuple[str, str], BodyRule]:
    """(METHOD, path template) -> its body rule, for every operation that declares a JSON body."""
    rules = {}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            body = operation.get("requestBody") if isinstance(operation, Mapping) else None
            if body is None:
                continue
            schema = body["content"][JSON_MEDIA_TYPE]["schema"]
            # The body schema's $refs point into the spec's components: make them resolvable.
            root = {**schema, "components": document["components"]}
            rules[(method.upper(), path)] = BodyRule(
                jsonschema_rs.Draft202012Validator(root), bool(body.get("required", False))
            )
    return rules


def check_body(rule: BodyRule, content_type: str, body: bytes | None) -> Any:
    """The parsed body when it is acceptable; raises ``ProblemError`` with the first problem."""
    if not body:
        if rule.required:
            raise _problem(400, "Bad Request", "a JSON body is required", "missing_body")
        return None
    if content_type != JSON_MEDIA_TYPE:
        detail = f"the body must be {JSON_MEDIA_TYPE}, not {content_type}"
        raise _problem(415, "Unsupported Media Type", detail, "unsupported_media_type")
    # Every value but the first follows a comma or opens a container: an upper bound, for free.
    if 1 + body.count(b",") + body.count(b"[") + body.count(b"{") > MAX_JSON_VALUES:
        raise _too_complex()
    value = _parse(body)
    _check_shape(value)
    errors = list(islice(rule.validator.iter_errors(value), MAX_REPORTED_ERRORS))
    if errors:
        raise ProblemError(schema_problem(field_errors(errors)))
    return value


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # includes UnicodeDecodeError and over-long integer literals
        raise _problem(400, "Bad Request", "the body is not valid JSON", "malformed_json") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_shape(value: Any) -> None:
    """At most ``MAX_JSON_DEPTH`` levels and ``MAX_JSON_VALUES`` values, without recursion: one
    level at a time, so a value's depth is its level's (``json.loads`` makes dicts and lists only,
    whose exact types are tested: the walk visits every value of a document)."""
    if type(value) is not dict and type(value) is not list:
        return
    seen = 1
    level: list[Any] = [value]
    depth = 1
    while level:
        below: list[Any] = []
        for node in level:
            seen += len(node)
            for child in node.values() if type(node) is dict else node:
                if type(child) is dict or type(child) is list:
                    below.append(child)
        if seen > MAX_JSON_VALUES:
            raise _too_complex()
        if below and depth >= MAX_JSON_DEPTH:
            raise _too_deep()
        level = below
        depth += 1


def _too_complex() -> ProblemError:
    detail = f"the body holds more than {MAX_JSON_VALUES} JSON values; no kvroute document does"
    return _problem(413, "Content Too Large", detail, "body_too_complex")


def _too_deep() -> ProblemError:
    detail = f"the body nests deeper than {MAX_JSON_DEPTH} levels; no kvroute document does"
    return _problem(400, "Bad Request", detail, "nesting_too_deep")


def _problem(status: int, title: str, detail: str, code: str) -> ProblemError:
    return ProblemError(Problem(status, title, detail, code))


def schema_problem(errors: list[dict[str, str]]) -> Problem:
    """422 naming the first (deepest) offending field; ``errors`` lists what was found."""
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


def field_errors(errors: Iterable[Any]) -> list[dict[str, str]]:
    """jsonschema_rs errors -> ``{"field": "pools[0].slot_bytes", "message": ...}``, deepest first."""
    found = []
    for error in errors:
        error = _deepest(error)
        path = list(error.instance_path)
        if error.kind.name == "required":
            path.append(error.kind.as_dict()["property"])
        found.append({"field": field_path("", path), "message": _message(error)})
    found.sort(key=lambda item: -item["field"].count(".") - item["field"].count("["))
    return found


def _deepest(error: Any) -> Any:
    """For ``oneOf``/``anyOf``, the branch error that went deepest (as jsonschema's best_match)."""
    if error.kind.name not in ("oneOf", "anyOf"):
        return error
    branches = [inner for branch in error.kind.as_dict()["context"] for inner in branch]
    # A branch that only failed on its type says less than one that failed inside the value.
    informative = [inner for inner in branches if inner.kind.name != "type"] or branches
    if not informative:
        return error
    return _deepest(max(informative, key=lambda inner: len(inner.instance_path)))


def _message(error: Any) -> str:
    message: str = error.message
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    # The message starts with the offending value, which may be the whole hostile array.
    kind, facts = error.kind.name, error.kind.as_dict()
    if kind in ("maxItems", "minItems", "maxProperties", "minProperties", "maxLength", "minLength"):
        bound = "more" if kind.startswith("max") else "fewer"
        return f"has {bound} than {facts['limit']} {_unit(kind)}"
    return message[:MAX_MESSAGE_CHARS] + "..."


def _unit(kind: str) -> str:
    return {"Items": "items", "Properties": "properties", "Length": "characters"}[kind[3:]]


def field_path(prefix: str, parts: Iterable[object]) -> str:
    text = prefix
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text
