"""A contributor's quick run without the vLLM extra: ``tests/engines`` skips, naming what is
missing, instead of erroring at collection.

pytest runs ``tests/engines`` in a child interpreter whose import system cannot find ``vllm`` (as if
it were not installed: ``find_spec`` answers None and an import fails), so the answer does not depend
on whether this machine has vLLM.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines import VLLM_MISSING

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 300
WITHOUT_VLLM = r"""
import importlib.machinery, sys

class WithoutVllm(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "vllm":
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [
    WithoutVllm if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path
]
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_engine_tests_skip_without_vllm(tmp_path: Path) -> None:
    modules = sorted((REPO / "tests" / "engines").glob("test_*.py"))
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_VLLM, "-n", "0", "-p", "no:cacheprovider", "-rs", "-q"]
        + [str(module) for module in modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    # Modules that skip whole collect no test: pytest's exit status 5, not an error (1 or 2).
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith(f"{len(modules)} skipped")
    # "SKIPPED [n] where: reason", one line per reason: every module skips for vLLM (or for nixl,
    # which test_vllm_pull checks first).
    reasons = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", result.stdout, re.MULTILINE)
    assert sum(int(count) for count, _ in reasons) == len(modules), result.stdout
    assert {reason for _, reason in reasons} <= {VLLM_MISSING, "nixl is not installed"}
    assert VLLM_MISSING in {reason for _, reason in reasons}
