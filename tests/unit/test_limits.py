"""The document limits of ``geometry/leaves/limits.py`` are the ones ``api_spec/openapi.yaml`` states.

The parser reads every bound from ``limits``; this test reads every bound of the registration
schemas from the spec, so the code and the contract cannot drift apart again (they did: the parser
took ``view_id`` 4096 and ``pool_id``/``tp_rank`` 1024 where the spec allows 4095 and 1023).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.leaves.limits import (
    ARRAY_BOUNDS,
    INTEGER_BOUNDS,
    MAX_LAYER_SLOTS,
    MAX_POOL_ID,
    MAX_VIEW_ID,
    STRING_BOUNDS,
)
from tests.documents import rank_document

SPEC = yaml.safe_load((Path(__file__).parents[2] / "api_spec" / "openapi.yaml").read_text())
SCHEMAS = SPEC["components"]["schemas"]
GEOMETRY_SCHEMAS = ("RegistrationDocument", "Attention", "Pool", "View")


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = {
            **SCHEMAS[node["$ref"].rsplit("/", 1)[1]],
            **{k: v for k, v in node.items() if k != "$ref"},
        }
    if "allOf" in node:
        merged = {k: v for k, v in node.items() if k != "allOf"}
        for part in node["allOf"]:
            merged = {**_resolve(part), **merged}
        return merged
    return node


def _property(key: str) -> dict[str, Any]:
    """``"View.layers[].layer"`` -> that property's resolved schema."""
    schema_name, _, rest = key.partition(".")
    node = SCHEMAS[schema_name]
    for part in rest.split("."):
        items = part.endswith("[]")
        node = _resolve(node["properties"][part.removesuffix("[]")])
        if items:
            node = _resolve(node["items"])
    return node


@pytest.mark.parametrize("key", sorted(INTEGER_BOUNDS))
def test_integer_bounds_are_the_spec_s(key: str) -> None:
    schema = _property(key)
    assert schema["type"] == "integer"
    assert (schema["minimum"], schema["maximum"]) == INTEGER_BOUNDS[key]


@pytest.mark.parametrize("key", sorted(ARRAY_BOUNDS))
def test_array_bounds_are_the_spec_s(key: str) -> None:
    schema = _property(key)
    assert (schema["minItems"], schema["maxItems"]) == ARRAY_BOUNDS[key]


@pytest.mark.parametrize("key", sorted(STRING_BOUNDS))
def test_string_bounds_are_the_spec_s(key: str) -> None:
    schema = _property(key)
    assert (schema.get("minLength", 0), schema["maxLength"]) == STRING_BOUNDS[key]


def test_every_bounded_number_of_the_geometry_schemas_has_a_limit() -> None:
    """A new integer or array member of the document needs its entry (and the parser its check)."""
    missing = []
    for name in GEOMETRY_SCHEMAS:
        for member, raw in SCHEMAS[name]["properties"].items():
            schema = _resolve(raw)
            key = f"{name}.{member}"
            if schema.get("type") == "integer" and key not in INTEGER_BOUNDS:
                missing.append(key)
            if schema.get("type") == "array":
                if key not in ARRAY_BOUNDS:
                    missing.append(key)
                if "$ref" in schema["items"]:
                    continue  # a schema of its own, checked under its name
                items = schema["items"]
                if items.get("type") == "integer" and f"{key}[]" not in INTEGER_BOUNDS:
                    missing.append(f"{key}[]")
                for inner, raw_inner in items.get("properties", {}).items():
                    inner_key = f"{key}[].{inner}"
                    if (
                        _resolve(raw_inner).get("type") == "integer"
                        and inner_key not in INTEGER_BOUNDS
                    ):
                        missing.append(inner_key)
    assert missing == []


def _parse(document: dict[str, Any]) -> RankRegistration:
    return RankRegistration.from_json(document, deployment="d", instance="i", rank=0)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda doc: doc["views"][0].update(view_id=MAX_VIEW_ID + 1), "views[0].view_id"),
        (lambda doc: doc["views"][0].update(pool_id=MAX_POOL_ID + 1), "views[0].pool_id"),
        (lambda doc: doc["pools"][0].update(pool_id=MAX_POOL_ID + 1), "pools[0].pool_id"),
        (lambda doc: doc.update(tp_size=1024, tp_rank=1024), "tp_rank"),
        (lambda doc: doc.update(pp_size=1024, pp_rank=1024), "pp_rank"),
    ],
)
def test_the_parser_refuses_one_past_the_spec_maximum(mutate: Any, field: str) -> None:
    document = rank_document()
    mutate(document)
    with pytest.raises(GeometryError) as refused:
        _parse(document)
    assert (refused.value.code, refused.value.field) == ("invalid_document", field)


def test_layer_slots_over_all_views_are_bounded_before_views_are_read() -> None:
    document = rank_document()
    view = document["views"][0]
    layers = [{"layer": i % 1024, "offset": 0} for i in range(1024)]
    document["views"] = [dict(view, view_id=i, layers=layers) for i in range(5)]
    with pytest.raises(GeometryError) as refused:
        _parse(document)
    assert refused.value.field == "views"
    assert f"at most {MAX_LAYER_SLOTS}" in refused.value.detail


def test_names_with_a_trailing_newline_are_not_names() -> None:
    with pytest.raises(GeometryError) as refused:
        RankRegistration.from_json(rank_document(), deployment="llama\n", instance="i", rank=0)
    assert refused.value.field == "deployment"
    document = rank_document()
    document["views"][0]["roles"] = ["key\n", "value"]
    with pytest.raises(GeometryError) as role:
        _parse(document)
    assert role.value.field == "views[0].roles[0]"
