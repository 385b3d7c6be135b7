"""Interiors whose token groups are cut in pieces (``group_planes``, vLLM's amx tiles): the member
reaches documents and digests only where it is not 1, and a tiling that cannot hold it is refused
naming it. That such views move, digest and read back exactly is drawn in
test_plan_ground_truth_interior.py and test_kv_digest.py against tests/truth.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvroute.geometry import GeometryError, RankRegistration, check_registration
from kvroute.geometry.registration.rendering import render_registration
from tests.unit.docs import rank, view

# 2 heads x 16 tokens x 8-byte rows per buffer: K in one 16-token group of 4 pieces, V in pairs.
AMX = {"order": "head_buffer", "tilings": [
    {"planes": 1, "token_group": 16, "group_planes": 4},
    {"planes": 2, "token_group": 2, "group_planes": 2},
]}  # fmt: skip


def tiled(interior: dict[str, Any], role: str = "context", tp_rank: int = 0) -> RankRegistration:
    views = [view(0, [0, 1], 512, heads=2, interior=interior)]
    return rank(role, tp_rank=tp_rank, views=views)


def test_pieces_reach_the_document_and_every_digest() -> None:
    reg = tiled(AMX)
    check_registration(reg, [], [])
    doc = render_registration(reg)
    assert doc["views"][0]["interior"] == AMX
    whole = copy.deepcopy(AMX)
    whole["tilings"][0]["group_planes"] = 2
    other = tiled(whole)
    for digest in ("canonical_digest", "geometry_digest", "class_digest"):
        assert getattr(reg, digest) != getattr(other, digest), digest


def test_one_piece_is_the_tiling_written_before_pieces_existed() -> None:
    """Documents and class digests of interiors registered before the member are unchanged."""
    before = {"order": "head_buffer", "tilings": [{"planes": 4, "token_group": 1},
                                                   {"planes": 1, "token_group": 2}]}  # fmt: skip
    explicit = copy.deepcopy(before)
    for tiling in explicit["tilings"]:
        tiling["group_planes"] = 1
    old, new = tiled(before), tiled(explicit)
    assert render_registration(new)["views"][0]["interior"] == before
    for digest in ("canonical_digest", "geometry_digest", "class_digest"):
        assert getattr(old, digest) == getattr(new, digest), digest


@pytest.mark.parametrize(
    ("tiling", "why"),
    [
        ({"planes": 1, "token_group": 1, "group_planes": 2}, "needs token_group > 1"),
        ({"planes": 2, "token_group": 2, "group_planes": 8}, "4-byte chunk"),
    ],
)
def test_pieces_a_tiling_cannot_hold_are_refused(tiling: dict[str, int], why: str) -> None:
    interior = {"order": "head_buffer", "tilings": [tiling, {"planes": 1, "token_group": 1}]}
    with pytest.raises(GeometryError) as refused:
        check_registration(tiled(interior), [], [])
    error = refused.value
    assert error.code == "interior_group_planes_not_divisible"
    assert error.field == "views[0].interior.tilings[0].group_planes"
    assert why in error.detail


@pytest.mark.parametrize("value", [0, "2", 1.5, True])
def test_a_malformed_group_planes_is_refused_naming_the_member(value: object) -> None:
    doc = render_registration(tiled(AMX))
    doc["views"][0]["interior"]["tilings"][1]["group_planes"] = value
    with pytest.raises(GeometryError) as refused:
        RankRegistration.from_json(doc, deployment="d", instance="ctx", rank=0)
    assert refused.value.code == "invalid_document"
    assert refused.value.field == "views[0].interior.tilings[1].group_planes"


def test_peers_with_other_pieces_do_not_pair() -> None:
    other = copy.deepcopy(AMX)
    other["tilings"][0]["group_planes"] = 8
    context = [tiled(AMX, tp_rank=r) for r in (0, 1)]
    with pytest.raises(GeometryError) as refused:
        check_registration(tiled(other, "generation"), [], context)
    assert refused.value.code == "interior_mismatch"
