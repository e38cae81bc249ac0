"""The package's shape: no import cycle anywhere in codeenv/, counting every import statement
(under TYPE_CHECKING and inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import codeenv

pytestmark = pytest.mark.unit

ROOT = Path(codeenv.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the codeenv modules its source imports (every import statement, at any depth)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    deps.add(full if full in paths else module)
        graph[name] = {d for d in deps if d in paths and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_codeenv() -> None:
    graph = import_graph()
    assert "codeenv.models" in graph and "codeenv.sandbox.pool" in graph
    assert cycles(graph) == []


def test_the_wire_schema_imports_nothing_of_the_server() -> None:
    graph = import_graph()
    assert graph["codeenv.models"] <= {"codeenv.errors"}
    reachable, todo = set(), ["codeenv.client"]
    while todo:
        module = todo.pop()
        if module not in reachable:
            reachable.add(module)
            todo.extend(graph[module])
    assert not {m for m in reachable if m.startswith(("codeenv.settings", "codeenv.sandbox", "codeenv.api",
                                                       "codeenv.queue", "codeenv.worker"))}


#: Exception classes that live outside errors.py on purpose: the client's own tree (it runs where the
#: server does not), the jail's program (standard library only), and the probe's start failure (its
#: move waits for the jail's own package).
OWN_TREES = ("codeenv.client", "codeenv.sandbox.zygote", "codeenv.sandbox.probe", "codeenv.api.pytest_driver")


def test_every_exception_is_in_the_one_tree() -> None:
    """codeenv's public exceptions are defined in errors.py (its docstring draws them), wherever they
    are raised; a module's private one (a signal between two of its functions) stays with it."""
    trees = {_module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in ROOT.rglob("*.py")}
    known = {"BaseException", "Exception", "ValueError", "RuntimeError", "OSError", "TypeError", "KeyError"}
    found: dict[str, str] = {}
    while True:  # to a fixed point: a subclass of a subclass is found on a later round
        before = len(found)
        for module, tree in trees.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in found and any(
                        (b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "")
                        in known for b in node.bases):
                    found[node.name] = module
                    known.add(node.name)
        if len(found) == before:
            break
    outside = sorted(f"{m}.{name}" for name, m in found.items()
                     if m != "codeenv.errors" and not m.startswith(OWN_TREES) and not name.startswith("_"))
    assert outside == []


def test_the_http_layer_speaks_only_to_the_queue() -> None:
    """codeenv/api/ imports nothing of the engine (codeenv/sandbox/): sessions, profiles and refusals
    reach it through the queue's interface (queue/base.py) and the wire schema."""
    graph = import_graph()
    reached = {module: sorted(d for d in deps if d.startswith("codeenv.sandbox"))
               for module, deps in graph.items() if module.startswith("codeenv.api")}
    assert "codeenv.api.app" in reached
    assert {m: d for m, d in reached.items() if d} == {}
