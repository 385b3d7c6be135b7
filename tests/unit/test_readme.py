"""The README and docs/ stand alone: every file they name is in this repository, none lies outside it,
and every link lands on a page (and a heading) that exists."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
TOP_LEVEL = ("service/", "tests/", "docker/", "scripts/", "migrations/", "api_spec/", "bench/")
TOP_LEVEL += ("examples/", ".ci/", "docs/")
# Module paths in the docs are often written from the package, as `store/peers.py`.
PACKAGE = ROOT / "service" / "kvroute"
FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|sh|json|ini|toml|txt)$")
LOCAL_URL = "http://127.0.0.1"


def _ids(page: Path) -> list[str]:
    return [str(page.relative_to(ROOT)) for page in PAGES]


def _text(page: Path) -> str:
    return page.read_text()


def _slugs(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces hyphens."""
    seen: Counter[str] = Counter()
    slugs = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _text(page), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        slugs.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return slugs


def _inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def _link_problem(page: Path, target: str) -> str | None:
    """Why a markdown link of ``page`` does not land, or None when it does."""
    if target.startswith(LOCAL_URL):
        return None
    file_part, _, anchor = target.partition("#")
    destination = (page.parent / file_part) if file_part else page
    if not _inside(destination):
        return "leaves the repository"
    if not destination.exists():
        return "no such file"
    if anchor and destination.suffix == ".md" and anchor not in _slugs(destination):
        return f"no heading #{anchor} in {destination.relative_to(ROOT)}"
    return None


def _named_paths(page: Path) -> set[str]:
    """Backticked repository paths: from the top-level folders, or any relative name of a file."""
    named = set()
    for token in re.findall(r"`([^`\s]+)`", _text(page)):
        path = token.rstrip("/.,")
        if "{" in path or "*" in path or "<" in path or ":" in path or path.startswith("/"):
            continue
        if path.startswith(TOP_LEVEL) or ("/" in path and FILE_SUFFIX.search(path)):
            named.add(path)
    return named


def _resolves(page: Path, path: str) -> bool:
    return any(
        _inside(base / path) and (base / path).exists() for base in (ROOT, page.parent, PACKAGE)
    )


def test_the_readme_names_no_path_above_the_repository() -> None:
    assert not re.search(r"(?<![.\w])\.\./", _text(README))


def test_the_readme_links_every_docs_page() -> None:
    linked = set(re.findall(r"\]\((docs/[^)#]+)", _text(README)))
    pages = {str(page.relative_to(ROOT)) for page in PAGES if page != README}
    assert pages - linked == set()


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_link_lands(page: Path) -> None:
    targets = re.findall(r"\]\(([^)\s]+)\)", _text(page))
    problems = {t: why for t in targets if (why := _link_problem(page, t)) is not None}
    assert problems == {}


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_path_it_names_exists(page: Path) -> None:
    missing = sorted(path for path in _named_paths(page) if not _resolves(page, path))
    assert missing == []


def test_the_checks_see_what_they_check() -> None:
    """The patterns find the README's own names, so a silent regex change cannot pass everything."""
    assert "scripts/serve.sh" in _named_paths(README)
    assert "geometry/registration/faces.py" in _named_paths(ROOT / "docs" / "geometry.md")
    assert _link_problem(README, "docs/nowhere.md") == "no such file"
    assert _link_problem(README, "../outside.md") == "leaves the repository"
    assert _link_problem(README, "docs/api.md#no-such-heading") is not None
    assert _link_problem(ROOT / "docs" / "engines" / "vllm.md", "../api.md#errors") is None
