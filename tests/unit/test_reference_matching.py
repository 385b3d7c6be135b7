"""Reference cases 35-43: view matching between peers, plus kvroute's missing/ambiguous/misplaced rules."""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, check_registration
from kvroute.geometry.checks.compat import matched_pairs
from tests.unit.docs import rank, view

KV = ("key", "value")


def _pairs(local_views, peer_views, *, local=None, peer=None) -> dict[int, int]:
    a = rank("generation", views=local_views, **(local or {}))
    b = rank("context", views=peer_views, **(peer or {}))
    return {mine.view_id: theirs.view_id for _, mine, _, theirs in matched_pairs(a, b)}


def _refusal(local_views, peer_views, *, local=None, peer=None) -> GeometryError:
    a = rank("generation", views=local_views, **(local or {}))
    b = rank("context", views=peer_views, **(peer or {}))
    with pytest.raises(GeometryError) as refused:
        check_registration(a, [], [b])
    return refused.value


STAGE_10_13 = {"stages": (13,)}


def test_case_35_one_kv_view_each_side() -> None:
    views = [view(0, [10, 11])]
    assert _pairs(views, views, local=STAGE_10_13, peer=STAGE_10_13) == {0: 0}


def test_case_36_mla_key_only_views() -> None:
    views = [view(0, [0, 1], 256, roles=["key"], buffers=1, heads=1)]
    mla = {"mla": True, "heads": 1}
    assert _pairs(views, views, local=mla, peer=mla) == {0: 0}


def test_case_37_kv_and_block_scale_views() -> None:
    views = [
        view(0, [100, 101]),
        view(
            1, [100, 101], 64, offsets=[1024, 1088], roles=["key_block_scale", "value_block_scale"]
        ),
    ]
    stages = {"stages": (102,)}
    assert _pairs(views, views, local=stages, peer=stages) == {0: 0, 1: 1}


@pytest.mark.parametrize(
    ("kv_kind", "index_roles"),
    [("hnd", ["indexer_k"]), ("nhd", ["index_key"])],
    ids=["case_38", "case_39"],
)
def test_cases_38_39_kv_view_with_a_replicated_index_view(
    kv_kind: str, index_roles: list[str]
) -> None:
    views = [
        view(0, [0, 1], kind=kv_kind),
        view(1, [0, 1], 64, offsets=[1024, 1088], kind="replicated", roles=index_roles, buffers=1),
    ]
    assert _pairs(views, views) == {0: 0, 1: 1}


def test_case_40_replicated_against_nhd_for_one_role_is_refused() -> None:
    local = [view(0, [0, 1], 64, kind="replicated", roles=["index_key"], buffers=1)]
    peer = [view(0, [0, 1], 64, kind="nhd", roles=["index_key"])]
    error = _refusal(local, peer, local={"tpb": 4}, peer={"tpb": 4})
    assert (error.code, error.local, error.peer) == ("mapper_kind_mismatch", "replicated", "nhd")
    assert "incompatible mapper kinds" in error.detail


def test_case_41_partial_pp_overlap_matches() -> None:
    # Local stage holds layers 10..11, the peer's stage 11..12: they share layer 11.
    local = {"stages": (10, 2, 1), "pp_rank": 1}
    peer = {"stages": (11, 2), "pp_rank": 1}
    assert _pairs([view(0, [10, 11])], [view(0, [11, 12])], local=local, peer=peer) == {0: 0}


def test_case_42_same_role_views_split_by_layer_set_match_by_overlap() -> None:
    peer_views = [view(0, [12], 512), view(1, [10, 11], 512, offsets=[512, 1024])]
    local = {"stages": (10, 2, 1), "pp_rank": 1}
    assert _pairs([view(0, [10, 11])], peer_views, local=local, peer=STAGE_10_13) == {0: 1}


@pytest.mark.parametrize("flip", [False, True])
def test_case_43_replicated_against_hnd_is_refused_in_either_order(flip: bool) -> None:
    replicated = [view(0, [0, 1], 64, kind="replicated", roles=["indexer_k"], buffers=1)]
    hnd = [view(0, [0, 1], 64, roles=["indexer_k"])]
    error = _refusal(*((hnd, replicated) if flip else (replicated, hnd)))
    assert error.code == "mapper_kind_mismatch"


def test_missing_view_when_the_peer_holds_the_layers_under_other_roles() -> None:
    error = _refusal([view(0, [0, 1])], [view(0, [0, 1], roles=["key"], buffers=1, heads=2)])
    assert error.code == "view_missing"
    assert "no target view with roles ['key', 'value']" in error.detail


def test_ambiguous_when_one_view_overlaps_several_peer_views() -> None:
    peer_views = [view(0, [0], 512), view(1, [1], 512, offsets=[512])]
    error = _refusal([view(0, [0, 1])], peer_views)
    assert (error.code, error.peer) == ("view_ambiguous", [0, 1])
    assert "overlaps several peer views [0, 1]" in error.detail


def test_misplaced_when_the_peer_holds_some_layers_outside_the_matching_view() -> None:
    # The peer's stage holds layers 0..1 but its only KV view carries layer 0.
    error = _refusal([view(0, [0, 1])], [view(0, [0], 512)])
    assert (error.code, error.local, error.peer) == ("view_misplaced", [1], [0])


def test_draft_views_never_match_target_views_even_in_one_pool() -> None:
    views = [view(0, [0, 1]), view(1, [0], 256, offsets=[1024], owner="draft", heads=1)]
    assert _pairs(views, views, local={"draft": 1}, peer={"draft": 1}) == {0: 0, 1: 1}
