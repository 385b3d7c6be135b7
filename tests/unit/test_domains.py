"""Topology domains (``geometry.domains``): declared by ranks, outside every verdict and plan, and
the pure rules the pairs answer orders and excludes by."""

from __future__ import annotations

import pytest

from kvroute.geometry import GeometryError, RankRegistration
from kvroute.geometry.registration.domains import (
    PairingPolicy,
    instance_domains,
    preference_key,
    required_exclusion,
    shared_domains,
)
from tests.documents import rank_document


def reg(topology: object) -> RankRegistration:
    doc = rank_document()
    doc["topology"] = topology
    return RankRegistration.from_json(doc, deployment="d", instance="i", rank=0)


def test_domains_round_trip_and_stay_out_of_classes_and_plans() -> None:
    plain = RankRegistration.from_json(rank_document(), deployment="d", instance="i", rank=0)
    placed = reg({"zone": "us-east-1a", "rack": "r12", "nvlink_domain": "nvl72/3"})
    assert placed.topology == (
        ("nvlink_domain", "nvl72/3"),
        ("rack", "r12"),
        ("zone", "us-east-1a"),
    )
    assert placed.to_json()["topology"] == {
        "nvlink_domain": "nvl72/3",
        "rack": "r12",
        "zone": "us-east-1a",
    }
    assert "topology" not in plain.to_json()
    assert placed.class_digest == plain.class_digest  # no verdict reads it
    assert placed.geometry_digest == plain.geometry_digest  # no plan changes with it
    assert placed.canonical_digest != plain.canonical_digest  # but moving is a new generation


@pytest.mark.parametrize(
    ("topology", "field"),
    [
        ({}, "topology"),
        ([], "topology"),
        ({f"d{i}": "v" for i in range(9)}, "topology"),
        ({"Zone": "a"}, "topology"),
        ({"zone": ""}, "topology.zone"),
        ({"zone": "a b"}, "topology.zone"),
        ({"zone": 3}, "topology.zone"),
    ],
)
def test_malformed_topology_is_an_invalid_document(topology, field) -> None:
    with pytest.raises(GeometryError) as refused:
        reg(topology)
    assert (refused.value.code, refused.value.field) == ("invalid_document", field)


def test_an_instance_is_in_a_value_only_when_every_rank_declares_it() -> None:
    ranks = [(("rack", "r1"), ("zone", "a")), (("rack", "r2"), ("zone", "a")), (("zone", "a"),)]
    assert instance_domains(ranks[:2]) == {"rack": ["r1", "r2"], "zone": "a"}
    assert instance_domains(ranks) == {"rack": None, "zone": "a"}
    assert instance_domains([]) == {}
    assert shared_domains({"rack": ["r1", "r2"], "zone": "a"}, {"rack": "r1", "zone": "a"}) == [
        "zone"
    ]
    assert shared_domains({"rack": None}, {"rack": None}) == []


def test_required_domains_exclude_and_preferred_ones_rank_in_order() -> None:
    policy = PairingPolicy(require=("zone",), prefer=("nvlink_domain", "rack"))
    gen = {"zone": "a", "rack": "r1", "nvlink_domain": "n1"}
    assert required_exclusion(policy, ("gen0", gen), ("ctx0", {"zone": "a"})) is None
    refused = required_exclusion(policy, ("gen0", gen), ("ctx1", {"zone": "b"}))
    assert refused is not None
    assert (refused["code"], refused["field"], refused["local"], refused["peer"]) == (
        "topology_domain_required",
        "topology.zone",
        "a",
        "b",
    )
    assert "gen0 is in a, ctx1 in b" in refused["detail"]
    same_nvlink = preference_key(policy, gen, {"zone": "a", "nvlink_domain": "n1"})
    same_rack = preference_key(policy, gen, {"zone": "a", "rack": "r1"})
    both = preference_key(policy, gen, dict(gen))
    assert both < same_nvlink < same_rack < preference_key(policy, gen, {})


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"require": "zone"}, "pairing.require"),
        ({"prefer": ["Rack"]}, "pairing.prefer[0]"),
        ({"prefer": ["rack", "rack"]}, "pairing.prefer"),
        ({"require": ["zone"], "prefer": ["zone"]}, "pairing.prefer"),
        ({"require": [f"d{i}" for i in range(9)]}, "pairing.require"),
    ],
)
def test_bad_policies_are_refused_naming_the_member(document, field) -> None:
    with pytest.raises(GeometryError) as refused:
        PairingPolicy.from_json(document)
    assert (refused.value.code, refused.value.field) == ("invalid_document", field)


def test_policies_round_trip() -> None:
    policy = PairingPolicy.from_json({"require": ["zone"], "prefer": ["rack"]})
    assert PairingPolicy.from_json(policy.to_json()) == policy
    assert PairingPolicy.from_json(None).empty
    assert PairingPolicy.from_json({}).empty
