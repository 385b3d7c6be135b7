"""Every self, instance and peer check refuses with its own code, naming the field and both values."""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, build_plan, check_registration
from kvroute.geometry.checks.instance import InstanceMemo, check_instance
from tests.unit.docs import instance, rank, view


def _code(candidate, instance_ranks=(), peers=()) -> GeometryError:
    with pytest.raises(GeometryError) as refused:
        check_registration(candidate, list(instance_ranks), list(peers))
    return refused.value


@pytest.mark.parametrize(
    ("kwargs", "code", "field"),
    [
        ({"views": [view()], "slot": 1000}, "view_outside_slot", "views[0].layers"),
        ({"views": [view(0, [2])]}, "layer_outside_stage", "views[0].layers"),
        (
            {"views": [view(), view(1, [1], 256, owner="draft", offsets=[1024])], "draft": 1},
            "draft_layer_out_of_range",
            "views[1].layers",
        ),
        ({"views": [view(heads=2, total=3)]}, "tp_heads_not_divisible", "views[0].total_kv_heads"),
        ({"views": [view(heads=2, total=8)]}, "head_count_inconsistent", "views[0].total_kv_heads"),
        (
            {"views": [view(heads=3)]},
            "bytes_per_layer_not_divisible",
            "views[0].bytes_per_layer",
        ),
        (
            {"views": [view(0, [0, 1], 510)]},
            "bytes_per_layer_not_divisible",
            "views[0].bytes_per_layer",
        ),
        (
            {
                "views": [
                    view(),
                    view(
                        1,
                        [0, 1],
                        64,
                        offsets=[1000, 1064],
                        roles=["x"],
                        kind="replicated",
                        buffers=1,
                    ),
                ]
            },
            "views_overlap",
            "views",
        ),
        ({"mla": True, "heads": 2}, "mla_heads", "attention.num_kv_heads"),
        ({"tp_rank": 2}, "rank_out_of_range", "tp_rank"),
        (
            {"role": "generation", "cp": 2, "cp_layout": "zigzag"},
            "context_parallel_layout_unsupported",
            "cp_layout",
        ),
        (
            {"role": "generation", "cp": 2, "cp_layout": "contiguous"},
            "context_parallel_layout_unsupported",
            "cp_layout",
        ),
        ({"cp": 2, "interleave": 3}, "cp_interleave_invalid", "cp_interleave"),
        ({"cp": 2, "cp_rank": 2}, "rank_out_of_range", "cp_rank"),
        ({"stages": (2, 0)}, "layers_per_stage_length", "layers_per_stage"),
        ({"stages": (0,), "views": []}, "no_layers", "layers_per_stage"),
    ],
)
def test_self_checks(kwargs, code, field) -> None:
    if kwargs.get("stages") == (2, 0):
        reg = rank(**{**kwargs, "stages": (2,)})
        reg = type(reg).from_json(
            {**reg.to_json(), "layers_per_stage": [2, 0]}, deployment="d", instance="ctx", rank=0
        )
    else:
        reg = rank(**kwargs)
    error = _code(reg)
    assert (error.code, error.field, error.stage) == (code, field, "self")


def test_a_view_must_name_a_registered_pool() -> None:
    doc = rank().to_json()
    doc["views"][0]["pool_id"] = 3
    error = _code(type(rank()).from_json(doc, deployment="d", instance="ctx", rank=0))
    assert (error.code, error.field, error.local) == ("unknown_pool", "views[0].pool_id", 3)


def test_attention_dp_group_must_match_tp_rank() -> None:
    reg = rank(tp=4, tp_rank=3, dp=2)
    bad = type(reg).from_json(
        {**reg.to_json(), "dp_rank": 0}, deployment="d", instance="ctx", rank=3
    )
    error = _code(bad)
    assert (error.code, error.local, error.peer) == ("dp_layout_invalid", 0, 1)


def test_instance_checks_name_the_disagreeing_rank() -> None:
    first = rank(tp=2, tp_rank=0)
    error = _code(rank(tp=2, tp_rank=1, tpb=32, views=[view(0, [0, 1], 1024)]), [first])
    assert (error.code, error.field, error.local, error.peer) == (
        "instance_layout_mismatch",
        "tokens_per_block",
        32,
        16,
    )
    assert (error.stage, error.peer_instance, error.peer_rank) == ("instance", "ctx", 0)
    error = _code(rank(tp=2, tp_rank=1, views=[view(0, [0, 1], 512, kind="nhd")]), [first])
    assert (error.code, error.field) == ("instance_view_mismatch", "views[0].kind")


def test_instance_checks_remember_agreeing_faces_not_refusals() -> None:
    """Ranks that agree share an instance digest (their names and rank numbers are not part of it); the
    caller's memo keeps the pairs of digests that agreed, which are not compared again, and no
    refusal, so one that did not agree is refused every time."""
    first, second, third = (rank(tp=4, tp_rank=index) for index in range(3))
    assert first.instance_digest == second.instance_digest == third.instance_digest
    agreed: InstanceMemo = {}
    check_instance(second, [first], agreed)
    assert agreed == {(first.instance_digest, first.instance_digest): True}
    check_instance(third, [first, second], agreed)  # the memoized pair answers as before
    odd = rank(tp=4, tp_rank=3, tpb=32, views=[view(0, [0, 1], 1024)])
    assert odd.instance_digest != first.instance_digest
    for _ in range(2):
        with pytest.raises(GeometryError) as refused:
            check_instance(odd, [first, second, third], agreed)
        error = refused.value
        assert (error.code, error.field, error.peer_rank) == (
            "instance_layout_mismatch",
            "tokens_per_block",
            0,
        )
    assert len(agreed) == 1
    # The memo is what decides: a pair it holds is not compared (the caller's memo is trusted).
    check_instance(odd, [first], {(odd.instance_digest, first.instance_digest): True})
    error = _code(rank(tp=4, tp_rank=3, views=[view(0, [0, 1], 512, kind="nhd")]), [third])
    assert (error.code, error.field, error.peer_rank) == (
        "instance_view_mismatch",
        "views[0].kind",
        2,
    )


def test_rank_number_must_follow_pp_and_tp_rank() -> None:
    reg = rank(tp=2, tp_rank=1)
    renumbered = type(reg).from_json(reg.to_json(), deployment="d", instance="ctx", rank=0)
    error = _code(renumbered)
    assert (error.code, error.local, error.peer) == ("rank_mismatch", 0, 1)


@pytest.mark.parametrize(
    ("gen_kwargs", "code", "field"),
    [
        (
            {
                "draft": 1,
                "views": [view(), view(1, [0], 256, owner="draft", heads=1, offsets=[1024])],
            },
            "draft_layers_mismatch",
            "num_draft_layers",
        ),
        (
            {"stages": (3,), "views": [view(0, [0, 1, 2])]},
            "layer_count_mismatch",
            "layers_per_stage",
        ),
        ({"dtype": "float32"}, "element_size_mismatch", "attention.dtype"),
        ({"dtype": "float16"}, "dtype_mismatch", "attention.dtype"),
        ({"head_dim": 16}, "head_dim_mismatch", "attention.head_dim"),
    ],
)
def test_peer_rank_fields_in_order(gen_kwargs, code, field) -> None:
    error = _code(rank("generation", **gen_kwargs), peers=instance("context", tp=2))
    assert (error.code, error.field, error.stage, error.peer_instance) == (
        code,
        field,
        "peer",
        "ctx",
    )


def test_peers_of_the_same_role_are_not_checked() -> None:
    check_registration(
        rank("generation", instance="gen0"), [], [rank("generation", head_dim=64, instance="gen1")]
    )


def test_non_integer_tp_ratio_context_tp3_to_generation_tp2_with_6_heads() -> None:
    ctx = instance(
        "context", tp=3, heads=2, views=lambda t, p: [view(0, [0, 1], 512, heads=2, total=6)]
    )
    gen = instance(
        "generation", tp=2, heads=3, views=lambda t, p: [view(0, [0, 1], 768, heads=3, total=6)]
    )
    bph = 128
    first = build_plan(ctx, gen[0]).to_json()
    second = build_plan(ctx, gen[1]).to_json()
    assert [p["rank"] for p in first["peers"]] == [0, 1]
    assert [p["rank"] for p in second["peers"]] == [1, 2]
    # gen 0 holds heads 0..2: ctx 0 gives heads 0-1, ctx 1 gives head 2 (its first head).
    assert first["peers"][1]["views"][0]["fragments"][0] == [0, 2 * bph, bph]
    # gen 1 holds heads 3..5: ctx 1 gives head 3 (its second head), ctx 2 gives heads 4-5.
    assert second["peers"][0]["views"][0]["fragments"][0] == [bph, 0, bph]
    assert second["peers"][1]["views"][0]["fragments"][0] == [0, bph, 2 * bph]
    assert [p["bytes_per_block"] for p in first["peers"]] == [1024, 512]
    assert first["fanin_bounce_safe"] is False


def test_a_plan_runs_the_same_checks_as_registration() -> None:
    ctx = instance("context", tp=2)
    with pytest.raises(GeometryError) as refused:
        build_plan(ctx, rank("generation", head_dim=64))
    assert refused.value.code == "head_dim_mismatch"
    with pytest.raises(GeometryError) as refused:
        build_plan([rank("generation")], rank("generation"))
    assert refused.value.code == "plan_roles_invalid"


def test_fingerprint_depends_on_geometry_only() -> None:
    ctx = instance("context", tp=2)
    gen = rank("generation")
    renewed = type(gen).from_json(
        {**gen.to_json(), "lease_seconds": 99}, deployment="d", instance="gen", rank=0
    )
    assert build_plan(ctx, gen).fingerprint == build_plan(ctx, renewed).fingerprint
    assert (
        build_plan(ctx, gen).fingerprint
        != build_plan(ctx, rank("generation", tp=2, tp_rank=1)).fingerprint
    )
