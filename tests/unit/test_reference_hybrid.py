"""Reference section 5 on hybrid models in kvroute's model: one global layer id in a block group and a
state group, sliding-window groups skipping stale blocks, and windows that differ between peers;
plus the registration members that describe them (optional, refused where they mean nothing).
"""

from __future__ import annotations

import copy

import pytest

from kvroute.geometry import GeometryError, RankRegistration, build_plan, check_registration
from kvroute.geometry.tokens.window import window_start
from tests.unit.docs import instance, rank, view
from tests.unit.test_reference_state import ssm


def _refusal(candidate, peers) -> GeometryError:
    with pytest.raises(GeometryError) as refused:
        check_registration(candidate, [], peers)
    return refused.value


def test_one_layer_id_in_a_block_view_and_a_state_view_matches_within_each_axis() -> None:
    # Layer 0 has attention KV (pool 0) and SSM state (pool 1) under the same id.
    views = lambda t, p: [view(0, [0, 1], 512, heads=2), ssm(2, view_id=1)]  # noqa: E731
    ctx, gen = instance("context", tp=2, views=views), instance("generation", tp=2, views=views)
    check_registration(gen[0], gen[1:], ctx)
    (peer,) = build_plan(ctx, gen[0]).peers
    assert [(v.src_view, v.dst_view) for v in peer.views] == [(0, 0)]
    assert [(s.src_view, s.dst_view, s.mapper) for s in peer.states] == [(1, 1, "ssm")]


def test_a_state_view_never_matches_a_block_view_with_the_same_roles() -> None:
    as_blocks = view(0, [0, 1], 256, kind="replicated", roles=["ssm"], buffers=1, pool=1)
    error = _refusal(
        rank("generation", views=[ssm(2)]),
        instance("context", tp=2, views=lambda t, p: [as_blocks]),
    )
    assert (error.code, error.field) == ("view_missing", "views[0]")
    assert "no target state view with roles ['ssm']" in error.detail


@pytest.mark.parametrize(
    ("window", "tokens", "prompt", "first"),
    [
        (4096, 32, 10000, 184),  # floor((10000 + 1 - 4096) / 32)
        (8, 4, 10, 0),
        (8, 4, 13, 1),
        (8, 4, 6, 0),
        (1, 4, 10, 3),  # attends to itself only: no prompt block at all
        (2, 4, 10, 2),  # token 9 only, in block 2
    ],
)
def test_sliding_window_skips_stale_blocks(window, tokens, prompt, first) -> None:
    start = window_start(window, prompt, tokens, tokens)
    if first * tokens >= prompt:  # no prompt block at all
        assert start is None
    else:
        assert start == first * tokens


@pytest.mark.parametrize(
    ("window", "sizes", "prompt", "start"),
    [
        (8, (4, 16), 13, 4),  # token 6: sender block [4, 8), receiver block [0, 16)
        (8, (16, 4), 13, 4),  # either direction: the later block start
        (8, (6, 4), 30, 20),  # token 23: blocks [18, 24) and [20, 24)
        (40, (4, 16), 13, 0),  # the whole prompt
        (1, (4, 16), 13, None),  # attends to itself only
    ],
)
def test_a_window_between_block_sizes_starts_at_the_later_block_start(
    window, sizes, prompt, start
) -> None:
    """Each side keeps the block holding prompt_tokens + 1 - window: the later start is in both."""
    assert window_start(window, prompt, *sizes) == start


def _windowed(window: int | None, view_id: int = 0):
    members = {} if window is None else {"sliding_window": window}
    return view(view_id, [0, 1], 512, heads=2, **members)


@pytest.mark.parametrize(
    ("ctx_window", "gen_window", "moved"),
    [(4096, 4096, 4096), (4096, 8192, 4096), (8192, 4096, 4096), (None, 4096, 4096)],
)
def test_a_pair_moves_the_smaller_window(ctx_window, gen_window, moved) -> None:
    # A receiver with the larger window has its extra leading blocks trimmed (left unwritten).
    ctx = instance("context", tp=2, views=lambda t, p: [_windowed(ctx_window)])
    gen = rank("generation", views=[_windowed(gen_window)])
    check_registration(gen, [], ctx)
    window = build_plan(ctx, gen).to_json()["peers"][0]["views"][0]["window"]
    assert window == {
        "tokens": moved,
        "sender": ctx_window,
        "receiver": gen_window,
        "src_tokens_per_block": 16,
        "dst_tokens_per_block": 16,
    }


def test_a_full_attention_receiver_of_a_windowed_sender_is_refused_either_way() -> None:
    ctx = instance("context", tp=2, views=lambda t, p: [_windowed(4096)])
    error = _refusal(rank("generation", views=[_windowed(None)]), ctx)
    assert (error.code, error.field, error.local, error.peer) == (
        "sliding_window_mismatch", "views[0].sliding_window", None, 4096,
    )  # fmt: skip
    assert "stale blocks never arrive" in error.detail
    gen = instance("generation", tp=2, views=lambda t, p: [_windowed(None)])
    error = _refusal(rank("context", views=[_windowed(4096)]), gen)
    assert (error.code, error.local, error.peer) == ("sliding_window_mismatch", 4096, None)


def test_unwindowed_plans_carry_no_window() -> None:
    ctx = instance("context", tp=2, views=lambda t, p: [_windowed(None)])
    plan = build_plan(ctx, rank("generation", views=[_windowed(None)])).to_json()
    assert "window" not in plan["peers"][0]["views"][0]
    assert "state_bytes" not in plan
    assert "states" not in plan["peers"][0]


def _hybrid_doc() -> dict:
    reg = rank("context", views=[_windowed(4096), ssm(2, view_id=1)])
    return reg.to_json()


def test_hybrid_members_round_trip_and_documents_without_them_are_unchanged() -> None:
    doc = _hybrid_doc()
    assert doc["views"][0]["sliding_window"] == 4096
    assert doc["views"][1]["ssm_bytes_per_head"] == 64
    again = RankRegistration.from_json(doc, deployment="d", instance="ctx", rank=0).to_json()
    assert again == doc
    plain = rank("context").to_json()
    assert not {"sliding_window", "ssm_bytes_per_head", "conv_sections", "per_request"} & set(
        plain["views"][0]
    )


@pytest.mark.parametrize(
    ("view_index", "member", "value", "field"),
    [
        (1, "ssm_bytes_per_head", None, "views[1].ssm_bytes_per_head"),  # required for ssm
        (0, "ssm_bytes_per_head", 64, "views[0].ssm_bytes_per_head"),  # only for ssm
        (0, "conv_sections", [8], "views[0].conv_sections"),
        (1, "sliding_window", 16, "views[1].sliding_window"),  # state has no window
        (1, "num_kv_heads", 2, "views[1].num_kv_heads"),
        (1, "per_request", False, "views[1].per_request"),
        (0, "per_request", True, "views[0].per_request"),  # hnd is never per-request
        (0, "sliding_window", 0, "views[0].sliding_window"),
    ],
)
def test_members_that_mean_nothing_for_a_kind_are_refused(view_index, member, value, field) -> None:
    doc = copy.deepcopy(_hybrid_doc())
    if value is None:
        del doc["views"][view_index][member]
    else:
        doc["views"][view_index][member] = value
    with pytest.raises(GeometryError) as refused:
        RankRegistration.from_json(doc, deployment="d", instance="ctx", rank=0)
    assert (refused.value.code, refused.value.field) == ("invalid_document", field)


def test_state_self_checks() -> None:
    error = _refusal(rank("context", views=[ssm(2) | {"bytes_per_layer": 250}]), [])
    assert (error.code, error.local, error.peer) == ("bytes_per_layer_not_divisible", 250, 64)
    conv = view(0, [0], 40, kind="conv", roles=["conv"], buffers=1, conv_sections=[32, 4, 2])
    error = _refusal(rank("context", views=[conv]), [])
    assert (error.code, error.local, error.peer) == ("conv_sections_sum_mismatch", 38, 40)
    error = _refusal(rank("context", views=[ssm(2) | {"buffers_per_layer": 2}]), [])
    assert (error.code, error.field) == ("state_buffers_invalid", "views[0].buffers_per_layer")


def test_a_state_region_may_share_slots_with_block_regions_of_its_pool() -> None:
    # Block and state regions both start at 0 of pool 0: a slot is a block or a request's state.
    shared = rank("context", views=[view(0, [0, 1], 512, heads=2), ssm(2, view_id=1, pool=0)])
    check_registration(shared, [], [])
    assert [v.axis.value for v in shared.views] == ["block", "state"]
    overlapping = rank("context", views=[ssm(2), ssm(2, view_id=1) | {"roles": ["other"]}])
    assert _refusal(overlapping, []).code == "views_overlap"
