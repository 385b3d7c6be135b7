"""The README stands alone: every file it names is in this repository, none lies outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TOP_LEVEL = ("service/", "tests/", "docker/", "scripts/", "migrations/", "api_spec/", "bench/")
TOP_LEVEL += ("examples/", ".ci/")


def test_no_link_leaves_the_repository() -> None:
    assert not re.search(r"(?<![.\w])\.\./", README)
    targets = re.findall(r"\]\(([^)]+)\)", README)
    assert all(t.startswith(("http://127.0.0.1", "#")) or (ROOT / t).exists() for t in targets)


def test_every_path_it_names_exists() -> None:
    named = {
        path.rstrip("/.,")
        for path in re.findall(r"`([^`\s]+)`", README)
        if path.startswith(TOP_LEVEL) and "{" not in path and "*" not in path
    }
    assert "scripts/serve.sh" in named
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert missing == []
