"""JSON <-> wire models, driven by the dataclass fields and their type hints.

A model's field names are its JSON members, so one class says what the server renders and what the
client parses. Timestamps travel as ISO 8601 strings, tuples as arrays, nested models as objects;
a field marked ``omit_none`` is left out while it is None (members the spec makes optional rather
than nullable). Decoding is strict: a member of the wrong JSON type is refused, never coerced (no
string for a number, no float for an integer, no boolean for either), and the error names it.
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
    out: dict[str, Any] = {}
    # mypy holds a class not Hashable (its __hash__ is read as the instances' unbound one).
    for name, omit_none in _members(type(model)):  # type: ignore[arg-type]
        value = getattr(model, name)
        if value is None:
            if not omit_none:
                out[name] = None
        elif type(value) in _PLAIN:
            out[name] = value
        else:
            out[name] = _encode(value)
    return out


@functools.cache
def _members(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, omit_none) of each field, in order: read once per class, not once per object (a
    matrix renders tens of thousands of cells)."""
    return tuple(
        (field.name, bool(field.metadata.get("omit_none"))) for field in dataclasses.fields(cls)
    )


_PLAIN = frozenset({str, int, float, bool})


def _encode(value: Any) -> Any:
    if value is None or type(value) in _PLAIN:
        return value
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
            hint = _hints(cls)[field.name]  # type: ignore[arg-type]  # (a class is Hashable)
            values[field.name] = _decode(hint, body[field.name])
        except (TypeError, ValueError) as error:
            raise WireError(f"{cls.__name__}.{field.name}: {error}") from None
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode(hint: Any, value: Any) -> Any:
    """``value`` as ``hint`` says, or ``TypeError``: nothing is coerced (no ``"3"`` for 3, no 7.9
    for 7, no 5 for ``"5"``, no ``true`` for 1); an integral number such as 5.0 is the integer 5,
    as JSON Schema counts it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _decode(inner, value)
    if hint is datetime:
        return datetime.fromisoformat(_expect(value, str, "an ISO 8601 string"))
    if dataclasses.is_dataclass(hint):
        return from_json(hint, value)  # type: ignore[arg-type]
    if origin is tuple:
        return tuple(_decode(args[0], item) for item in _expect(value, list, "an array"))
    if origin is list:
        item = args[0] if args else Any
        return [_decode(item, element) for element in _expect(value, list, "an array")]
    if origin is dict or hint is dict:
        mapping = _expect(value, Mapping, "an object")
        item = args[1] if args else Any
        return {_expect(key, str, "string keys"): _decode(item, v) for key, v in mapping.items()}
    if hint is float:
        return float(_expect(value, int | float, "a number"))
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON Schema's integer: 5.0 is 5 (the spec validated it as one)
    if hint in (int, str, bool):
        return _expect(value, hint, _NOUNS[hint])
    return value


_NOUNS = {int: "an integer", str: "a string", bool: "a boolean"}


def _expect(value: Any, kind: Any, noun: str) -> Any:
    """``value`` when it is of ``kind`` (a boolean is never a number), else ``TypeError``."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise TypeError(f"expected {noun}, got {value!r}")
    return value
