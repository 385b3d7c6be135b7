"""Strict readers for plan documents (docs/api.md "Plans"): the wrong type, a missing member or a
value out of range is refused as ``invalid_plan``, naming the member by its path.

A plan document comes back from a server, a file or another library, so reading it must fail by
name, never with a KeyError or by coercing ``"3"`` into 3.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.plans.mappers import Fragment


def invalid(path: str, detail: str, value: Any = None) -> GeometryError:
    return GeometryError(
        "invalid_plan", f"{path}: {detail}", field=path, local=value, stage="plan_document"
    )


def is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


class Members:
    """One JSON object of a plan document at ``path`` (``plan``, ``plan.peers[0]``, ...)."""

    # Annotations below a method named int, str, bool or list say ``builtins.``: a type checker
    # reads them in the class's scope, where that name is now the method.

    def __init__(self, doc: Any, path: str) -> None:
        if not isinstance(doc, Mapping):
            raise invalid(path, "must be an object", type(doc).__name__)
        self.doc = doc
        self.path = path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        return key in self.doc

    def value(self, key: str) -> Any:
        if key not in self.doc:
            raise invalid(self.at(key), "is required")
        return self.doc[key]

    def int(self, key: str, minimum: int = 0) -> int:
        value = self.value(key)
        if not is_int(value, minimum):
            raise invalid(self.at(key), f"must be an integer >= {minimum}, got {value!r}", value)
        return value

    def opt_int(self, key: str) -> builtins.int | None:
        return None if self.doc.get(key) is None else self.int(key)

    def bool(self, key: str) -> bool:
        value = self.value(key)
        if not isinstance(value, bool):
            raise invalid(self.at(key), f"must be a boolean, got {value!r}", value)
        return value

    def str(self, key: str, choices: tuple[str, ...] = ()) -> str:
        value = self.value(key)
        if not isinstance(value, str) or (choices and value not in choices):
            wanted = f"one of {', '.join(choices)}" if choices else "a string"
            raise invalid(self.at(key), f"must be {wanted}, got {value!r}", value)
        return value

    def list(self, key: builtins.str, *, optional: builtins.bool = False) -> list[Any]:
        value = self.doc.get(key, []) if optional else self.value(key)
        if not isinstance(value, list):
            raise invalid(self.at(key), "must be a list", type(value).__name__)
        return value

    def ints(
        self, key: builtins.str, length: builtins.int | None = None
    ) -> tuple[builtins.int, ...]:
        value = self.list(key)
        if any(not is_int(item) for item in value) or length not in (None, len(value)):
            count = f"{length} " if length is not None else ""
            raise invalid(self.at(key), f"must be a list of {count}integers >= 0", value)
        return tuple(value)

    def strs(self, key: builtins.str) -> tuple[builtins.str, ...]:
        value = self.list(key)
        if any(not isinstance(item, str) for item in value):
            raise invalid(self.at(key), "must be a list of strings", value)
        return tuple(value)

    def child(self, key: builtins.str) -> Members:
        return Members(self.value(key), self.at(key))

    def items(
        self, key: builtins.str, *, optional: builtins.bool = False
    ) -> builtins.list[Members]:
        return [
            Members(item, f"{self.at(key)}[{index}]")
            for index, item in enumerate(self.list(key, optional=optional))
        ]

    def fragments(self, key: builtins.str) -> tuple[Fragment, ...]:
        """``[src_offset, dst_offset, length]`` triples: integers >= 0, lengths > 0."""
        fragments = []
        for index, item in enumerate(self.list(key)):
            if (
                not isinstance(item, list)
                or len(item) != 3
                or not all(is_int(x) for x in item)
                or item[2] == 0
            ):
                raise invalid(
                    f"{self.at(key)}[{index}]",
                    "must be [src_offset, dst_offset, length] with integers >= 0, length > 0",
                    item,
                )
            fragments.append((item[0], item[1], item[2]))
        return tuple(fragments)

    def derived(self, key: builtins.str, computed: Any) -> None:
        """A member the plan's other members determine must say what they do."""
        if key in self.doc and self.doc[key] != computed:
            raise invalid(
                self.at(key), f"is {self.doc[key]!r} but the plan's fragments give {computed!r}"
            )
