"""The package's layers have one direction and no package imports another in a circle.

Layers, lowest first (a module may import its own layer or a lower one, never a higher one):

1. core: pure code, no network, processes, servers or printing shells (engine model, simulator,
   workloads, policy, argparse types);
2. adapters at the edge: Dynamo, NATS, etcd, HTTP, child processes (runtime, model directory,
   the simulated worker's shell, the routing state and its two shells, the gateway, the launcher);
3-6. experiments and measuring, by what they measure:
   3. what every experiment shares (`experiment`: intervals, progress, plots);
   4. the paper and the engine model (`paper`: reproduction and fidelity; `calibration`);
   5. the simulator's studies and the advisor (`studies`, `advisor`: they may run the paper's
      protocol);
   6. live deployments (`bench`; `tables` and `chaos` play through its client, `bench compare`
      names its simulated twins by the studies' policy names);
7. the command line.

The checker is a small AST walk over the source (no module is imported, so a forbidden import
cannot hide behind an import error); every import counts, the lazy ones inside functions too,
since a lazy import is still a dependency. On top of that, core modules import none of the I/O
and server libraries below at module level (a function may, e.g. to write a plot on request).
The last tests run the same checker on a tiny synthetic tree to show that it fails on a new
violation.
"""

from __future__ import annotations

import ast
import gc
from dataclasses import dataclass
from pathlib import Path

import pytest

import dynamo_ppd

pytestmark = pytest.mark.unit

CORE, ADAPTER, SHARED, MODEL_CHECKS, STUDIES, LIVE, CLI = 1, 2, 3, 4, 5, 6, 7
LAYER_NAMES = {CORE: "core", ADAPTER: "adapter", SHARED: "experiments' shared tools",
               MODEL_CHECKS: "paper and engine checks", STUDIES: "simulated studies",
               LIVE: "live measurement", CLI: "cli"}

# The layer of each module, by dotted prefix (the longest declared prefix wins). A module whose
# name no entry covers fails `test_every_module_has_a_layer`: a new package says where it sits.
LAYERS = {
    "dynamo_ppd": CORE,  # the package's __init__ (its version)
    "dynamo_ppd.argtypes": CORE,
    "dynamo_ppd.engine": CORE,
    "dynamo_ppd.sim": CORE,
    "dynamo_ppd.workloads": CORE,
    "dynamo_ppd.policy": CORE,
    "dynamo_ppd.runtime": ADAPTER,
    "dynamo_ppd.model": ADAPTER,
    "dynamo_ppd.worker": ADAPTER,
    "dynamo_ppd.routing": ADAPTER,
    "dynamo_ppd.relay": ADAPTER,
    "dynamo_ppd.router": ADAPTER,  # the shim of `python -m dynamo_ppd.router`
    "dynamo_ppd.picker": ADAPTER,
    "dynamo_ppd.gateway": ADAPTER,
    "dynamo_ppd.launch": ADAPTER,
    "dynamo_ppd.experiment": SHARED,
    "dynamo_ppd.paper": MODEL_CHECKS,
    "dynamo_ppd.calibration": MODEL_CHECKS,
    "dynamo_ppd.studies": STUDIES,
    "dynamo_ppd.advisor": STUDIES,
    "dynamo_ppd.bench": LIVE,
    "dynamo_ppd.tables": LIVE,
    "dynamo_ppd.chaos": LIVE,
    "dynamo_ppd.cli": CLI,
    "dynamo_ppd.__main__": CLI,
}

# What pure code must not import at module level: event loops and servers, network clients,
# processes, Dynamo and its transports, metrics exporters, plotting.
CORE_FORBIDDEN = ("asyncio", "aiohttp", "httpx", "subprocess", "multiprocessing", "concurrent.futures",
                  "socket", "nats", "aetcd", "dynamo", "grpc", "prometheus_client", "matplotlib")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module, absolute
    line: int
    top_level: bool  # executed when the module is imported (not inside a function or class)


def module_name(root: Path, path: Path) -> str:
    """Dotted name of ``path`` inside the package directory ``root`` (``root`` itself: its name)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(body: list[ast.stmt], top_level: bool):
    """Import statements under ``body``, each with whether it runs at import time (module level,
    also inside a top-level ``if``/``try``, but not under ``if TYPE_CHECKING``)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, top_level
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _walk(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _walk(node.body, False)
            yield from _walk(node.orelse, top_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    yield from _walk([c for c in children if isinstance(c, ast.stmt)], top_level)
                    for handler in children:
                        if isinstance(handler, ast.ExceptHandler):
                            yield from _walk(handler.body, top_level)


def _parse(path: Path) -> ast.Module:
    """``ast.parse`` with the garbage collector off: CPython 3.11's AST constructor counts its
    recursion depth, and a finalizer the collector runs in the middle (an object an earlier test of
    the session left behind) moves the count, raising "SystemError: AST constructor recursion
    depth mismatch" (a CPython 3.11 bug; seen once in a full run)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()


def collect_imports(root: Path) -> tuple[set[str], list[Import]]:
    """Every module of the package at ``root`` and every import in it, resolved to absolute names;
    ``from X import Y`` names ``X.Y`` when that is a module of the package, else ``X``."""
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(root, p) for p in paths}
    imports = []
    for path in paths:
        source = module_name(root, path)
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node, top_level in _walk(_parse(path).body, True):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                           for alias in node.names]
            imports += [Import(source, t, node.lineno, top_level) for t in dict.fromkeys(targets)]
    return modules, imports


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return layers[".".join(parts[:n])]
    return None


def upward_imports(root: Path, layers: dict[str, int]) -> list[str]:
    """Each import of a module from a higher layer than the importer's, as a readable line."""
    _, imports = collect_imports(root)
    package = root.name
    out = []
    for imp in imports:
        if imp.target != package and not imp.target.startswith(package + "."):
            continue
        low, high = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high > low:
            out.append(f"{imp.source}:{imp.line} ({LAYER_NAMES[low]}) imports {imp.target} "
                       f"({LAYER_NAMES[high]})")
    return out


def package_of(module: str, root_name: str) -> str:
    """The top-level unit a module belongs to: ``pkg.sub`` for ``pkg.sub.x``, the module itself
    for a module directly in the package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else root_name


def package_cycles(root: Path) -> list[list[str]]:
    """Cycles among the package's top-level subpackages and modules (each found once)."""
    _, imports = collect_imports(root)
    name = root.name
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != name and not imp.target.startswith(name + "."):
            continue
        a, b = package_of(imp.source, name), package_of(imp.target, name)
        if a != b:
            graph.setdefault(a, set()).add(b)
    cycles, seen = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append([*cycle, nxt])
            else:
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def module_circles(root: Path) -> list[list[str]]:
    """Groups of modules that import one another in a circle (the strongly connected components of
    the import graph with more than one module, Tarjan's algorithm), each sorted. Every import
    counts, lazy and ``TYPE_CHECKING`` ones too: deferring an import hides a circle, it does not
    break it. A package's ``__init__`` is a module like any other."""
    modules, imports = collect_imports(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.target in modules and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(circles)


def shell_imports(root: Path, shells: tuple[str, ...], allowed: tuple[str, ...]) -> list[str]:
    """Imports of a shell package (the relay router, the endpoint picker) from a package that is
    neither that shell nor one of ``allowed``: a shell is started, never built on."""
    _, imports = collect_imports(root)
    name = root.name
    out = []
    for imp in imports:
        shell = package_of(imp.target, name)
        source = package_of(imp.source, name)
        if shell in shells and source != shell and source not in allowed:
            out.append(f"{imp.source}:{imp.line} imports {imp.target}")
    return out


def core_io_imports(root: Path, layers: dict[str, int]) -> list[str]:
    """Module-level imports of an I/O or server library in a core module."""
    _, imports = collect_imports(root)
    return [f"{imp.source}:{imp.line} imports {imp.target}" for imp in imports
            if imp.top_level and layer_of(imp.source, layers) == CORE
            and any(imp.target == f or imp.target.startswith(f + ".") for f in CORE_FORBIDDEN)]


PACKAGE = Path(dynamo_ppd.__file__).resolve().parent


def test_every_module_has_a_layer():
    modules, _ = collect_imports(PACKAGE)
    assert [m for m in sorted(modules) if layer_of(m, LAYERS) is None] == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(PACKAGE, LAYERS) == []


def test_no_package_cycle():
    assert package_cycles(PACKAGE) == []


def test_no_module_import_circle():
    assert module_circles(PACKAGE) == []


# The shells wrap `dynamo_ppd.routing`; only what starts or measures them may import them: the
# command line, the launcher's graphs (they name modules, import none), the benchmarks, and the
# shim that keeps `python -m dynamo_ppd.router` working.
SHELLS = ("dynamo_ppd.relay", "dynamo_ppd.picker")
SHELL_USERS = ("dynamo_ppd.cli", "dynamo_ppd.launch", "dynamo_ppd.bench", "dynamo_ppd.router")


def test_only_the_cli_the_graphs_and_the_benchmarks_import_a_shell():
    assert shell_imports(PACKAGE, SHELLS, SHELL_USERS) == []


def package_lines(root: Path) -> dict[str, int]:
    """Lines of source per top-level unit (`package_of`), subpackages counted with their parent."""
    lines: dict[str, int] = {}
    for path in root.rglob("*.py"):
        unit = package_of(module_name(root, path), root.name)
        lines[unit] = lines.get(unit, 0) + len(path.read_text().splitlines())
    return lines


def test_no_package_holds_more_than_a_fifth_of_the_code():
    lines = package_lines(PACKAGE)
    total = sum(lines.values())
    assert {unit: n for unit, n in lines.items() if n > 0.2 * total} == {}


def test_core_imports_no_io_or_server_library():
    assert core_io_imports(PACKAGE, LAYERS) == []


# -- the checker fails on a new violation -------------------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


TINY_LAYERS = {"pkg": CORE, "pkg.core": CORE, "pkg.edge": ADAPTER, "pkg.cli": CLI}


def test_checker_reports_an_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/model.py": "from ..edge import server\n",  # core -> adapter: the violation
        "edge/__init__.py": "",
        "edge/server.py": "from pkg.core import model\n",  # adapter -> core: fine
        "cli.py": "def main():\n    from .edge import server\n",  # cli -> adapter, lazily: fine
    })
    assert upward_imports(root, TINY_LAYERS) == [
        "pkg.core.model:1 (core) imports pkg.edge.server (adapter)"]


def test_checker_counts_lazy_imports_too(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "core.py": "def f():\n    import pkg.cli\n",
                            "cli.py": ""})
    assert upward_imports(root, TINY_LAYERS) == ["pkg.core:2 (core) imports pkg.cli (cli)"]


def test_checker_reports_a_package_cycle(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "", "core/a.py": "from pkg.edge.b import thing\n",
        "edge/__init__.py": "", "edge/b.py": "from ..core import a\n",
    })
    assert package_cycles(root) == [["pkg.core", "pkg.edge", "pkg.core"]]


def test_checker_reports_a_module_circle_even_through_a_deferred_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "from .b import thing\n",
        "core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import other\n",
        "core/c.py": "def f():\n    from .a import x\n",  # lazily: still a circle
        "core/d.py": "from .a import x\n",  # imports into the circle, not part of it
    })
    assert module_circles(root) == [["pkg.core.a", "pkg.core.b", "pkg.core.c"]]


def test_checker_reports_a_shell_imported_by_the_state_it_wraps(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "state/__init__.py": "", "state/table.py": "def f():\n    from pkg.shell.serve import x\n",
        "shell/__init__.py": "", "shell/serve.py": "from ..state import table\n",
        "cli.py": "from .shell import serve\n",
    })
    assert shell_imports(root, ("pkg.shell",), ("pkg.cli",)) == [
        "pkg.state.table:2 imports pkg.shell.serve"]


def test_checker_reports_io_in_core_at_module_level_only(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "import asyncio\n",
        "core/plot.py": "def save():\n    import matplotlib\n",  # on request: allowed
        "core/types.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import httpx\n",
        "edge/__init__.py": "import httpx\n",  # adapters may
    })
    assert core_io_imports(root, TINY_LAYERS) == ["pkg.core:1 imports asyncio"]
