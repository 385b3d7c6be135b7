"""One description of the wire shapes: every ``kvroute.wire`` model the server renders (and the
transfer request the client renders) is valid against its schema in ``api_spec/openapi.yaml`` and
parses back to itself.

Hypothesis draws each model from its fields (names, timestamps, enums and counts within the
spec's ranges), renders it as the server does (``wire.to_json``), validates the JSON against the
component schema of the same name, and parses it with the client's reader (``wire.from_json``).
A member renamed, dropped or retyped on either side, or in the spec, fails here.
"""

from __future__ import annotations

import dataclasses
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute import client, wire

SPEC = yaml.safe_load(
    (Path(__file__).resolve().parents[2] / "api_spec" / "openapi.yaml").read_text()
)
MODELS = [
    wire.Registered,
    wire.LeaseRenewed,
    wire.LeasedRank,
    wire.EngineLease,
    wire.Event,
    wire.Rank,
    wire.RankSummary,
    wire.InstanceSummary,
    wire.Instance,
    wire.DeploymentSummary,
    wire.Deployment,
    wire.Rejection,
    wire.TokenRange,
    wire.TransferJob,
    wire.CompatibilityInstance,
    wire.CompatibilityPair,
    wire.Compatibility,
    wire.Pairing,
    wire.PairChoice,
    wire.PairExclusion,
    wire.GenerationPairs,
    wire.Pairs,
    wire.KvPath,
    wire.KvPaths,
]
REQUESTS = [wire.TransferRequest]  # bodies the client renders and the server parses

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True)
counts = st.integers(0, 10_000)
ranks = st.integers(0, 65_535)
stamps = st.datetimes(
    min_value=datetime(2020, 1, 1), max_value=datetime(2040, 1, 1), timezones=st.just(UTC)
)
refusals = st.fixed_dictionaries(
    {
        "code": st.sampled_from(["head_dim_mismatch", "view_missing"]),
        "field": st.just("attention.head_dim"),
        "detail": st.text(max_size=20),
        "local": st.integers(),
        "peer": st.integers(),
        "generation_rank": ranks,
        "context_rank": st.none() | ranks,
    }
)
# Members whose values the spec constrains beyond their Python type.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "deployment": names,
    "instance": names,
    "name": names,
    "sender": names,
    "receiver": names,
    "context": names,
    "generation": st.integers(1, 10_000),
    "rank": ranks,
    "role": st.sampled_from(["context", "generation"]),
    "stage": st.sampled_from(["schema", "self", "instance", "peer"]),
    "document": st.just({"role": "context", "tp_size": 2}),
    "problem": st.just({"code": "head_dim_mismatch", "status": 409}),
    "receiver_ranks": st.lists(ranks, max_size=4).map(tuple),
    "live_ranks": counts,
    "blocks": st.integers(1, 1000),
    "expected_ranks": st.integers(1, 64),
    "lease_seconds": st.integers(1, 3600),
    "lease_id": st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
    "revision": st.integers(1, 2**40),
    "kind": st.sampled_from(
        ["rank_registered", "rank_expired", "rank_deleted", "plans_invalidated", "kv_path_failed"]
    ),
    "data": st.none() | st.just({"reason": "deleted"}),
    "missing_ranks": st.lists(ranks, max_size=4).map(tuple),
    "plan_fingerprints": st.lists(st.just("sha256:ab"), min_size=1, max_size=2).map(tuple),
    "duration_seconds": st.none() | st.floats(0, 1e4),
    "end": st.integers(1, 10_000),
    "tokens": st.none() | st.builds(wire.TokenRange, counts, st.integers(1, 10_000)),
    "prompt_tokens": st.none() | st.integers(1, 10_000),
    "require": st.lists(st.sampled_from(["zone", "rack"]), max_size=2, unique=True).map(tuple),
    "prefer": st.lists(st.sampled_from(["nvlink_domain"]), max_size=1).map(tuple),
    "preference": st.integers(1, 100),
    "shared_domains": st.lists(st.sampled_from(["zone", "rack"]), max_size=2).map(tuple),
    "domains": st.dictionaries(
        st.sampled_from(["zone", "rack"]),
        st.none() | st.sampled_from(["a", "b"]) | st.lists(st.sampled_from(["a", "b"])),
    ),
    "src_blocks": st.lists(counts, min_size=1, max_size=4).map(tuple),
    "dst_blocks": st.lists(counts, min_size=1, max_size=4, unique=True).map(tuple),
    "sender_dp_rank": st.integers(0, 1023),
}
STATES = {
    wire.Rank: st.sampled_from(["live", "expired"]),
    wire.RankSummary: st.sampled_from(["live", "expired"]),
    wire.TransferJob: st.sampled_from(["queued", "running", "succeeded", "failed", "cancelled"]),
    wire.KvPath: st.sampled_from(["attested", "failed", "stale"]),
}
KV_PATH_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "producer": names,
    "consumer": names,
    "consumer_rank": ranks,
    "reported": st.sampled_from(["attested", "failed"]),
    "source": st.sampled_from(["canary", "digest"]),
    "producer_generations": st.dictionaries(
        st.integers(0, 8).map(str), st.integers(1, 10_000), max_size=3
    ),
    "consumer_generation": st.integers(1, 10_000),
    "element": st.none()
    | st.fixed_dictionaries(
        {
            "layer": st.integers(0, 100),
            "head": st.integers(-1, 64),
            "kv": st.sampled_from(["K", "V"]),
            "token": counts,
            "detail": st.text(max_size=20),
        }
    ),
    "cost_ms": st.none() | st.floats(0, 1e4),
}


def _strategy(model: type) -> st.SearchStrategy[Any]:
    hints = wire.codec._hints(model)  # the same resolved hints the codec reads
    fields = {}
    for field in dataclasses.fields(model):
        fields[field.name] = _field(model, field.name, hints[field.name])
    return st.builds(model, **fields)


def _field(model: type, name: str, hint: Any) -> st.SearchStrategy[Any]:
    if name == "state":
        return STATES[model]
    if name == "id" and hint is str:  # a job id; the rejection log's ids are integers
        return st.uuids().map(str)
    special = _pair_field(name) if model is wire.CompatibilityPair else None
    if model is wire.KvPath:
        special = KV_PATH_FIELDS.get(name)
    if special is not None:
        return special
    if model is wire.TransferRequest and name == "receiver_ranks":
        return st.lists(ranks, min_size=1, max_size=4, unique=True).map(tuple)
    if model is wire.CompatibilityInstance and name == "live_ranks":
        return st.lists(ranks, max_size=4).map(tuple)
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if typing.get_origin(hint) is tuple and dataclasses.is_dataclass(args[0]):
        return st.lists(_strategy(args[0]), max_size=2).map(tuple)
    nested = args[0] if optional else hint
    if dataclasses.is_dataclass(nested):  # a model inside a model (a deployment's pairing)
        return st.none() | _strategy(nested) if optional else _strategy(nested)
    if name in FIELDS:
        return FIELDS[name]
    base = args[0] if optional else hint
    strategy = {datetime: stamps, str: st.text(max_size=12), bool: st.booleans()}.get(base, counts)
    return st.none() | strategy if optional else strategy


def _pair_field(name: str) -> st.SearchStrategy[Any] | None:
    return {
        "generation": names,
        "status": st.sampled_from(["compatible", "incompatible", "incomplete"]),
        "compatible": st.none() | st.booleans(),
        "refusal": st.none() | refusals,
        "missing_ranks": st.none() | st.dictionaries(names, st.lists(ranks, max_size=3)),
        "pairing": st.none()
        | st.fixed_dictionaries(
            {"allowed": st.booleans(), "shared_domains": st.lists(st.just("zone"), max_size=1)}
        ),
    }.get(name)


def _validator(name: str) -> Any:
    root = {"$ref": f"#/components/schemas/{name}", "components": SPEC["components"]}
    return jsonschema_rs.Draft202012Validator(root, validate_formats=True)


@pytest.mark.parametrize("model", MODELS + REQUESTS, ids=lambda model: model.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_model_renders_to_its_schema_and_parses_back(model: type, data: st.DataObject):
    value = data.draw(_strategy(model))
    rendered = wire.to_json(value)
    errors = [error.message for error in _validator(model.__name__).iter_errors(rendered)]
    assert errors == [], rendered
    assert wire.from_json(model, rendered) == value


def test_every_response_schema_has_a_model_and_the_client_reads_those_models():
    answers = {
        "Registered", "LeaseRenewed", "LeasedRank", "EngineLease", "Event", "Rank", "RankSummary", "InstanceSummary", "Instance",
        "DeploymentSummary", "Deployment", "Rejection", "TokenRange", "TransferJob",
        "CompatibilityInstance", "CompatibilityPair", "Compatibility",
        "Pairing", "PairChoice", "PairExclusion", "GenerationPairs", "Pairs", "KvPath", "KvPaths",
    }  # fmt: skip
    assert {model.__name__ for model in MODELS} == answers <= set(SPEC["components"]["schemas"])
    assert client.RankInfo is wire.Rank
    assert client.TransferStatus is wire.TransferJob
    assert client.Compatibility is wire.Compatibility


def test_a_missing_member_is_named() -> None:
    body = wire.to_json(wire.LeaseRenewed(datetime(2026, 1, 1, tzinfo=UTC)))
    del body["lease_expires_at"]
    with pytest.raises(wire.WireError, match="lease_expires_at"):
        wire.from_json(wire.LeaseRenewed, body)


@pytest.mark.parametrize(
    ("model", "body", "member"),
    [
        (wire.TokenRange, {"start": "3", "end": 7}, "start"),  # a string is not a number
        (wire.TokenRange, {"start": 3, "end": 7.9}, "end"),  # nor a float an integer
        (wire.TokenRange, {"start": True, "end": 7}, "start"),  # nor a boolean an integer
        (wire.TokenRange, {"start": "3", "end": 7.9}, "start"),
    ],
)
def test_a_member_of_the_wrong_type_is_refused_not_coerced(
    model: type, body: dict[str, Any], member: str
) -> None:
    with pytest.raises(wire.WireError, match=rf"{model.__name__}\.{member}: expected"):
        wire.from_json(model, body)


def test_an_integral_number_is_an_integer_as_json_schema_counts_it() -> None:
    """The spec validates 5.0 as an integer, so the codec must read it as 5 (it raised, and a
    transfer request with ``"receiver_ranks": [5675.0]`` answered 500)."""
    decoded = wire.from_json(wire.TokenRange, {"start": 3.0, "end": 7})
    assert decoded == wire.TokenRange(3, 7)
    assert type(decoded.start) is int


def test_a_role_must_be_a_string_and_a_flag_a_boolean() -> None:
    stamp = datetime(2026, 1, 1, tzinfo=UTC)
    summary = wire.RankSummary(0, "context", 1, "live", stamp, stamp)
    body = wire.to_json(summary)
    assert wire.from_json(wire.RankSummary, body) == summary
    with pytest.raises(wire.WireError, match=r"RankSummary\.role: expected a string, got 5"):
        wire.from_json(wire.RankSummary, body | {"role": 5})
    with pytest.raises(wire.WireError, match=r"RankSummary\.generation: expected an integer"):
        wire.from_json(wire.RankSummary, body | {"generation": False})
    with pytest.raises(wire.WireError, match=r"RankSummary\.registered_at: expected an ISO"):
        wire.from_json(wire.RankSummary, body | {"registered_at": 1767225600})
