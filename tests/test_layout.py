"""The package's shape: no import cycle anywhere in codeenv/, counting every import statement
(under TYPE_CHECKING and inside functions too)."""

from __future__ import annotations

import ast
import sys
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
OWN_TREES = ("codeenv.client", "codeenv.sandbox.inside", "codeenv.sandbox.probe", "codeenv.api.pytest_driver")


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


# --- the jail's package and the worker's end of it ----------------------------------------------

INSIDE = "codeenv.sandbox.inside"
OUTSIDE = "codeenv.sandbox.outside"
PROTOCOL = f"{INSIDE}.protocol"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import statement in `path` (at any depth); "from . import x" is (1, "x")."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.extend((0, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                found.append((node.level, node.module))
            else:
                found.extend((node.level, alias.name) for alias in node.names)
    return found


def _package_files(dotted: str) -> list[Path]:
    return sorted((ROOT.parent / dotted.replace(".", "/")).glob("*.py"))


def test_inside_imports_only_the_standard_library_and_itself() -> None:
    """It runs in the jail under the image's interpreter, copied there as a directory alone."""
    files = _package_files(INSIDE)
    assert {p.name for p in files} >= {"__init__.py", "protocol.py", "proc.py", "child.py", "workdir.py"}
    foreign = []
    for path in files:
        for level, module in _imports(path):
            if level > 1 or (level == 0 and module.split(".")[0] not in sys.stdlib_module_names):
                foreign.append(f"{path.name}: {'.' * level}{module}")
    assert foreign == []


def test_inside_never_imports_typing_at_run_time() -> None:
    """A child must find the modules a fresh interpreter has (plus the preloads): annotations only."""
    for path in _package_files(INSIDE):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level: a guarded import sits under `if TYPE_CHECKING:`
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert "typing" not in names, path.name


def test_outside_takes_only_the_protocol_from_inside() -> None:
    graph = import_graph()
    for module, deps in graph.items():
        if module.startswith(OUTSIDE):
            assert {d for d in deps if d.startswith(INSIDE)} <= {PROTOCOL}, module
    # and nothing but the pool (which copies it into the jails) reaches past the protocol
    users = {m for m, deps in graph.items() if any(d.startswith(INSIDE) and d != PROTOCOL for d in deps)}
    assert {m for m in users if not m.startswith(INSIDE)} <= {"codeenv.sandbox.pool"}


def _speakers() -> list[Path]:
    """Modules that speak the jail's protocol: inside/, outside/, and whatever imports the protocol."""
    graph = import_graph()
    names = {m for m, deps in graph.items() if m.startswith((INSIDE, OUTSIDE)) or PROTOCOL in deps}
    names.discard(PROTOCOL)
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return sorted(paths[m] for m in names)


def test_op_names_are_written_only_in_the_protocol_module() -> None:
    """A message's op is named by its channel's constant (protocol.Ctl, Judge, Family, Session, Cell),
    never by a string literal: a literal equal to an op name anywhere else fails."""
    from codeenv.sandbox.inside.protocol import OPS

    speakers = _speakers()
    assert {p.name for p in speakers} >= {"calls.py", "sessions.py", "families.py", "process.py"}
    literals = []
    for path in speakers:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in OPS:
                literals.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}")
    assert literals == []


def _fd_literals(tree: ast.AST) -> list[int]:
    """Lines that pick a message's fd by a number (`fds[6]`, past the first) or count its fds by one
    (`len(fds) == 7`) instead of naming the position (protocol.CallFd, CellFd, ONE_FD)."""
    def is_fds(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.endswith("fds")

    def is_number(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_fds(node.value):
            index = node.slice
            past_first = isinstance(index, ast.Constant) and type(index.value) is int and index.value != 0
            if past_first or (isinstance(index, ast.Slice)
                              and any(is_number(b) for b in (index.lower, index.upper) if b)):
                found.append(node.lineno)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and node.left.args \
                and isinstance(node.left.func, ast.Name) and node.left.func.id == "len" and is_fds(node.left.args[0]) \
                and any(is_number(c) for c in node.comparators):
            found.append(node.lineno)
    return found


def test_fd_positions_are_named_only_in_the_protocol_module() -> None:
    literals = []
    for path in _speakers():
        literals += [f"{path.relative_to(ROOT.parent)}:{line}" for line in
                     _fd_literals(ast.parse(path.read_text(encoding="utf-8")))]
    assert literals == []
    assert _fd_literals(ast.parse("x = fds[6]\nif len(msg_fds) != 7: pass\ny = call.fds[:6]\nz = fds[0]")) == [1, 2, 3]


def test_the_op_finder_finds_op_literals(tmp_path: Path) -> None:
    from codeenv.sandbox.inside.protocol import OPS

    assert {"exited", "ready", "cell_done", "prepared", "reaped", "started"} <= OPS
    probe = tmp_path / "probe.py"
    probe.write_text('send({"op": "exited"})\n')
    assert [n.value for n in ast.walk(ast.parse(probe.read_text())) if isinstance(n, ast.Constant)] == ["op", "exited"]


# --- sizes: a module past ~800 lines is two concepts; a function past ~90 is several steps ---------

MODULE_LINES_MAX = 800
FUNCTION_LINES_MAX = 90


def test_no_engine_module_or_function_is_too_long() -> None:
    long = []
    for path in sorted((ROOT / "sandbox").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > MODULE_LINES_MAX:
            long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > FUNCTION_LINES_MAX:
                    long.append(f"{path.name}: {node.name} has {size} lines")
    assert long == []
