"""``kvroute demo --small`` end to end: a subprocess, its output and its exit status."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

DEMO_LIMIT_S = 240
VERIFIED = re.compile(r"verified\s*│\s*ok\s*│.*?([\d,]+) checked\s*│\s*0 wrong")


def run_demo(*arguments: str) -> tuple[str, int]:
    """``kvroute demo`` with ``arguments`` in a subprocess: its output, after it exited 0 and
    reported its check with nothing wrong, and how many bytes that check compared."""
    result = subprocess.run(
        [sys.executable, "-m", "kvroute", "demo", *arguments],
        capture_output=True,
        text=True,
        timeout=DEMO_LIMIT_S,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    verified = VERIFIED.search(output)
    assert verified is not None, output
    return output, int(verified.group(1).replace(",", ""))


def test_small_demo_moves_and_verifies_every_byte() -> None:
    output, checked = run_demo("--small", "--jobs", "3")
    assert "registered ctx0: context, TP4, 4 live ranks" in output
    assert "registered gen0: generation, TP2, 2 live ranks" in output
    assert (
        "refused gen-bad: 409 head_dim_mismatch field=attention.head_dim local=8 peer=16" in output
    )
    assert "4 tokens/block -> generation gen0 TP2, 8" in output
    # The path is attested by a canary before any request moves (docs/integrity.md).
    assert "canary ctx0 -> gen0 rank 0: attested" in output
    assert "canary ctx0 -> gen0 rank 1: attested" in output
    assert output.count("succeeded") == 3
    for tokens in ("[3, 18)", "[18, 33)", "[33, 48)"):  # mid-block starts and ends on both sides
        assert tokens in output
    # Every slot of both generation ranks is checked, received or not (the cached prefix and all):
    # 6 slots of 8 tokens x 2 ranks x (4 target layers x K,V x 4 heads x 16 x 2 bytes + 1 draft
    # layer with 1 head), per token.
    assert checked == 6 * 8 * 2 * (4 * 2 * 4 * 16 * 2 + 2 * 16 * 2)


def test_small_hybrid_demo_moves_blocks_and_state_and_refuses_other_ssm_heads() -> None:
    output, checked = run_demo("--model", "hybrid", "--small", "--jobs", "2")
    assert "registered ctx0: context, TP4, 4 live ranks" in output
    assert "registered gen0: generation, TP2, 2 live ranks" in output
    # The refused instance keeps half the d_state: 4 x 2 x 2 bytes per SSM head against 4 x 4 x 2.
    assert (
        "refused gen-bad: 409 ssm_bytes_per_head_mismatch field=views[1].ssm_bytes_per_head "
        "local=16 peer=32" in output
    )
    assert "4 tokens/block -> generation gen0 TP2, 8 tokens/block" in output
    # The canary (attention KV and the Mamba2 state) attests both paths before any request moves.
    assert "canary ctx0 -> gen0 rank 0: attested" in output
    assert "canary ctx0 -> gen0 rank 1: attested" in output
    # Each job: one request's prompt after a 3-token cached prefix, starting mid-block on both
    # sides, and its state slot once.
    assert output.count("succeeded") == 2
    assert output.count("[3, 11)") == 2
    # Every byte of both generation pools: 8 slots (2 requests x 2 blocks of 8 tokens + 1 state
    # slot each, and the canary's state slot and block) of max(KV block: 2 layers x K,V x 2 heads
    # x 8 tokens x 16 x 2 bytes = 2048, state: 3 Mamba layers x (4 SSM heads x 4 x 4 x 2 + 24 conv
    # channels x 3 x 2) = 816) bytes, per rank.
    assert checked == 2 * 8 * 2048
    # Each request's state reaches each generation rank from its two context ranks: 816 bytes.
    assert re.search(r"│\s*0\s*│\s*0, 1\s*│\s*0, 1\s*│\s*16\s*│\s*2,048\s*│\s*816\s*│", output), (
        output
    )
    # Per job and rank: 8 tokens x 256 bytes of KV, and the state.
    assert output.count("5,728") == 2


def test_small_mla_cp_demo_spreads_tokens_over_generation_cp_ranks() -> None:
    output, checked = run_demo("--model", "mla-cp", "--small", "--jobs", "2")
    assert "registered ctx0: context, TP4, 4 live ranks" in output
    assert "registered gen0: generation, TP1 x CP4, 4 live ranks" in output
    assert (
        "refused gen-bad: 422 context_parallel_layout_unsupported field=cp_layout local=zigzag "
        "peer=interleaved" in output
    )
    # The canary under context parallelism: each generation CP rank checks the positions it holds.
    for rank in range(4):
        assert f"canary ctx0 -> gen0 rank {rank}: attested" in output
    # Every generation CP rank hears from the four context ranks (MLA replicates the latent over
    # TP); one elected context rank writes.
    assert len(re.findall(r"│\s*[0-3]\s*│\s*0, 1, 2, 3\s*│\s*0\s*│", output)) == 4, output
    assert output.count("succeeded") == 2
    # A job moves its range's latent rows (4 layers x 32 elements x 2 bytes per token) to
    # whichever CP rank holds each token: 18 and 19 tokens.
    assert re.search(r"\[3, 21\)\s*│\s*[\d,]+\s*│\s*4,608\s*│", output), output
    assert re.search(r"\[21, 40\)\s*│\s*[\d,]+\s*│\s*4,864\s*│", output), output
    # Every byte of the four CP ranks' pools: 3 slots of 4 local tokens x 4 layers x 32 x 2 bytes.
    assert checked == 4 * 3 * 4 * 4 * 32 * 2


def test_small_mla_cp_zigzag_demo_moves_prefill_chunks_to_decode_cp_ranks() -> None:
    output, _ = run_demo("--model", "mla-cp-zigzag", "--small", "--jobs", "2")
    assert "registered ctx0: context, TP2 x CP2, 4 live ranks" in output
    assert "TP2 x CP2 (zigzag chunks)" in output
    # Each context CP rank writes its zig-zag chunks of the canary, each generation CP rank
    # checks the positions it holds.
    for rank in range(4):
        assert f"canary ctx0 -> gen0 rank {rank}: attested" in output
    # Both context CP ranks (one elected TP replica each: ranks 0 and 1) write to every
    # generation CP rank: zig-zag chunks and interleave 1 share tokens on every pair.
    assert len(re.findall(r"│\s*[0-3]\s*│\s*0, 1, 2, 3\s*│\s*0, 1\s*│", output)) == 4, output
    assert output.count("succeeded") == 2
    # Tokens [3, 42) of a 42-token prompt, 4 layers x 32 elements x 2 bytes each.
    assert re.search(r"\[3, 22\)\s*│\s*[\d,]+\s*│\s*4,864\s*│", output), output
    assert re.search(r"\[22, 42\)\s*│\s*[\d,]+\s*│\s*5,120\s*│", output), output
