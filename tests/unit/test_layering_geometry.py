"""The geometry core's layers, read from its source: each imports only the layers before it.

``leaves <- tokens <- registration <- checks <- plans``: a module of a layer imports modules of its
own layer or of earlier ones, never of a later one, nor the package root (which re-exports them
all). Imports are read with ``ast`` everywhere in a module, ``TYPE_CHECKING`` blocks and
function-level imports included: a type-only import still makes the lower layer know the higher.
Every module sits in a layer, and each layer's docstring names its modules (its reading path).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

GEOMETRY = Path(__file__).resolve().parents[2] / "service" / "kvroute" / "geometry"
LAYERS = ("leaves", "tokens", "registration", "checks", "plans")
ROOT = "kvroute.geometry"


def _imported(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, dotted name) of every kvroute.geometry import; ``from a import b`` gives ``a.b``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: relative import"
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.startswith(f"{ROOT}.")]


def _layer_of(name: str) -> str | None:
    """The layer a dotted name lies in; None for the package root (or a name it re-exports)."""
    first = name.removeprefix(f"{ROOT}.").split(".")[0]
    return first if first in LAYERS else None


def upward_imports(layer: str, source: str) -> list[str]:
    """The imports in ``source`` (a module of ``layer``) that point to a later layer or the root."""
    rank = LAYERS.index(layer)
    wrong = []
    for line, name in _imported(ast.parse(source)):
        target = _layer_of(name)
        if target is None or LAYERS.index(target) > rank:
            wrong.append(f"line {line}: {name}")
    return wrong


def _modules() -> list[tuple[str, Path]]:
    return [
        (path.parent.name, path) for layer in LAYERS for path in (GEOMETRY / layer).glob("*.py")
    ]


@pytest.mark.parametrize(("layer", "path"), _modules(), ids=lambda value: str(value))
def test_a_layer_imports_only_earlier_layers(layer: str, path: Path) -> None:
    assert upward_imports(layer, path.read_text()) == [], f"{layer}/{path.name} imports upward"


def test_the_check_finds_an_upward_import() -> None:
    """The test above can fail: a type-only import of the model from a token module is upward."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from kvroute.geometry.leaves.errors import GeometryError\n"
        "if TYPE_CHECKING:\n"
        "    from kvroute.geometry.registration.model import RankRegistration\n"
        "def late():\n"
        "    from kvroute.geometry import build_plan\n"
    )
    assert upward_imports("tokens", source) == [
        "line 4: kvroute.geometry.registration.model.RankRegistration",
        "line 6: kvroute.geometry.build_plan",
    ]
    assert upward_imports("plans", source) == ["line 6: kvroute.geometry.build_plan"]


def test_every_module_sits_in_a_layer() -> None:
    flat = sorted(path.name for path in GEOMETRY.glob("*.py") if path.name != "__init__.py")
    assert flat == []
    assert sorted(
        path.name for path in GEOMETRY.iterdir() if path.is_dir() and path.name != "__pycache__"
    ) == sorted(LAYERS)


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_docstring_is_its_reading_path(layer: str) -> None:
    """One line per module, ``- module: ...``, naming every module of the layer exactly once."""
    doc = importlib.import_module(f"{ROOT}.{layer}").__doc__ or ""
    listed = [line[2:].split(":")[0] for line in doc.splitlines() if line.startswith("- ")]
    present = {path.stem for path in (GEOMETRY / layer).glob("*.py")} - {"__init__"}
    assert sorted(listed) == sorted(present)
