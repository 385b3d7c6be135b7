"""The package's shape, read from its source: layers point one way, no cycles, small modules.

``cli -> api -> control -> {transfer, store, geometry}``, ``transfer -> geometry``,
``store -> geometry``; ``client -> geometry``; ``engines -> client, geometry``; ``wire`` (the answers' shapes) is a leaf like
``geometry``, read by the store, the api and the client. The api layer runs no SQL (it imports no
SQLAlchemy), the data plane knows no store, the control layer no HTTP, the geometry core no I/O.
Of ``engines``, ``engines.vllm`` runs inside vLLM's processes only, and nothing of the server
imports it; ``engines.models`` (a model config and two layouts to registration documents and a
pre-flight verdict: pure functions of the config, no engine package, no server) is shared: the
api's ``POST /v1/preflight`` and ``kvroute check`` run it, as a worker host may.
The api's handlers and its reaper reach the store only through ``control``: of the store the api
imports the error types its error table maps, the record types and the database's lifetime
(``API_STORE_IMPORTS``), never a unit of work.
Imports are read with ``ast`` (function-level ones included, ``TYPE_CHECKING`` blocks excluded),
so a lazy import cannot hide a dependency.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "kvroute"
MAX_MODULE_LINES = 400
MAX_TOP_LEVEL_MODULES = 5  # plain modules beside the packages, __init__ excluded

# Layer -> kvroute layers (and outside libraries) it must not import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "geometry": ("kvroute", "aiohttp", "sqlalchemy", "torch", "numpy", "asyncio"),
    "wire": ("kvroute", "aiohttp", "sqlalchemy", "torch", "numpy", "asyncio"),
    "store": ("kvroute.api", "kvroute.control", "kvroute.transfer", "kvroute.cli", "aiohttp"),
    "transfer": ("kvroute.store", "kvroute.control", "kvroute.api", "kvroute.cli", "sqlalchemy"),
    "control": ("kvroute.api", "kvroute.cli", "kvroute.engines", "aiohttp"),
    # The api runs the models pre-flight (``engines.models``), never an engine's adapter.
    "api": ("kvroute.cli", "kvroute.engines.vllm", "sqlalchemy"),
    "cli": ("kvroute.engines.vllm",),
    "client": ("kvroute.store", "kvroute.control", "kvroute.api", "kvroute.cli", "sqlalchemy"),
    # Engine adapters run inside an engine's processes: a worker's dependencies, nothing of the server.
    "engines": ("kvroute.store", "kvroute.control", "kvroute.api", "kvroute.cli", "sqlalchemy"),
    # The P/D proxy is an HTTP client of kvroute and of engines: the client, nothing of the server.
    "proxy": (
        "kvroute.store",
        "kvroute.control",
        "kvroute.api",
        "kvroute.cli",
        "kvroute.transfer",
        "kvroute.engines",
        "sqlalchemy",
        "torch",
    ),
    # The pre-flight the api shares reads a config: no engine package, no adapter, no I/O library.
    "engines.models": ("kvroute.engines.vllm", "vllm", "torch", "aiohttp", "asyncio"),
}
# geometry and wire may import themselves; the entries above forbid every other kvroute package.
ALLOWED_SELF = {"geometry": "kvroute.geometry", "wire": "kvroute.wire"}
# What the api may import of the store (None: any name of that module); everything else it needs
# of the database (registration, reads, deletions, the reaper's rounds, pings) is a control service.
API_STORE_IMPORTS: dict[str, frozenset[str] | None] = {
    "kvroute.store.errors": None,  # the error table maps them
    "kvroute.store.faults": None,
    "kvroute.store.records": None,  # plain records (RankName)
    "kvroute.store.engine": frozenset(
        {"Engine", "SessionMaker", "create_engine", "make_sessionmaker", "dispose"}
    ),  # the app opens the database and disposes of it; nothing here reads or writes it
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> Iterator[str]:
    """Every module name an import statement of ``path`` names, inside functions too
    (TYPE_CHECKING blocks skipped)."""

    def visit(nodes: list[ast.stmt]) -> Iterator[str]:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                named = [name for name in submodules if name in MODULES]
                yield from named or [node.module]
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list) and children and isinstance(children[0], ast.AST):
                    yield from visit(children)  # type: ignore[arg-type]

    return visit(ast.parse(path.read_text()).body)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer: str) -> None:
    offences = []
    for name, path in MODULES.items():
        if not name.startswith(f"kvroute.{layer}"):
            continue
        for imported in _imports(path):
            own = ALLOWED_SELF.get(layer)
            if own and _within(imported, own):
                continue
            if any(_within(imported, package) for package in FORBIDDEN[layer]):
                offences.append(f"{name} imports {imported}")
    assert offences == []


def test_the_api_reaches_the_store_only_through_control() -> None:
    offences = []
    for name, path in MODULES.items():
        if not name.startswith("kvroute.api"):
            continue
        for module, imported in _store_imports(path):
            allowed = API_STORE_IMPORTS.get(module, frozenset())
            if allowed is not None and imported not in allowed:
                offences.append(f"{name} imports {module}: {imported}")
    assert offences == []


def _store_imports(path: Path) -> Iterator[tuple[str, str]]:
    """(store module, name) for every import of the store in ``path``, wherever it sits;
    ``*`` for a whole module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, "kvroute.store"):
                    yield alias.name, "*"
        elif isinstance(node, ast.ImportFrom) and _within(node.module or "", "kvroute.store"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield (submodule, "*") if submodule in MODULES else (node.module, alias.name)


def test_no_import_cycles_between_modules() -> None:
    """Function-level imports count: a lazy import that closes a cycle still ties the modules
    into one (``geometry.model`` once reached ``document`` and ``classes`` that way, and with them
    eleven geometry modules)."""
    graph = {
        name: {imported for imported in _imports(path) if imported in MODULES} - {name}
        for name, path in MODULES.items()
    }
    cycles = _strongly_connected(graph)
    assert cycles == []


def test_modules_stay_small_and_few_sit_at_the_top() -> None:
    long = {
        name: n
        for name, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
    top = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, sorted(top)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; components of more than one module are cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = itertools.count()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles
