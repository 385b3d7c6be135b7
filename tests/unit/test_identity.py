"""Model identity fencing and KV quantization (``geometry.identity``).

Peers naming another model revision, tokenizer or KV format are refused before any geometry check,
with the field and both values; documents that name nothing keep their old bytes and digests; an
instance names one identity; declared scale layouts come with their scale views.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.geometry import GeometryError, RankRegistration, check_registration
from kvroute.geometry.checks.classes import peer_verdict
from kvroute.geometry.checks.compat import PEER_STAGES
from kvroute.geometry.checks.validate import check_self
from kvroute.geometry.registration.identity import MEMBERS, check_identity
from tests.documents import rank_document

MODEL = {
    "name": "meta-llama/Llama-3.1-8B",
    "revision": "945c8663",
    "weights_digest": "sha256:aa",
    "tokenizer_digest": "sha256:bb",
}
QUANT = {"kv_dtype": "nvfp4", "scale_layout": "per_block", "scale_block": 16, "scale_dtype": "e4m3"}
# Another value of each member of MEMBERS, in its order.
OTHER = {
    "model.name": "meta-llama/Llama-3.1-70B",
    "model.revision": "0e9e39f2",
    "model.weights_digest": "sha256:cc",
    "model.tokenizer_digest": "sha256:dd",
    "kv_quantization.kv_dtype": "mxfp8",
    "kv_quantization.scale_layout": "per_head",
    "kv_quantization.scale_block": 32,
    "kv_quantization.scale_dtype": "e8m0",
}


def with_scales(doc: dict[str, Any], kind: str = "hnd") -> dict[str, Any]:
    """``doc`` with a per-token-head scale view (1 byte) behind its K and V in every slot."""
    kv = doc["views"][0]
    heads, tokens = kv["num_kv_heads"], doc["tokens_per_block"]
    scale_bytes = 2 * heads * tokens
    slot = doc["pools"][0]["slot_bytes"]
    scale = {
        "view_id": 7,
        "pool_id": 0,
        "kind": kind,
        "roles": ["key_scale", "value_scale"],
        "owner": "target",
        "num_kv_heads": heads,
        "total_kv_heads": kv["total_kv_heads"],
        "buffers_per_layer": 2,
        "bytes_per_layer": scale_bytes,
        "dtype": "float8_e4m3fn",
        "layers": [
            {"layer": s["layer"], "offset": slot + i * scale_bytes}
            for i, s in enumerate(kv["layers"])
        ],
    }
    if kind == "replicated":
        scale.pop("num_kv_heads")
        scale.pop("total_kv_heads")
    grown = slot + len(kv["layers"]) * scale_bytes
    doc["pools"][0].update(slot_bytes=grown, slot_stride=grown)
    doc["views"].append(scale)
    return doc


def document(role: str = "context", tp_size: int = 1, tp_rank: int = 0, **members: Any):
    doc = with_scales(rank_document(role=role, tp_size=tp_size, tp_rank=tp_rank))
    doc.update(members)
    return doc


def reg(doc: dict[str, Any], instance: str = "i", rank: int = 0) -> RankRegistration:
    return RankRegistration.from_json(doc, deployment="d", instance=instance, rank=rank)


def set_member(doc: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    group, member = field.split(".")
    doc[group] = {**doc[group], member: value}
    if doc[group].get("scale_layout") != "per_block":
        doc[group].pop("scale_block", None)
    return doc


def test_a_document_naming_nothing_keeps_its_bytes_and_digests() -> None:
    """Digests of this document on main before identity existed: older servers accept it as is."""
    plain = reg(rank_document(role="generation", tp_size=2, num_draft_layers=1))
    assert not {"model", "kv_quantization", "topology"} & set(plain.to_json())
    assert plain.canonical_digest == (
        "67eb8f7f723ce2e477731c9abc40980442f16c28d9d8e9a3cd8412a0b457938b"
    )
    assert plain.class_digest == "1c30d656e7cb21fb04e1658b97c20690a5c21090b70d04a104026947c32b63cc"
    assert plain.geometry_digest == (
        "eb2d6a1a22242d73cb6e3829f36616ad57e4221d317e305c108cc63d1d453b8c"
    )


def test_identity_round_trips_and_enters_the_class() -> None:
    named = reg(document(model=MODEL, kv_quantization=QUANT))
    assert named.to_json()["model"] == MODEL
    assert named.to_json()["kv_quantization"] == QUANT
    assert reg(named.to_json()) == named
    check_self(named)
    revised = reg(set_member(document(model=MODEL, kv_quantization=QUANT), "model.revision", "x"))
    assert revised.class_digest != named.class_digest
    assert reg(document()).class_digest != named.class_digest
    partial = reg(document(model={"name": MODEL["name"]}))
    assert partial.to_json()["model"] == {"name": MODEL["name"]}


@pytest.mark.parametrize(("field", "code"), [(f"{g}.{m}", code) for g, m, code in MEMBERS])
def test_a_peer_of_another_identity_is_refused_with_the_field_and_both_values(field, code) -> None:
    ctx = reg(document(model=MODEL, kv_quantization=QUANT), "ctx0")
    gen_doc = set_member(
        document("generation", model=MODEL, kv_quantization=QUANT), field, OTHER[field]
    )
    gen = reg(gen_doc, "gen0")
    with pytest.raises(GeometryError) as refused:
        check_registration(gen, [], [ctx])
    error = refused.value
    member = field.split(".")[1]
    assert (error.code, error.field, error.stage) == (code, field, "peer")
    assert (error.local, error.peer) == (OTHER[field], {**MODEL, **QUANT}[member])
    assert (error.peer_instance, error.peer_rank) == ("ctx0", 0)
    assert f"local={OTHER[field]}" in error.detail
    assert peer_verdict(gen, ctx) == 0  # judged on faces, the first stage


def test_identity_is_refused_before_geometry() -> None:
    ctx = reg(document(model=MODEL), "ctx0")
    gen_doc = document("generation", model={**MODEL, "revision": "new"}, num_draft_layers=1)
    with pytest.raises(GeometryError) as refused:
        check_registration(reg(gen_doc, "gen0"), [], [ctx])
    assert refused.value.code == "model_revision_mismatch"
    assert PEER_STAGES[0] is check_identity


def test_model_members_are_compared_only_where_both_name_them() -> None:
    ctx = reg(document(model=MODEL, kv_quantization=QUANT), "ctx0")
    for members in (
        {},
        {"model": {"name": MODEL["name"]}},
        {"model": {"revision": MODEL["revision"], "tokenizer_digest": "sha256:bb"}},
        {"kv_quantization": QUANT},
    ):
        check_registration(reg(document("generation", **members), "gen0"), [], [ctx])


def test_quantizations_are_compared_whole_absent_members_included() -> None:
    ctx = reg(document(kv_quantization=QUANT), "ctx0")
    unscaled = document("generation", kv_quantization={"kv_dtype": "nvfp4"})
    with pytest.raises(GeometryError) as refused:
        check_registration(reg(unscaled, "gen0"), [], [ctx])
    error = refused.value
    assert (error.code, error.local, error.peer) == ("kv_scale_layout_mismatch", None, "per_block")


def test_ranks_of_one_instance_name_one_identity() -> None:
    first = reg(document(tp_size=2, model=MODEL), "ctx0", 0)
    for model, field, local in (
        ({**MODEL, "revision": "other"}, "model.revision", "other"),
        (None, "model.name", None),  # an undeclared identity is another identity here
    ):
        doc = document(tp_size=2, tp_rank=1, model=model)
        if model is None:
            doc.pop("model")
        with pytest.raises(GeometryError) as refused:
            check_registration(reg(doc, "ctx0", 1), [first], [])
        error = refused.value
        assert (error.code, error.field) == ("instance_layout_mismatch", field)
        assert (error.local, error.peer) == (local, MODEL[field.split(".")[1]])


@pytest.mark.parametrize(
    ("members", "field"),
    [
        ({"model": {}}, "model"),
        ({"model": {"name": "has space"}}, "model.name"),
        ({"model": {"revision": "x" * 257}}, "model.revision"),
        ({"kv_quantization": {"scale_layout": "per_head"}}, "kv_quantization.kv_dtype"),
        ({"kv_quantization": {"kv_dtype": "FP8"}}, "kv_quantization.kv_dtype"),
        (
            {"kv_quantization": {"kv_dtype": "nvfp4", "scale_layout": "per_block"}},
            "kv_quantization.scale_block",
        ),
        (
            {"kv_quantization": {"kv_dtype": "fp8", "scale_layout": "per_head", "scale_block": 8}},
            "kv_quantization.scale_block",
        ),
        (
            {"kv_quantization": {"kv_dtype": "fp8", "scale_layout": "rows"}},
            "kv_quantization.scale_layout",
        ),
    ],
)
def test_malformed_identity_is_an_invalid_document(members, field) -> None:
    with pytest.raises(GeometryError) as refused:
        reg(document(**members))
    assert (refused.value.code, refused.value.field) == ("invalid_document", field)


def test_declared_scales_need_their_scale_views_of_a_kind_that_splits_right() -> None:
    bare = rank_document(tp_size=2)
    bare["kv_quantization"] = {"kv_dtype": "fp8_e4m3", "scale_layout": "per_head"}
    with pytest.raises(GeometryError) as refused:
        check_self(reg(bare))
    error = refused.value
    assert (error.code, error.field, error.local) == (
        "kv_scale_views_missing",
        "kv_quantization.scale_layout",
        "per_head",
    )
    assert "target layer 0" in error.detail
    bare["kv_quantization"]["scale_layout"] = "per_tensor"  # constants outside the pool
    check_self(reg(bare))
    replicated = with_scales(rank_document(tp_size=2), kind="replicated")
    replicated["kv_quantization"] = {"kv_dtype": "fp8_e4m3", "scale_layout": "per_tensor"}
    check_self(reg(replicated))
    replicated["kv_quantization"]["scale_layout"] = "per_head"
    with pytest.raises(GeometryError) as refused:
        check_self(reg(replicated))
    error = refused.value
    assert (error.code, error.field) == ("kv_scale_view_kind_mismatch", "views[1].kind")
    assert (error.local, error.peer) == ("replicated", ["hnd", "nhd"])
