"""``kvroute describe`` and ``kvroute check`` as a user runs them: outputs and exit statuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli.main import main
from tests.models.configs import path, raw


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_describe_writes_json_lines_or_a_file_per_rank(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = str(path("llama-3.1-70b"))
    status, out, _ = run(
        capsys, "describe", "--model", model, "--tp", "8", "--pp", "2", "--tokens-per-block", "32"
    )
    lines = [json.loads(line) for line in out.splitlines()]
    assert status == 0
    assert [(d["pp_rank"], d["tp_rank"]) for d in lines] == [
        (p, t) for p in range(2) for t in range(8)
    ]
    status, out, _ = run(
        capsys,
        "describe",
        "--model",
        model,
        "--role",
        "generation",
        "--tp",
        "2",
        "--dtype",
        "fp8",
        "--out",
        str(tmp_path),
    )
    assert status == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]
    assert (
        json.loads((tmp_path / "rank1.json").read_text())["attention"]["dtype"] == "float8_e4m3fn"
    )


def test_describe_says_when_registration_would_refuse(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "describe", "--model", str(path("llama-3.1-70b")), "--tp", "3")
    assert status == 1
    assert len(out.splitlines()) == 3
    assert err.startswith("refused: tp_heads_not_divisible (422) registering ctx0 rank 0")


def test_check_compatible_prints_the_summary_plan_and_picture(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    svg = tmp_path / "plan.svg"
    status, out, _ = run(
        capsys, "check", "--model", str(path("llama-3.1-70b")), "--draft", str(path("eagle-llama3-70b")),
        "--context", "tp=8,pp=2,tpb=32", "--generation", "tp=4,tpb=64", "--plan", "--svg", str(svg),
    )  # fmt: skip
    assert status == 0
    assert out.startswith("compatible: ctx0 (16 ranks) -> gen0 (4 ranks)")
    assert "expected writers 4" in out
    assert svg.read_text().startswith("<svg")


def test_check_json_summary_counts_bytes_per_request(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "check", "--model", str(path("llama-3.1-70b")), "--context", "tp=8,tpb=32",
        "--generation", "tp=8,tpb=32", "--prompt-tokens", "64", "--json",
    )  # fmt: skip
    answer = json.loads(out)
    assert status == 0
    # each context rank holds 1 of 8 heads, 80 layers: 2 blocks of 32 tokens x 16384 bytes per layer
    assert [s["bytes_per_request"] for s in answer["senders"]] == [2 * 80 * 16384] * 8
    assert [r["expected_writers"] for r in answer["receivers"]] == [1] * 8
    assert answer["receivers"][0]["fragments_per_block"] == 1


def test_check_counts_fragments_and_the_descriptors_they_merge_into(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Target and Eagle views lie back to back on both sides (same layout): one fragment per view
    pair, one NIXL descriptor for both."""
    status, out, _ = run(
        capsys, "check", "--model", str(path("llama-3.1-70b")), "--draft", str(path("eagle-llama3-70b")),
        "--context", "tp=8,tpb=32", "--generation", "tp=8,tpb=32", "--json",
    )  # fmt: skip
    receiver = json.loads(out)["receivers"][0]
    assert status == 0
    assert (receiver["fragments_per_block"], receiver["nixl_descriptors_per_block"]) == (2, 1)
    assert receiver["bytes_per_block"] == 80 * 16384 + 16384


@pytest.mark.parametrize(
    ("args", "code", "field"),
    [
        (["--generation", "tp=3,tpb=64"], "tp_heads_not_divisible", "views[0].total_kv_heads"),
        (["--generation", "tp=8,tpb=32,dtype=fp8"], "element_size_mismatch", "attention.dtype"),
        (
            ["--generation", "tp=4,tpb=32", "--generation-draft", "revision-draft"],
            "total_kv_heads_mismatch",
            "views[1].total_kv_heads",
        ),
        (
            ["--generation", "tp=4,tpb=32", "--generation-model", "revision"],
            "total_kv_heads_mismatch",
            "views[0].total_kv_heads",
        ),
    ],
)
def test_check_refused_pairs_name_the_code_and_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], code: str, field: str
) -> None:
    (tmp_path / "revision").write_text(
        json.dumps({**raw("llama-3.1-70b"), "num_key_value_heads": 16})
    )
    (tmp_path / "revision-draft").write_text(
        json.dumps({**raw("eagle-llama3-70b"), "num_key_value_heads": 4})
    )
    args = [str(tmp_path / a) if a.startswith("revision") else a for a in args]
    status, out, _ = run(
        capsys, "check", "--model", str(path("llama-3.1-70b")), "--draft", str(path("eagle-llama3-70b")),
        "--context", "tp=8,tpb=32", *args,
    )  # fmt: skip
    assert status == 1
    assert out.startswith(f"refused: {code} ")
    assert f"  field: {field}\n" in out


def test_unsupported_configs_and_bad_layouts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    chunked = tmp_path / "llama4.json"
    chunked.write_text(json.dumps({**raw("llama-3.1-70b"), "attention_chunk_size": 8192}))
    status, _, err = run(
        capsys, "check", "--model", str(chunked), "--context", "tp=1", "--generation", "tp=1"
    )
    assert status == 1
    assert "unsupported config: attention_chunk_size: chunked local attention" in err
    status, _, err = run(
        capsys,
        "check",
        "--model",
        str(path("nemotron-h-8b")),
        "--context",
        "tp=3",
        "--generation",
        "tp=1",
    )
    assert status == 1
    assert "unsupported layout: mamba_num_heads: 128 do not split over TP 3" in err
    status, _, err = run(
        capsys,
        "check",
        "--model",
        str(path("qwen3-32b")),
        "--context",
        "tp=two",
        "--generation",
        "tp=1",
    )
    assert status == 2
    assert "tp='two' is not a whole number" in err
