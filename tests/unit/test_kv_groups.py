"""Views naming their KV cache group (``kv_group``): where views of different groups may overlap,
what stays refused, and that the member reaches documents and every digest."""

from __future__ import annotations

import copy

import pytest

from kvroute.geometry import GeometryError, RankRegistration, check_registration
from kvroute.geometry.registration.rendering import render_registration
from tests.unit.docs import rank, view
from tests.unit.test_reference_state import ssm


def _refusal(candidate: RankRegistration) -> GeometryError:
    with pytest.raises(GeometryError) as refused:
        check_registration(candidate, [], [])
    return refused.value


def _aliased(first: int | None, second: int | None) -> RankRegistration:
    """Layers 0 and 1 in two views whose pages both start at byte 0 of the slot (vLLM's hybrid
    allocator: one tensor backs a layer of each group)."""
    members = [{} if g is None else {"kv_group": g} for g in (first, second)]
    return rank(
        "context",
        views=[
            view(0, [0], 512, heads=2, **members[0]),
            view(1, [1], 512, heads=2, **members[1]),
        ],
    )


def test_views_of_different_groups_may_overlap() -> None:
    reg = _aliased(0, 1)
    check_registration(reg, [], [])
    assert [v.kv_group for v in reg.views] == [0, 1]


@pytest.mark.parametrize(("first", "second"), [(0, 0), (None, None), (0, None), (None, 1)])
def test_views_of_one_group_or_without_one_may_not(first: int | None, second: int | None) -> None:
    error = _refusal(_aliased(first, second))
    assert (error.code, error.field) == ("views_overlap", "views")
    assert "view 0 layer 0 [0, 512) overlaps view 1 layer 1 starting at 0" in error.detail
    assert (error.local, error.peer) == ([0, 0], [1, 1])


def test_a_group_is_checked_with_the_ungrouped_views_beside_the_others() -> None:
    # Group 0 spans [0, 1024); group 1 sits inside it (allowed); an ungrouped view at 768
    # overlaps group 0 only, which a check of adjacent regions over all views would miss.
    views = [
        view(0, [0], 1024, heads=2, kv_group=0),
        view(1, [1], 256, heads=2, kv_group=1),
        view(2, [2], 256, heads=2, offsets=[768]),
    ]
    error = _refusal(rank("context", stages=(3,), views=views))
    assert error.code == "views_overlap"
    assert "view 0 layer 0" in error.detail
    assert "view 2 layer 2" in error.detail
    assert "KV cache group 0" in error.detail


def test_state_views_of_different_groups_may_overlap() -> None:
    # Qwen3-Next: each Gated DeltaNet layer is its own group, all backed by one tensor.
    states = [ssm(2, view_id=0) | {"kv_group": 1}, ssm(2, view_id=1) | {"kv_group": 2}]
    states[1]["layers"] = [{"layer": 1, "offset": 0}]
    check_registration(rank("context", views=states), [], [])
    states[1]["kv_group"] = 1
    assert _refusal(rank("context", views=states)).code == "views_overlap"


@pytest.mark.parametrize("value", [-1, 1024, "0", 1.0, True])
def test_a_bad_kv_group_is_refused_naming_the_member(value: object) -> None:
    reg = _aliased(0, 1)
    doc = render_registration(reg)
    doc["views"][1]["kv_group"] = value
    with pytest.raises(GeometryError) as refused:
        RankRegistration.from_json(doc, deployment="d", instance="ctx", rank=0)
    assert (refused.value.code, refused.value.field) == ("invalid_document", "views[1].kv_group")


def test_the_group_is_in_the_document_and_every_digest() -> None:
    reg = _aliased(0, 1)
    doc = render_registration(reg)
    assert [v.get("kv_group") for v in doc["views"]] == [0, 1]
    other_doc = copy.deepcopy(doc)
    other_doc["views"][1]["kv_group"] = 2
    other = RankRegistration.from_json(other_doc, deployment="d", instance="ctx", rank=0)
    for digest in ("canonical_digest", "geometry_digest", "class_digest"):
        assert getattr(reg, digest) != getattr(other, digest), digest
    again = RankRegistration.from_json(doc, deployment="d", instance="ctx", rank=0)
    assert again.canonical_digest == reg.canonical_digest


def test_without_groups_documents_and_digests_are_unchanged() -> None:
    plain = rank("context", views=[view(0, [0, 1], 512, heads=2)])
    assert "kv_group" not in render_registration(plain)["views"][0]
    assert plain.views[0].kv_group is None
