"""``kvroute demo --small`` end to end: a subprocess, its output and its exit status."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

DEMO_LIMIT_S = 240


def test_small_demo_moves_and_verifies_every_byte() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvroute", "demo", "--small", "--jobs", "3"],
        capture_output=True,
        text=True,
        timeout=DEMO_LIMIT_S,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "registered ctx0: context, TP4, 4 live ranks" in output
    assert "registered gen0: generation, TP2, 2 live ranks" in output
    assert (
        "refused gen-bad: 409 head_dim_mismatch field=attention.head_dim local=8 peer=16" in output
    )
    assert "4 tokens/block -> generation gen0 TP2, 8" in output
    assert output.count("succeeded") == 3
    for tokens in ("[3, 18)", "[18, 33)", "[33, 48)"):  # mid-block starts and ends on both sides
        assert tokens in output
    verified = re.search(r"verified\s*│\s*ok\s*│.*?([\d,]+) checked\s*│\s*0 wrong", output)
    assert verified is not None, output
    # Every slot of both generation ranks is checked, received or not (the cached prefix and all):
    # 6 slots of 8 tokens x 2 ranks x (4 target layers x K,V x 4 heads x 16 x 2 bytes + 1 draft
    # layer with 1 head), per token.
    assert int(verified.group(1).replace(",", "")) == 6 * 8 * 2 * (4 * 2 * 4 * 16 * 2 + 2 * 16 * 2)
