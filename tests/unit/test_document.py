"""The registration document: exact round trip, and malformed input refused with the field named."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from kvroute.geometry import GeometryError, RankRegistration
from tests.unit.docs import rank, view


def _api_example() -> dict:
    target_layers = [{"layer": i, "offset": i * 32768} for i in range(32)]
    return {
        "role": "context",
        "tp_size": 4,
        "tp_rank": 1,
        "pp_size": 1,
        "pp_rank": 0,
        "attention_dp": False,
        "dp_size": 1,
        "dp_rank": 0,
        "cp_size": 1,
        "layers_per_stage": [32],
        "num_draft_layers": 1,
        "tokens_per_block": 32,
        "attention": {"num_kv_heads": 2, "head_dim": 128, "dtype": "bfloat16", "is_mla": False},
        "pools": [
            {
                "pool_id": 0,
                "slot_bytes": 1064960,
                "slot_stride": 1064960,
                "num_slots": 4096,
                "memory": {"backend": "shm", "name": "kvroute-ctx0-r1-p0", "offset": 0},
            }
        ],
        "views": [
            {
                "view_id": 0,
                "pool_id": 0,
                "kind": "hnd",
                "roles": ["key", "value"],
                "owner": "target",
                "buffers_per_layer": 2,
                "bytes_per_layer": 32768,
                "layers": target_layers,
                "num_kv_heads": 2,
                "total_kv_heads": 8,
            },
            {
                "view_id": 1,
                "pool_id": 0,
                "kind": "hnd",
                "roles": ["key", "value"],
                "owner": "draft",
                "buffers_per_layer": 2,
                "bytes_per_layer": 16384,
                "layers": [{"layer": 0, "offset": 1048576}],
                "num_kv_heads": 1,
                "total_kv_heads": 1,
            },
        ],
        "lease_seconds": 30,
    }


def test_the_api_example_round_trips_exactly() -> None:
    doc = _api_example()
    reg = RankRegistration.from_json(doc, deployment="llama", instance="ctx0", rank=1)
    assert reg.to_json() == doc
    assert reg.canonical() == json.dumps(doc, sort_keys=True, separators=(",", ":"))
    assert reg.heads(reg.views[1]) == 1
    assert reg.heads(reg.views[0]) == 2


def test_cp_members_are_rendered_only_with_context_parallelism() -> None:
    # Servers from before context parallelism refuse members they do not know, so a rank
    # without CP must render exactly as it did then; a CP rank round-trips all of them.
    doc = _api_example()
    reg = RankRegistration.from_json(doc, deployment="llama", instance="ctx0", rank=1)
    assert not {"cp_rank", "cp_layout", "cp_interleave"} & reg.to_json().keys()
    doc.update(cp_size=2, cp_rank=1, cp_layout="interleaved", cp_interleave=32)
    reg = RankRegistration.from_json(doc, deployment="llama", instance="ctx0", rank=1)
    assert reg.to_json() == doc


def test_optional_members_take_their_documented_defaults() -> None:
    doc = _api_example()
    for key in (
        "attention_dp",
        "dp_size",
        "dp_rank",
        "cp_size",
        "cp_rank",
        "cp_layout",
        "cp_interleave",
        "num_draft_layers",
        "lease_seconds",
    ):
        doc.pop(key, None)
    doc["pools"][0].pop("slot_stride")
    del doc["views"][1]
    doc["views"][0].pop("num_kv_heads")
    reg = RankRegistration.from_json(doc, deployment="llama", instance="ctx0", rank=1)
    assert (reg.attention_dp, reg.dp_size, reg.num_draft_layers, reg.lease_seconds) == (
        False,
        1,
        0,
        30,
    )
    assert reg.pools[0].slot_stride == 1064960
    assert reg.views[0].is_legacy
    assert reg.heads(reg.views[0]) == 2


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("tp_size",), "4", "tp_size"),
        (("tp_size",), True, "tp_size"),
        (("tp_size",), 0, "tp_size"),
        (("role",), "prefill", "role"),
        (("attention", "dtype"), "bf17", "attention.dtype"),
        (("attention",), [], "attention"),
        (("pools", 0, "slot_bytes"), -1, "pools[0].slot_bytes"),
        (("views", 0, "kind"), "sectioned", "views[0].kind"),
        (("views", 0, "roles"), [], "views[0].roles"),
        (("views", 0, "roles", 0), "Key Value", "views[0].roles[0]"),
        (("views", 0, "layers", 3, "offset"), None, "views[0].layers[3].offset"),
        (("views", 1, "num_kv_heads"), 0, "views[1].num_kv_heads"),
        (("layers_per_stage", 0), -3, "layers_per_stage[0]"),
        (("views",), {"view_id": 0}, "views"),
    ],
)
def test_malformed_documents_name_the_field(path, value, field) -> None:
    doc = copy.deepcopy(_api_example())
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(GeometryError) as refused:
        RankRegistration.from_json(doc, deployment="llama", instance="ctx0", rank=1)
    assert (refused.value.code, refused.value.stage, refused.value.field) == (
        "invalid_document",
        "schema",
        field,
    )


def test_non_object_documents_and_bad_names_are_refused() -> None:
    for doc, names in (([], ("d", "i")), ({}, ("d", "i")), (_api_example(), ("bad name", "i"))):
        with pytest.raises(GeometryError) as refused:
            RankRegistration.from_json(doc, deployment=names[0], instance=names[1], rank=0)
        assert refused.value.code == "invalid_document"


def test_problem_members_carry_code_field_and_both_values() -> None:
    error = GeometryError(
        "head_dim_mismatch",
        "head_dim differs",
        field="attention.head_dim",
        local=128,
        peer=64,
        stage="peer",
        peer_instance="ctx0",
        peer_rank=3,
    )
    problem = error.to_problem()
    assert {
        k: problem[k] for k in ("code", "field", "local", "peer", "peer_instance", "peer_rank")
    } == {
        "code": "head_dim_mismatch",
        "field": "attention.head_dim",
        "local": 128,
        "peer": 64,
        "peer_instance": "ctx0",
        "peer_rank": 3,
    }
    assert problem["type"].endswith("/head-dim-mismatch")


def test_geometry_imports_no_io_library() -> None:
    code = (
        "import sys, kvroute.geometry, kvroute.geometry.registration.builder;"
        "bad = [m for m in ('aiohttp', 'sqlalchemy', 'torch', 'numpy', 'asyncio', 'socket', 'kvroute.store',"
        " 'kvroute.api', 'kvroute.transfer') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_rank_factory_documents_are_valid() -> None:
    assert rank(views=[view()]).to_json()["views"][0]["bytes_per_layer"] == 512
