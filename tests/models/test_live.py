"""``check`` against a live kvroute: the documents registered give the verdict ``check`` gives,
``check --url`` asks the server's dry-run admission and stores nothing, and for random layouts
the local verdict agrees with registering (a Hypothesis property)."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.cli.main import main
from kvroute.engines.models import LayoutError, UnsupportedLayout, parse_layout
from kvroute.engines.models.preflight import CONTEXT, GENERATION, admit, describe
from kvroute.live import LiveServer
from tests.client.live import WORKER_TOKEN, live_server_in
from tests.models.configs import path, raw, spec
from tests.models.live import call, local_refusal, register_all, same_refusal

EXAMPLES = max(10, int(os.environ.get("KVROUTE_PROPERTY_EXAMPLES", "2000")) // 100)
_names = itertools.count()

LLAMA = raw("llama-3.1-70b")
# (model, context layout, generation layout, generation model, draft of each side, code or None)
PAIRS: list[tuple[str, str, str, dict[str, Any] | None, str | None, str | None]] = [
    ("llama-3.1-70b", "tp=8,pp=2,tpb=32", "tp=4,tpb=64", None, None, None),
    ("llama-3.1-70b", "tp=8,tpb=32", "tp=3,tpb=32", None, None, "tp_heads_not_divisible"),
    (
        "llama-3.1-70b",
        "tp=4,tpb=32",
        "tp=4,tpb=32",
        {**LLAMA, "num_key_value_heads": 16},
        None,
        "total_kv_heads_mismatch",
    ),
    ("llama-3.1-70b", "tp=4,tpb=32", "tp=2,tpb=32,dtype=fp8", None, None, "element_size_mismatch"),
    (
        "deepseek-v3",
        "tp=4,pp=2,tpb=64,mtp=1",
        "tp=8,dp=8,tpb=64",
        None,
        None,
        "draft_layers_mismatch",
    ),
    ("gpt-oss-120b", "tp=8,tpb=16", "tp=2,tpb=32", None, None, None),
    (
        "nemotron-h-8b",
        "tp=4,tpb=32",
        "tp=2,tpb=64",
        {**raw("nemotron-h-8b"), "ssm_state_size": 64},
        None,
        "ssm_bytes_per_head_mismatch",
    ),
    ("jamba-mini-1.5", "tp=2,pp=2,tpb=16", "tp=8,tpb=16", None, None, None),
    ("qwen3-next-80b-a3b", "tp=4,tpb=32", "tp=2,tpb=64", None, None, None),
    (
        "qwen3-next-80b-a3b",
        "tp=4,tpb=32",
        "tp=2,tpb=64",
        {**raw("qwen3-next-80b-a3b"), "linear_num_key_heads": 8},
        None,
        "conv_section_mismatch",
    ),
    ("kimi-linear-48b-a3b", "tp=2,tpb=64", "tp=8,dp=8,tpb=64", None, None, None),
    ("minimax-text-01", "tp=8,tpb=16", "tp=4,pp=2,tpb=32", None, None, None),
    ("mistral-7b-v0.1", "tp=2,tpb=16", "tp=4,tpb=32", None, None, None),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = live_server_in(tmp_path_factory.mktemp("kvroute-preflight")).start()
    try:
        yield live
    finally:
        live.stop()


def _sides(
    model: str, context: str, generation: str, other: dict[str, Any] | None, draft: str | None
):  # type: ignore[no-untyped-def]
    draft_spec = spec(draft) if draft else None
    ctx = describe(spec(model), parse_layout(context, "context"), draft=draft_spec)
    gen = describe(
        spec(other or model),
        parse_layout(generation, "generation"),
        draft=draft_spec,
        name=GENERATION,
    )
    return ctx, gen


@pytest.mark.parametrize(("model", "context", "generation", "other", "draft", "code"), PAIRS)
def test_registering_gives_the_verdict_check_gives(
    server: LiveServer,
    model: str,
    context: str,
    generation: str,
    other: dict[str, Any] | None,
    draft: str | None,
    code: str | None,
) -> None:
    ctx, gen = _sides(model, context, generation, other, draft)
    local = local_refusal(admit(ctx, gen))
    assert (local or {}).get("code") == code
    deployment = f"pairs{next(_names)}"
    live = register_all(server.url, deployment, ctx, gen)
    assert same_refusal(live, local), (live, local)


def test_check_url_asks_the_live_deployment_and_stores_nothing(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    deployment = f"url{next(_names)}"
    ctx, _ = _sides("llama-3.1-70b", "tp=8,tpb=32", "tp=4,tpb=32", None, None)
    assert register_all(server.url, deployment, ctx) is None
    before = call(f"{server.url}/v1/deployments/{deployment}/instances", "GET", admin=True)
    rejections = call(f"{server.url}/v1/rejections", "GET", admin=True)
    base = [
        "check",
        "--model",
        str(path("llama-3.1-70b")),
        "--url",
        server.url,
        "--deployment",
        deployment,
        "--token",
        WORKER_TOKEN,
    ]
    assert main([*base, "--generation", "tp=2,tpb=64"]) == 0
    assert "admitted: preflight-generation (2 ranks)" in capsys.readouterr().out
    assert main([*base, "--generation", "tp=6,tpb=64"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        "refused: tp_heads_not_divisible (422) registering preflight-generation rank 0"
    )
    assert call(f"{server.url}/v1/deployments/{deployment}/instances", "GET", admin=True) == before
    assert call(f"{server.url}/v1/rejections", "GET", admin=True) == rejections


def test_dry_run_of_a_revision_names_the_live_peer(
    server: LiveServer, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    deployment = f"rev{next(_names)}"
    ctx, _ = _sides("qwen3-32b", "tp=4,tpb=16", "tp=4,tpb=16", None, None)
    assert register_all(server.url, deployment, ctx) is None
    revision = tmp_path / "config.json"
    revision.write_text(json.dumps({**raw("qwen3-32b"), "num_key_value_heads": 4}))
    argv = [
        "check",
        "--model",
        str(revision),
        "--generation",
        "tp=2,tpb=16",
        "--url",
        server.url,
        "--deployment",
        deployment,
        "--token",
        WORKER_TOKEN,
        "--json",
    ]
    assert main(argv) == 1
    answer = json.loads(capsys.readouterr().out)
    refusal = answer["refusal"]
    assert (refusal["code"], refusal["field"], refusal["local"], refusal["peer"]) == (
        "total_kv_heads_mismatch",
        "views[0].total_kv_heads",
        4,
        8,
    )
    assert (refusal["peer_instance"], refusal["peer_rank"], refusal["status"]) == (CONTEXT, 0, 409)


MODELS = [
    "llama-3.1-70b",
    "qwen3-32b",
    "deepseek-v3",
    "gpt-oss-120b",
    "nemotron-h-8b",
    "jamba-mini-1.5",
    "qwen3-next-80b-a3b",
    "kimi-linear-48b-a3b",
    "minimax-text-01",
    "mistral-7b-v0.1",
]


@st.composite
def layouts(draw: st.DrawFn) -> str:
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    pp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([1, tp]))
    tpb = draw(st.sampled_from([16, 32, 64]))
    dtype = draw(st.sampled_from(["auto", "auto", "fp8"]))
    return f"tp={tp},pp={pp},dp={dp},tpb={tpb},dtype={dtype}"


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(model=st.sampled_from(MODELS), context=layouts(), generation=layouts())
def test_check_agrees_with_registering_for_random_layouts(
    server: LiveServer, model: str, context: str, generation: str
) -> None:
    try:
        ctx, gen = _sides(model, context, generation, None, None)
    except (UnsupportedLayout, LayoutError):  # the engine could not run it (Mamba heads over TP 3)
        return
    local = local_refusal(admit(ctx, gen))
    deployment = f"prop{next(_names)}"
    instances = [{"instance": i.name, "ranks": list(i.documents)} for i in (ctx, gen)]
    status, dry = call(
        f"{server.url}/v1/deployments/{deployment}/admission-checks",
        "POST",
        {"instances": instances},
    )
    assert status == 200
    assert same_refusal(dry.get("refusal"), local), (dry, local)
    live = register_all(server.url, deployment, ctx, gen)
    assert same_refusal(live, local), (live, local)
