"""JSON <-> wire models, driven by the dataclass fields and their type hints.

A model's field names are its JSON members, so one class says what the server renders and what the
client parses. Timestamps travel as ISO 8601 strings, tuples as arrays, nested models as objects;
a field marked ``omit_none`` is left out while it is None (members the spec makes optional rather
than nullable). Decoding names the member that is missing or of the wrong shape.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypeVar

M = TypeVar("M")
OMIT_NONE = {"omit_none": True}


class WireError(ValueError):
    """A body that does not have the shape of its model; names the member."""


def to_json(model: object) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(model):  # type: ignore[arg-type]
        value = getattr(model, field.name)
        if value is None and field.metadata.get("omit_none"):
            continue
        out[field.name] = _encode(value)
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, tuple | list):
        return [_encode(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _encode(item) for key, item in value.items()}
    return value


def from_json(cls: type[M], body: Mapping[str, Any]) -> M:
    if not isinstance(body, Mapping):
        raise WireError(f"{cls.__name__}: expected an object, got {type(body).__name__}")
    values = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name not in body:
            if field.default is not dataclasses.MISSING or field.metadata.get("omit_none"):
                continue
            raise WireError(f"{cls.__name__}: member {field.name!r} is missing")
        try:
            values[field.name] = _decode(_hints(cls)[field.name], body[field.name])
        except (TypeError, ValueError) as error:
            raise WireError(f"{cls.__name__}.{field.name}: {error}") from None
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _decode(inner, value)
    if hint is datetime:
        return datetime.fromisoformat(str(value))
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value)  # type: ignore[arg-type]
    if origin is tuple:
        return tuple(_decode(args[0], item) for item in value)
    if origin is dict or hint is dict:
        return dict(value)
    if origin is list:
        return list(value)
    if hint in (int, float, str, bool):
        if hint is bool and not isinstance(value, bool):
            raise TypeError(f"expected a boolean, got {value!r}")
        return hint(value)
    return value
