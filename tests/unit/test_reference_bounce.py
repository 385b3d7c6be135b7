"""Reference cases 44-47: the fan-in bounce gate, asserting kvroute's rule (docs/geometry.md rule 6).

The gate's inputs in kvroute's model: the number of PP stages among the ranks a receiver hears from,
(mapper, dup, peer_dup) per view pair, and each writer's bytes per block. kvroute follows the newest
reference generation (G3) and keeps G2's replicated clause; where it differs from G2 the test says why.
"""

from __future__ import annotations

import pytest

from kvroute.geometry import build_plan
from kvroute.geometry.plans.bounce import fanin_bounce_safe
from tests.unit.docs import instance, rank, stage_layers, view


@pytest.mark.parametrize(
    ("dup", "pp", "peer_dup", "safe"),
    [
        (1, 1, 1, True),
        (1, 0, 1, False),
        (2, 1, 1, False),
        (1, 1, 2, False),
        (1, 4, 1, False),
        (2, 4, 1, False),
    ],
)
def test_case_44_g3_gate(dup: int, pp: int, peer_dup: int, safe: bool) -> None:
    writers = [4096, 4096] if pp else []
    assert (
        fanin_bounce_safe(pp_stages=pp, view_pairs=[("hnd", dup, peer_dup)], writer_bytes=writers)
        is safe
    )


def test_case_45_pp_fan_in_with_a_uniform_peer_split_is_unsafe() -> None:
    # Receiver stage [0, 3) against sender stages [0, 2) and [2, 4): the writers carry 2 and 1 layers.
    ctx = instance(
        "context", tp=1, stages=(2, 2), views=lambda t, p: [view(0, stage_layers((2, 2), p))]
    )
    gen = rank("generation", tp=1, stages=(3, 1), views=[view(0, [0, 1, 2])])
    plan = build_plan(ctx, gen)
    assert [p.bytes_per_block for p in plan.peers] == [1024, 512]
    assert plan.fanin_bounce_safe is False


@pytest.mark.parametrize(
    ("dup", "pp", "writer_bytes", "safe", "why"),
    [
        (1, 1, [24], True, "one stage, one writer"),
        (1, 0, [], False, "G2 says safe with no overlap; with no writer there is nothing to stage"),
        (2, 1, [24], False, "head duplication"),
        (
            1,
            4,
            [20, 20, 20, 20],
            False,
            "G2 admits a uniform PP split; rule 6 refuses every PP fan-in",
        ),
        (1, 4, [20, 20, 20, 19], False, "unequal writers"),
        (1, 4, [20], False, "PP fan-in"),
        (2, 4, [20, 20, 20, 20], False, "duplication and PP fan-in"),
    ],
)
def test_case_46_g2_inputs_under_kvroute_rule(dup, pp, writer_bytes, safe, why) -> None:
    assert (
        fanin_bounce_safe(pp_stages=pp, view_pairs=[("hnd", dup, 1)], writer_bytes=writer_bytes)
        is safe
    ), why


@pytest.mark.parametrize(
    ("pairs", "writers", "safe"),
    [
        ([("hnd", 1, 1), ("replicated", 1, 1)], [100, 100], False),
        ([("hnd", 1, 1), ("replicated", 1, 1)], [100], True),
        ([("replicated", 1, 1)], [100, 100], False),
        ([("nhd", 1, 1)], [100, 100], True),
    ],
)
def test_case_47_replicated_views_with_several_writers(pairs, writers, safe) -> None:
    # The reference's third case (peer NHD, receiver replicated) is refused outright by kvroute as a
    # mapper-kind mismatch (case 40), so only the gate's own clause is asserted here.
    assert fanin_bounce_safe(pp_stages=1, view_pairs=pairs, writer_bytes=writers) is safe


def test_equal_fan_in_from_two_tp_ranks_is_safe_in_a_real_plan() -> None:
    ctx = instance(
        "context", tp=4, heads=1, views=lambda t, p: [view(0, [0, 1], 256, heads=1, total=4)]
    )
    gen = rank("generation", tp=2, views=[view(0, [0, 1], 512, heads=2, total=4)])
    plan = build_plan(ctx, gen)
    assert (plan.expected_writers, plan.fanin_bounce_safe) == (2, True)
