"""Runs a submitted file under pytest inside the jail and writes a tally of what pytest saw.

This file is not imported by the service: its source is the program of a SandboxFusion ``pytest``
call, followed by one line that calls `run` with the call's parameters. It runs in the jail under the
image's interpreter, so it imports the standard library and pytest only.

The submitted file runs the way SandboxFusion runs it (``pytest FILE *args`` in the work dir, the
file named like a NamedTemporaryFile). The tally goes to a file the gateway fetches and judges, never
to stdout, so nothing the program prints can pass for it; the gateway's verdict needs the tally and
refuses what pytest's exit code alone would accept:

- no tally at all: the program ended the process before pytest finished (``os._exit(0)`` at import);
- a test function of the file's source that was never collected (deleted or replaced by the time
  pytest collected the module), or whose code is not the code written at its ``def`` (rewritten at
  import or while other tests ran);
- a pytest plugin registered by the file (hooks can rewrite reports);
- zero tests, or any test that failed, errored, was skipped or xfailed.

The tally's path and token (the call's secret) arrive after the caller's stdin and are read only by
the driver's first process, after it forked the process that runs pytest, which never holds them;
that process sends its record over a pipe on its own way out, and the tally is written once it has
exited. This raises the bar; it does not make the reward unforgeable: the submitted file shares the
pytest process, so a file written against this very driver can forge its record, and a test of an
object whose __eq__ is always true passes. A reward that must hold against the program it judges
compares expected outputs outside the jail (/v1/judge).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
from types import CodeType
from typing import Any

#: A test function as the source names it: (its class, or None at module level; its name).
Key = tuple[str | None, str]


def _static_tests(path: str) -> dict[Key, set[int]] | None:
    """(class or None, name) -> set of line numbers of every test function a default pytest run
    collects from the file's source, or None if the source does not parse (pytest reports that)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (SyntaxError, ValueError, OSError):
        return None
    tests: dict[Key, set[int]] = {}

    def add(owner: str | None, node: ast.stmt) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            # A later def of the same name replaces the earlier one, as it does in the module.
            tests[(owner, node.name)] = {node.lineno, *(d.lineno for d in node.decorator_list)}

    for node in tree.body:
        add(None, node)
        if isinstance(node, ast.ClassDef):
            unit = any((isinstance(b, ast.Name) and b.id == "TestCase")
                       or (isinstance(b, ast.Attribute) and b.attr == "TestCase") for b in node.bases)
            # A Test class with __init__ counts too: pytest skips it with a warning, so its tests never ran.
            if unit or node.name.startswith("Test"):
                for member in node.body:
                    add(node.name, member)
    return tests


def _code_of(item: Any) -> CodeType | None:
    function = getattr(item, "obj", None)
    function = getattr(function, "__func__", function)
    try:
        function = inspect.unwrap(function) if function is not None else None
    except ValueError:
        return None
    code = getattr(function, "__code__", None)
    return code if isinstance(code, CodeType) else None


class _Tally:
    def __init__(self, path: str) -> None:
        self.path = os.path.realpath(path)
        self.counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "xfailed": 0, "xpassed": 0}
        self.items: list[Any] = []
        self.seen: set[Key] = set()
        self.codes: list[tuple[Any, CodeType | None]] = []
        self.exit_status: int | None = None
        self.plugins_at_start: set[int] = set()
        self.foreign_plugins: list[str] = []

    def pytest_sessionstart(self, session: Any) -> None:
        self.plugins_at_start = {id(p) for p in session.config.pluginmanager.get_plugins()}

    def _ours(self, item: Any) -> bool:
        return os.path.realpath(str(getattr(item, "path", ""))) == self.path

    def _note(self, items: list[Any]) -> None:
        for item in items:
            if self._ours(item):
                cls = getattr(item, "cls", None)
                name = getattr(item, "originalname", None) or item.name.split("[")[0]
                self.seen.add((cls.__name__ if cls is not None else None, name))

    def pytest_deselected(self, items: list[Any]) -> None:
        self._note(items)

    def pytest_collection_finish(self, session: Any) -> None:
        self.items = list(session.items)
        self._note(self.items)
        self.codes = [(item, _code_of(item)) for item in self.items if self._ours(item)]

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.counts["error"] += 1

    def pytest_runtest_logreport(self, report: Any) -> None:
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if report.passed:
                self.counts["xpassed" if xfail else "passed"] += 1
            elif report.skipped:
                self.counts["xfailed" if xfail else "skipped"] += 1
            else:
                self.counts["failed"] += 1
        elif report.failed:
            self.counts["error"] += 1
        elif report.skipped:
            self.counts["xfailed" if xfail else "skipped"] += 1

    def pytest_sessionfinish(self, session: Any, exitstatus: int) -> None:
        self.exit_status = int(exitstatus)
        # Hooks can rewrite reports: a plugin registered by the tested file (its `pytest_plugins`, or a
        # register() call while it ran) is refused; pytest's own objects and conftest files are not.
        manager = session.config.pluginmanager
        for plugin in manager.get_plugins():
            if id(plugin) in self.plugins_at_start:
                continue
            if type(plugin).__module__.startswith("_pytest."):
                continue
            if os.path.basename(str(getattr(plugin, "__file__", None) or "")) == "conftest.py":
                continue
            self.foreign_plugins.append(str(manager.get_name(plugin)))


#: Bytes at the end of stdin that hold the call's secret (where the tally goes, and its token): the
#: gateway appends them to the caller's stdin; only this driver's first process ever reads them.
SECRET_BYTES = 128


def _pytest(params: dict[str, Any], report_fd: int) -> None:
    """The process that runs pytest (and with it the submitted file): it never holds the secret. Its
    record goes to `report_fd` on its own way out, after pytest returned; it exits with pytest's code."""
    target = params["file"]
    static = _static_tests(target)
    import pytest

    tally = _Tally(target)
    exit_code = int(pytest.main([target, *params["args"]], plugins=[tally]))
    # Checked after the run: a test that rewrote another test's code while it ran shows here.
    rewritten = [item.nodeid for item, code in tally.codes if code is None or _code_of(item) is not code]
    missing: list[str] = []
    if static is not None:
        missing = ["::".join(p for p in key if p) for key in static if key not in tally.seen]
        for item, code in tally.codes:
            cls = getattr(item, "cls", None)
            key = (cls.__name__ if cls is not None else None, getattr(item, "originalname", None) or item.name)
            lines = static.get(key)
            if code is None or (lines is not None and (os.path.realpath(code.co_filename) != tally.path
                                                       or code.co_firstlineno not in lines)):
                rewritten.append(item.nodeid)
    record = {"exit_status": tally.exit_status, "counts": tally.counts, "collected": len(tally.items),
              "missing": sorted(missing), "rewritten": sorted(set(rewritten)), "plugins": sorted(tally.foreign_plugins)}
    data = json.dumps(record).encode()
    while data:
        data = data[os.write(report_fd, data):]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _caller_stdin(size: int) -> int:
    """A memfd with stdin's first `size` bytes (the caller's own), read without the secret after them."""
    fd = os.memfd_create("stdin")
    offset = 0
    while offset < size:
        chunk = os.pread(0, min(size - offset, 1 << 20), offset)
        if not chunk:
            break
        os.write(fd, chunk)
        offset += len(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run(text: str) -> None:
    """Run pytest on the submitted file in a child process; write the tally; exit with its exit code.

    The secret is read only here, after the fork, by a process no user code runs in (like every
    call's process it is non-dumpable, so its child cannot read its memory); the tally is written
    only after the child's own record arrived and the child exited."""
    params = json.loads(text)
    size = os.fstat(0).st_size - SECRET_BYTES
    ours, theirs = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ours)
            stdin = _caller_stdin(size)
            os.dup2(stdin, 0)
            os.close(stdin)
            _pytest(params, theirs)
        finally:
            os._exit(70)
    os.close(theirs)
    chunks: list[bytes] = []
    while chunk := os.read(ours, 1 << 16):
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    secret = json.loads(os.pread(0, SECRET_BYTES, size))
    try:
        record = json.loads(b"".join(chunks)) if chunks else None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {}
    record.update(token=secret["token"], child_exit=code, reported=bool(chunks))
    with open(secret["tally"], "w") as f:
        json.dump(record, f)
    os._exit(code if code >= 0 else 1)
