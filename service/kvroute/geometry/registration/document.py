"""Parse and render the registration document (docs/geometry.md).

The HTTP layer validates documents against the OpenAPI schema first; this parser still checks every
type and range itself, because the geometry library is also used directly (CLI, workers, tests) and a
malformed document must become a named ``invalid_document`` refusal, never a KeyError or TypeError.
It reads the registration's parts only: ``RankRegistration.from_json`` (above) passes its class in.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from kvroute.geometry.leaves.errors import GeometryError
from kvroute.geometry.leaves.limits import (
    ARRAY_BOUNDS,
    INTEGER_BOUNDS,
    MAX_LAYER_SLOTS,
    STRING_BOUNDS,
)
from kvroute.geometry.leaves.parts import (
    DTYPE_BITS,
    Attention,
    CpLayout,
    HeadOrder,
    Interior,
    Kind,
    LayerSlot,
    Owner,
    Pool,
    Role,
    Tiling,
    View,
)
from kvroute.geometry.registration.domains import parse_topology
from kvroute.geometry.registration.identity import parse_identity

if TYPE_CHECKING:
    from kvroute.geometry.registration.model import RankRegistration

# Matched whole (``fullmatch``): a trailing newline is part of the value, never an alias of it.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)
ROLE_NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,62}", re.ASCII)

E = TypeVar("E")
R = TypeVar("R", bound="RankRegistration")


def _invalid(field: str, detail: str, value: Any = None) -> GeometryError:
    return GeometryError(
        "invalid_document", f"{field}: {detail}", field=field, local=value, stage="schema"
    )


class _Reader:
    """Reads one JSON object of spec schema ``schema``, naming every error's field by its path;
    bounds are ``limits``' ``"<schema>.<key>"`` (for ``builtins.`` see ``reading.Members``)."""

    def __init__(self, obj: Any, path: str, schema: str) -> None:
        # A parsed document's objects are dicts: their exact type is tested before the ABC's
        # (much slower) check, which other mappings still pass.
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise _invalid(path or "document", "must be an object", _short(obj))
        self.obj = obj
        self.path = path
        self.schema = schema

    def _field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def int(self, key: str, *, default: int | None = None) -> int:
        low, high = INTEGER_BOUNDS[f"{self.schema}.{key}"]
        value = self.obj.get(key)
        if value is None:
            if default is None:
                raise _invalid(self._field(key), "is required")
            return default
        if type(value) is int and low <= value <= high:
            return value  # the common case, without naming the field
        return _bounded_int(self._field(key), value, low, high)

    def opt_int(self, key: str) -> builtins.int | None:
        return self.int(key) if self.has(key) else None

    def bool(self, key: str, *, default: bool | None = None) -> bool:
        value = self.obj.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, bool):
            raise _invalid(
                self._field(key), f"must be a boolean, got {_short(value)}", _short(value)
            )
        return value

    def str(
        self, key: str, *, pattern: re.Pattern[str] | None = None, max_len: builtins.int = 4096
    ) -> str:
        value = self.obj.get(key)
        if not isinstance(value, str):
            raise _invalid(
                self._field(key), f"must be a string, got {_short(value)}", _short(value)
            )
        low, high = STRING_BOUNDS.get(f"{self.schema}.{key}", (0, max_len))
        if not low <= len(value) <= high or (pattern is not None and not pattern.fullmatch(value)):
            raise _invalid(
                self._field(key), f"is not a valid value: {_short(value)}", _short(value)
            )
        return value

    def opt_str(self, key: builtins.str, **kwargs: Any) -> builtins.str | None:
        return self.str(key, **kwargs) if self.has(key) else None

    def enum(self, key: builtins.str, enum: type[E], *, default: E | None = None) -> E:
        if default is not None and key not in self.obj:
            return default
        value = self.obj.get(key)
        try:
            return enum(value)  # type: ignore[call-arg]
        except ValueError:
            allowed = ", ".join(m.value for m in enum)  # type: ignore[attr-defined]
            raise _invalid(
                self._field(key), f"must be one of {allowed}; got {_short(value)}", _short(value)
            ) from None

    def dtype(self, key: builtins.str) -> builtins.str:
        value = self.str(key, max_len=32)
        if value not in DTYPE_BITS:
            raise _invalid(
                self._field(key), f"unknown dtype {value!r}; known: {', '.join(DTYPE_BITS)}", value
            )
        return value

    def list(self, key: builtins.str, *, min_items: builtins.int | None = None) -> list[Any]:
        low, high = ARRAY_BOUNDS[f"{self.schema}.{key}"]
        low = low if min_items is None else min_items
        value = self.obj.get(key)
        if not isinstance(value, list):
            raise _invalid(
                self._field(key), f"must be an array, got {_short(value)}", _short(value)
            )
        if not low <= len(value) <= high:
            raise _invalid(
                self._field(key), f"must have {low}..{high} items, got {len(value)}", len(value)
            )
        return value

    def child(self, key: builtins.str, schema: builtins.str) -> _Reader:
        return _Reader(self.obj.get(key), self._field(key), schema)

    def item(self, key: builtins.str, index: builtins.int, schema: builtins.str) -> _Reader:
        return _Reader(self.obj[key][index], f"{self._field(key)}[{index}]", schema)


def _bounded_int(field: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(field, f"must be an integer, got {_short(value)}", _short(value))
    if not low <= value <= high:
        raise _invalid(field, f"must be in [{low}, {high}], got {value}", value)
    return value


def _short(value: Any) -> Any:
    if isinstance(value, list | dict) and len(value) > 8:
        return f"<{type(value).__name__} of {len(value)} items>"  # never repr a huge container
    text = repr(value)
    plain = len(text) <= 80 and isinstance(value, int | float | str | bool | None)
    return value if plain else text[:80]


def _parse_pool(r: _Reader) -> Pool:
    slot_bytes = r.int("slot_bytes")
    memory = r.obj.get("memory")
    if memory is not None and not isinstance(memory, Mapping):
        raise _invalid(r._field("memory"), "must be an object", _short(memory))
    return Pool(
        pool_id=r.int("pool_id"),
        slot_bytes=slot_bytes,
        slot_stride=r.int("slot_stride", default=slot_bytes),
        num_slots=r.int("num_slots"),
        memory=dict(memory) if memory is not None else None,
    )


_SLOT_BOUNDS = (INTEGER_BOUNDS["View.layers[].layer"], INTEGER_BOUNDS["View.layers[].offset"])
# ``LayerSlot(layer, offset)`` without the named tuple's ``__new__`` in Python (the same tuple):
# a rank's views hold a slot per layer.
_new_slot = tuple.__new__


def _parse_view(r: _Reader) -> View:
    roles = r.list("roles")
    for index, role in enumerate(roles):
        if not isinstance(role, str) or not ROLE_NAME_PATTERN.fullmatch(role):
            raise _invalid(
                f"{r._field('roles')}[{index}]", f"is not a role name: {_short(role)}", _short(role)
            )
    layers: list[LayerSlot] = []
    (layer_low, layer_high), (offset_low, offset_high) = _SLOT_BOUNDS
    for index, slot in enumerate(r.list("layers")):
        # A slot per layer of the view: read in place when well formed, through a reader (which
        # names the field that is not) otherwise.
        if type(slot) is dict or isinstance(slot, Mapping):
            layer, offset = slot.get("layer"), slot.get("offset")
            if (
                type(layer) is int
                and type(offset) is int
                and layer_low <= layer <= layer_high
                and offset_low <= offset <= offset_high
            ):
                layers.append(_new_slot(LayerSlot, (layer, offset)))
                continue
        reader = r.item("layers", index, "View.layers[]")
        layers.append(LayerSlot(reader.int("layer"), reader.int("offset")))
    kind = r.enum("kind", Kind)
    _check_kind_members(r, kind)
    return View(
        view_id=r.int("view_id"),
        pool_id=r.int("pool_id"),
        kind=kind,
        roles=frozenset(roles),
        owner=r.enum("owner", Owner),
        layers=tuple(layers),
        buffers_per_layer=r.int("buffers_per_layer"),
        bytes_per_layer=r.int("bytes_per_layer"),
        num_kv_heads=r.opt_int("num_kv_heads"),
        total_kv_heads=r.opt_int("total_kv_heads"),
        tokens_per_block=r.opt_int("tokens_per_block"),
        dtype=r.dtype("dtype") if r.has("dtype") else None,
        per_request=r.bool("per_request", default=False),
        ssm_bytes_per_head=r.opt_int("ssm_bytes_per_head"),
        conv_sections=_conv_sections(r) if r.has("conv_sections") else None,
        sliding_window=r.opt_int("sliding_window"),
        interior=_interior(r.child("interior", "Interior")) if r.has("interior") else None,
        kv_group=r.opt_int("kv_group"),
    )


def _interior(r: _Reader) -> Interior | None:
    """A view's ``interior``; the classic layout written out reads as None (one spelling)."""
    tilings = []
    for index in range(len(r.list("tilings"))):
        tiling = r.item("tilings", index, "Tiling")
        tilings.append(
            Tiling(
                tiling.int("planes", default=1),
                tiling.int("token_group", default=1),
                tiling.int("group_planes", default=1),
            )
        )
    interior = Interior(r.enum("order", HeadOrder), tuple(tilings))
    return None if interior.trivial else interior


# Members that only mean something for some kinds: (member, kinds that require it, kinds allowing it).
_KIND_MEMBERS: tuple[tuple[str, frozenset[Kind], frozenset[Kind]], ...] = (
    ("ssm_bytes_per_head", frozenset({Kind.SSM}), frozenset({Kind.SSM})),
    ("conv_sections", frozenset({Kind.CONV}), frozenset({Kind.CONV})),
    ("num_kv_heads", frozenset(), frozenset({Kind.HND, Kind.NHD, Kind.REPLICATED})),
    ("total_kv_heads", frozenset(), frozenset({Kind.HND, Kind.NHD, Kind.REPLICATED})),
    ("tokens_per_block", frozenset(), frozenset({Kind.HND, Kind.NHD, Kind.REPLICATED})),
    ("sliding_window", frozenset(), frozenset({Kind.HND, Kind.NHD, Kind.REPLICATED})),
    ("interior", frozenset(), frozenset({Kind.HND})),
)


def _check_kind_members(r: _Reader, kind: Kind) -> None:
    """Refuses members the view's kind does not have, so a document never means two things."""
    for member, required, allowed in _KIND_MEMBERS:
        if kind in required and not r.has(member):
            raise _invalid(r._field(member), f"is required for a {kind} view")
        if kind not in allowed and r.has(member):
            raise _invalid(
                r._field(member), f"does not apply to a {kind} view", _short(r.obj[member])
            )
    per_request = r.bool("per_request", default=False)
    if kind in (Kind.HND, Kind.NHD) and per_request:
        raise _invalid(
            r._field("per_request"),
            f"a {kind} view is sliced by KV heads per token block; per-request state is "
            "ssm, conv or replicated",
            True,
        )
    if kind.recurrent and r.obj.get("per_request") is False:
        raise _invalid(r._field("per_request"), f"a {kind} view is per-request state", False)
    if per_request:
        for member in ("num_kv_heads", "total_kv_heads", "tokens_per_block", "sliding_window"):
            if r.has(member):
                raise _invalid(
                    r._field(member), "does not apply to per-request state", _short(r.obj[member])
                )


def _conv_sections(r: _Reader) -> tuple[int, ...]:
    sections = r.list("conv_sections")
    low, high = INTEGER_BOUNDS["View.conv_sections[]"]
    field = r._field("conv_sections")
    return tuple(
        _bounded_int(f"{field}[{index}]", size, low, high) for index, size in enumerate(sections)
    )


def _parse_attention(r: _Reader) -> Attention:
    return Attention(
        num_kv_heads=r.int("num_kv_heads"),
        head_dim=r.int("head_dim"),
        dtype=r.dtype("dtype"),
        is_mla=r.bool("is_mla", default=False),
    )


def _parse_views(r: _Reader) -> tuple[View, ...]:
    """The views, after a cheap count of their layer slots (a hostile document stops here)."""
    views = r.list("views", min_items=0)
    slots = sum(
        len(v["layers"])
        for v in views
        if (type(v) is dict or isinstance(v, Mapping)) and isinstance(v.get("layers"), list)
    )
    if slots > MAX_LAYER_SLOTS:
        raise _invalid(
            "views",
            f"hold {slots} layer slots in all; a rank lists at most {MAX_LAYER_SLOTS}",
            slots,
        )
    return tuple(_parse_view(r.item("views", i, "View")) for i in range(len(views)))


def parse_registration(
    cls: type[R], doc: Mapping[str, Any], *, deployment: str, instance: str, rank: int
) -> R:
    """Builds a ``cls`` from a registration document (docs/geometry.md); raises ``invalid_document`` on bad input."""
    for field, name in (("deployment", deployment), ("instance", instance)):
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise _invalid(field, f"is not a valid name: {_short(name)}", _short(name))
    r = _Reader(doc, "", "RegistrationDocument")
    stages = r.list("layers_per_stage")
    low, high = INTEGER_BOUNDS["RegistrationDocument.layers_per_stage[]"]
    for index, count in enumerate(stages):
        _bounded_int(f"layers_per_stage[{index}]", count, low, high)
    return cls(
        deployment=deployment,
        instance=instance,
        rank=rank,
        role=r.enum("role", Role),
        tp_size=r.int("tp_size"),
        tp_rank=r.int("tp_rank"),
        pp_size=r.int("pp_size"),
        pp_rank=r.int("pp_rank"),
        attention_dp=r.bool("attention_dp", default=False),
        dp_size=r.int("dp_size", default=1),
        dp_rank=r.int("dp_rank", default=0),
        cp_size=r.int("cp_size", default=1),
        cp_rank=r.int("cp_rank", default=0),
        cp_layout=r.enum("cp_layout", CpLayout, default=CpLayout.INTERLEAVED),
        cp_interleave=r.int("cp_interleave", default=1),
        layers_per_stage=tuple(stages),
        num_draft_layers=r.int("num_draft_layers", default=0),
        tokens_per_block=r.int("tokens_per_block"),
        attention=_parse_attention(r.child("attention", "Attention")),
        pools=tuple(_parse_pool(r.item("pools", i, "Pool")) for i in range(len(r.list("pools")))),
        views=_parse_views(r),
        lease_seconds=r.int("lease_seconds", default=30),
        endpoint=r.opt_str("endpoint"),
        nixl_agent_metadata=r.opt_str("nixl_agent_metadata"),
        **parse_identity(r),
        **parse_topology(r),
    )
