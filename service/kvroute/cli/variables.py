"""The ``KVROUTE_*`` variables as help text, generated from the ``Settings`` model.

Written from the model's fields (name, type, bounds, default, description) so that ``serve --help``
cannot drift from what the server actually reads.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvroute.settings import ENV_PREFIX, Settings

_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "|".join(str(choice) for choice in typing.get_args(annotation))
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        named = [_type_name(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        return " or ".join(named)
    if annotation is SecretStr:
        return "secret"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    found = []
    for constraint in field.metadata:
        for kind, attribute, symbol in _BOUNDS:
            if isinstance(constraint, kind):
                found.append(f"{symbol}{getattr(constraint, attribute)}")
    return f" {' '.join(found)}" if found else ""


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return f"default: {getattr(field.default_factory, '__name__', 'computed')}()"
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "default: unset"
    return f"default: {field.default}"


def variable_lines() -> list[tuple[str, str]]:
    """(variable, "type bounds, default[; description]") for every ``Settings`` field."""
    lines = []
    for name, field in Settings.model_fields.items():
        text = f"{_type_name(field.annotation)}{_bounds(field)}, {_default(field)}"
        if field.description:
            text += f"; {field.description}"
        lines.append((f"{ENV_PREFIX}{name.upper()}", text))
    return lines


def settings_epilog() -> str:
    rows = variable_lines()
    width = max(len(variable) for variable, _ in rows)
    body = "\n".join(f"  {variable:<{width}}  {text}" for variable, text in rows)
    return (
        "configuration: read from these environment variables once at startup "
        "(--host/--port override theirs):\n" + body
    )
