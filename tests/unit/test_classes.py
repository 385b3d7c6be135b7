"""Admission by geometry class gives exactly the answer of checking every peer rank.

``check_peers_by_class`` sees one representative per class and memoized verdicts; ``check_peers``
sees every rank. Over Hypothesis deployments with two context instances (one compatible, one
mutated to be refused, in either name order), every rank of either side must get the same outcome
from both: admitted by both, or refused with the same code, field, values, detail and the same
first failing peer instance and rank.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.geometry import GeometryError, RankRegistration, check_peers
from kvroute.geometry.checks.classes import check_peers_by_class, representatives
from kvroute.geometry.registration.faces import class_digest
from tests.unit.test_plan_ground_truth import MUTATIONS, _mutate, worlds
from tests.world import instance

EXAMPLES = max(50, int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000")) // 8)


def _outcome(check: object) -> tuple[object, ...] | None:
    try:
        check()  # type: ignore[operator]
    except GeometryError as error:
        return (
            error.code,
            error.field,
            error.local,
            error.peer,
            error.detail,
            error.peer_instance,
            error.peer_rank,
        )
    return None


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), mutation=st.sampled_from([None, *MUTATIONS]), swap=st.booleans())
def test_class_verdicts_give_the_answer_of_every_peer(world, mutation, swap) -> None:
    cls, ctx_side, gen_side = world
    other_cls = list(cls)
    mutated = _mutate(mutation, cls, other_cls, gen_side, ctx_side) if mutation else None
    other_side = mutated[0] if mutated else ctx_side
    names = ("ctx1", "ctx0") if swap else ("ctx0", "ctx1")
    contexts = instance(ctx_side, cls, names[0])[0] + instance(other_side, other_cls, names[1])[0]
    generations, _ = instance(gen_side, cls, "gen0")
    memo: dict[tuple[str, str], int | None] = {}
    for receiver in generations:
        direct = _outcome(lambda r=receiver: check_peers(r, contexts))
        by_class = _outcome(
            lambda r=receiver: check_peers_by_class(r, representatives(contexts), memo)
        )
        assert by_class == direct
    for sender in contexts:
        direct = _outcome(lambda s=sender: check_peers(s, generations))
        by_class = _outcome(
            lambda s=sender: check_peers_by_class(s, representatives(generations), memo)
        )
        assert by_class == direct


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_position_memory_and_names_are_outside_the_class_and_the_stage_is_inside(world) -> None:
    cls, ctx_side, _ = world
    ranks, _ = instance(ctx_side, cls, "ctx0")
    for reg in ranks:
        pools = tuple(replace(pool, memory={"backend": "shm", "name": "x"}) for pool in reg.pools)
        moved = replace(
            reg,
            instance="elsewhere",
            rank=reg.rank + 100,
            tp_rank=(reg.tp_rank + 1) % reg.tp_size,
            dp_rank=0,
            pools=pools,
            endpoint="10.0.0.1:7000",
            nixl_agent_metadata="agent",
            lease_seconds=reg.lease_seconds + 1,
        )
        assert class_digest(moved) == reg.class_digest
        if reg.pp_size > 1:
            other_stage = replace(reg, pp_rank=(reg.pp_rank + 1) % reg.pp_size)
            assert class_digest(other_stage) != reg.class_digest


def test_a_refusal_names_the_first_failing_peer_across_classes() -> None:
    from tests.world import Side, ViewClass

    kv = [ViewClass(("key", "value"), "target", "hnd", 8, 2, 1)]
    good = Side("context", tp_size=2, layers_per_stage=(4,), tokens_per_block=2)
    bad = replace(good, head_dim=good.head_dim * 2)
    receiver = instance(replace(good, role="generation", tp_size=1), kv, "gen0")[0][0]
    contexts: list[RankRegistration] = (
        instance(good, kv, "ctx-a")[0]
        + instance(bad, kv, "ctx-b")[0]
        + instance(bad, kv, "ctx-c")[0]
    )
    memo: dict[tuple[str, str], int | None] = {}
    refused = _outcome(lambda: check_peers_by_class(receiver, representatives(contexts), memo))
    assert refused is not None
    assert refused[0] == "head_dim_mismatch"
    assert refused[5:] == ("ctx-b", 0)
    assert refused == _outcome(lambda: check_peers(receiver, contexts))
