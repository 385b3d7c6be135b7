"""Property test: the pairs answer (``control.pairing.pairs_answer``) against a brute-force reading
of its rules.

Hypothesis draws context and generation instances whose ranks declare zones, racks and NVLink
domains (or leave one out), matrix cells of every status, and a pairing policy. The model below
judges each pair from the ranks themselves: a pair is allowed when its cell is compatible and, for
every required domain, every rank of both instances declares one and the same value; allowed pairs
are ordered by which preferred domains they share in that sense (earlier domains first), then by
name, and numbered densely; any other pair is excluded with the first reason in the order
incomplete, incompatible, topology.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import wire
from kvroute.control.compatibility import InstanceRanks
from kvroute.control.pairing import pairs_answer
from kvroute.geometry import RankRegistration
from kvroute.geometry.registration.domains import PairingPolicy
from tests.documents import rank_document

DOMAINS = ("zone", "rack", "nvlink_domain")
VALUES = ("a", "b")


@st.composite
def instance(draw: st.DrawFn, name: str, role: str) -> InstanceRanks:
    ranks = []
    for rank in range(draw(st.integers(1, 3))):
        topology = draw(st.dictionaries(st.sampled_from(DOMAINS), st.sampled_from(VALUES)))
        doc = rank_document(role=role)
        if topology:
            doc["topology"] = topology
        ranks.append(RankRegistration.from_json(doc, deployment="d", instance=name, rank=rank))
    return InstanceRanks(name, role, len(ranks), tuple(ranks))


@st.composite
def fleets(draw: st.DrawFn):
    contexts = [draw(instance(f"ctx{i}", "context")) for i in range(draw(st.integers(1, 5)))]
    generations = [draw(instance(f"gen{i}", "generation")) for i in range(draw(st.integers(1, 3)))]
    cells = []
    for ctx, gen in itertools.product(contexts, generations):
        status = draw(st.sampled_from(["compatible", "compatible", "incompatible", "incomplete"]))
        cells.append(
            wire.CompatibilityPair(
                context=ctx.name,
                generation=gen.name,
                status=status,
                compatible={"compatible": True, "incompatible": False}.get(status),
                refusal={
                    "code": "head_dim_mismatch",
                    "field": "attention.head_dim",
                    "detail": "differs",
                    "local": 32,
                    "peer": 16,
                    "generation_rank": 0,
                    "context_rank": 0,
                }
                if status == "incompatible"
                else None,
                missing_ranks={ctx.name: [9]} if status == "incomplete" else None,
            )
        )
    chosen = draw(st.permutations(DOMAINS))
    cut = draw(st.integers(0, len(DOMAINS)))
    keep = draw(st.integers(cut, len(DOMAINS)))
    policy = PairingPolicy(require=tuple(chosen[:cut]), prefer=tuple(chosen[cut:keep]))
    matrix = wire.Compatibility("d", (), (), tuple(cells))
    return contexts, generations, matrix, policy


def within(a: InstanceRanks, b: InstanceRanks, domain: str) -> bool:
    """Every rank of both instances declares the domain, all with one value."""
    values = [dict(reg.topology).get(domain) for reg in (*a.live, *b.live)]
    return None not in values and len(set(values)) == 1


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(fleet=fleets())
def test_pairs_follow_the_policy_from_the_ranks_declarations(fleet) -> None:
    contexts, generations, matrix, policy = fleet
    answer = pairs_answer("d", [*contexts, *generations], matrix, policy)
    assert [item.instance for item in answer.generation] == [g.name for g in generations]
    for gen, got in zip(generations, answer.generation, strict=True):
        allowed, reasons = [], {}
        for ctx in contexts:
            cell = matrix.pair(ctx.name, gen.name)
            if cell.status == "incomplete":
                reasons[ctx.name] = "instance_incomplete"
            elif cell.status == "incompatible":
                reasons[ctx.name] = "head_dim_mismatch"
            elif not all(within(gen, ctx, domain) for domain in policy.require):
                reasons[ctx.name] = "topology_domain_required"
            else:
                rank = tuple(not within(gen, ctx, domain) for domain in policy.prefer)
                shared = tuple(d for d in sorted(DOMAINS) if within(gen, ctx, d))
                allowed.append((rank, ctx.name, shared))
        allowed.sort()
        classes = sorted({rank for rank, _, _ in allowed})
        expected = [(name, classes.index(rank) + 1, shared) for rank, name, shared in allowed]
        assert [(p.context, p.preference, p.shared_domains) for p in got.pairs] == expected
        assert {e.context: e.code for e in got.excluded} == reasons
        assert [e.context for e in got.excluded] == sorted(reasons)
