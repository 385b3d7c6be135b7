"""Views naming their KV cache group over HTTP: overlapping pages of two groups are admitted and
stored with the member, one group's are refused, and a bad value is a 422 naming the member."""

from __future__ import annotations

import copy
from typing import Any

from tests.api.conftest import WORKER, rank_path, register
from tests.api.documents import rank_document


def _grouped(first: Any, second: Any) -> dict[str, Any]:
    """Layers 0-1 and 2-3 in two views laid over the same bytes, as vLLM's hybrid allocator
    backs a layer of each KV cache group with one tensor."""
    document = rank_document()
    (whole,) = document["views"]
    one, two = copy.deepcopy(whole), copy.deepcopy(whole)
    one["layers"], two["layers"] = whole["layers"][:2], copy.deepcopy(whole["layers"][:2])
    for slot, layer in zip(two["layers"], (2, 3), strict=True):
        slot["layer"] = layer
    two["view_id"] = 1
    one["kv_group"], two["kv_group"] = first, second
    document["views"] = [one, two]
    return document


async def test_overlapping_views_of_two_groups_are_admitted_and_stored(client):
    status, body = await register(client, "ctx0", 0, _grouped(0, 1))
    assert status == 201, body
    rank = await (await client.get(rank_path("ctx0", 0), headers=WORKER)).json()
    assert [view["kv_group"] for view in rank["document"]["views"]] == [0, 1]
    # A rank differing only in a view's group is another document: a new generation.
    status, body = await register(client, "ctx0", 0, _grouped(0, 2))
    assert (status, body["generation"]) == (200, 2)


async def test_overlapping_views_of_one_group_are_refused(client):
    status, problem = await register(client, "ctx0", 0, _grouped(1, 1))
    assert (status, problem["code"], problem["field"]) == (422, "views_overlap", "views")
    assert "view 0 layer 0" in problem["detail"]
    assert "view 1 layer 2" in problem["detail"]


async def test_a_bad_kv_group_is_a_422_naming_it(client):
    for value in (-1, "one", 4096):
        status, problem = await register(client, "ctx0", 0, _grouped(0, value))
        assert status == 422, (value, problem)
        assert problem["field"] == "views[1].kv_group", problem
