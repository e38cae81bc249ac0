# ruff: noqa: E501  (the programs are data)
"""The reference a judged verdict must equal: each test run alone in a fresh interpreter, the way
SandboxFusion and verl score a submission (one ``python -c`` per test), here in a fresh nsjail per test
(codeenv's `naive-jail` baseline: the slot's jail without the zygote), compared outside as the judge
compares.

The private cases are function-call and stdin submissions whose verdicts a shared, prepared process
could get wrong: state the top-level code leaves (globals, shared memory, pipes, files, threads,
children), exceptions on some inputs, exits, classes. Their verdicts are not written down: they are
whatever the reference gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from codeenv.bench.baseline import BaselineQueue
from codeenv.compare import same_output, same_value
from codeenv.models import Compare, ExecRequest, ExecResult, Limits

#: A function-call test alone: the submission, then one call of the function with the test's arguments,
#: its value printed as JSON on a line of its own after a marker (what the program printed comes first).
CALL_ALONE = """
{code}

import json as _json, sys as _sys
_args = _json.loads({args!r})
_Solution = globals().get("Solution")
if isinstance(_Solution, type) and hasattr(_Solution, {fn!r}):
    _value = getattr(_Solution(), {fn!r})(*_args)
else:
    _value = globals()[{fn!r}](*_args)
_sys.stdout.flush()
print("\\n@@value@@" + _json.dumps(_value))
"""


@dataclass(frozen=True)
class Submission:
    name: str
    code: str
    tests: list[dict[str, Any]]
    fn_name: str | None = None
    cpu_s: float = 2.0


def reference_verdict(result: ExecResult, test: dict[str, Any], fn_name: str | None, compare: Compare,
                      tol: float) -> str:
    """A test's status from one fresh run: passed, wrong_answer, error or timeout."""
    if result.status == "timeout":
        return "timeout"
    if result.status != "ok":
        return "error"
    if fn_name is None:
        return "passed" if same_output(result.stdout, test["expected_stdout"], compare, tol) else "wrong_answer"
    _, marker, value = result.stdout.rpartition("@@value@@")
    if not marker:
        return "error"
    try:
        ok = same_value(json.loads(value), test["expected"], tol)
    except (ValueError, OverflowError, RecursionError):
        ok = False
    return "passed" if ok else "wrong_answer"


async def run_alone(queue: BaselineQueue, sub: Submission, compare: Compare = Compare.lines,
                    tol: float = 1e-6) -> list[str]:
    """Each test of `sub` in a fresh jail and interpreter: its reference status."""
    requests = []
    for test in sub.tests:
        if sub.fn_name is None:
            code, stdin = sub.code, test["stdin"]
        else:
            code, stdin = CALL_ALONE.format(code=sub.code, args=json.dumps(test["args"]), fn=sub.fn_name), ""
        # The interpreter's start-up is counted in a fresh run's wall clock, not in the judge's CPU limit.
        requests.append(ExecRequest(code=code, stdin=stdin, limits=Limits(wall_s=sub.cpu_s + 1.5)))
    results = await queue.submit(requests)
    return [reference_verdict(r, t, sub.fn_name, compare, tol) for r, t in zip(results, sub.tests, strict=True)]


def _fn(*pairs: tuple[Any, Any]) -> list[dict[str, Any]]:
    return [{"args": list(a) if isinstance(a, tuple) else [a], "expected": e} for a, e in pairs]


ONE_EACH = _fn(*[(n, 1) for n in range(6)])

PRIVATE: list[Submission] = [
    Submission("a global counter", "calls = []\ndef f(n):\n    calls.append(n)\n    return len(calls)", ONE_EACH, "f"),
    Submission("top-level shared memory", "import mmap\nM = mmap.mmap(-1, 8)\ndef f(n):\n    M[0] += 1\n    return M[0]",
               ONE_EACH, "f"),
    Submission("multiprocessing's shared Value", "from multiprocessing import Value\nV = Value('i', 0)\n"
               "def f(n):\n    V.value += 1\n    return V.value", ONE_EACH, "f"),
    Submission("a top-level pipe", "import os\nR, W = os.pipe()\nos.set_blocking(R, False)\ndef f(n):\n"
               "    os.write(W, b'x')\n    return len(os.read(R, 100))", ONE_EACH, "f"),
    Submission("a top-level file read in parts", "F = open('/etc/passwd', 'rb')\ndef f(n):\n    return len(F.read(4)) // 4",
               ONE_EACH, "f"),
    Submission("a file written at top level", "open('state', 'w').write('0')\ndef f(n):\n"
               "    k = int(open('state').read()) + 1\n    open('state', 'w').write(str(k))\n    return k", ONE_EACH, "f"),
    Submission("a thread started at top level", "import threading, time\nN = [0]\n"
               "def spin():\n    while True:\n        N[0] += 1\n        time.sleep(0.001)\n"
               "threading.Thread(target=spin, daemon=True).start()\ndef f(n):\n    return 1", ONE_EACH, "f"),
    Submission("a child forked at top level", "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\n"
               "def f(n):\n    return 1", ONE_EACH, "f"),
    Submission("raises on odd inputs", "def f(n):\n    if n % 2:\n        raise ValueError(n)\n    return 1", ONE_EACH, "f"),
    Submission("exits on some inputs", "import sys\ndef f(n):\n    if n == 3:\n        sys.exit(0)\n    if n == 4:\n"
               "        sys.exit(2)\n    return 1", ONE_EACH, "f"),
    Submission("a Solution class with state", "class Solution:\n    seen = []\n    def f(self, n):\n"
               "        self.seen.append(n)\n        return len(self.seen)", ONE_EACH, "f"),
    Submission("float answers", "def half(n):\n    return n / 2 + (1e-9 if n == 2 else 1e-3 if n == 4 else 0)",
               _fn((1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0), (10**400, 0.5)), "half"),
    Submission("stdin: state in a module-level cache", "import functools\n@functools.cache\ndef fib(n):\n"
               "    return n if n < 2 else fib(n - 1) + fib(n - 2)\nprint(fib(int(input())))",
               [{"stdin": str(n), "expected_stdout": str(v)} for n, v in ((10, 55), (20, 6765), (30, 832040), (5, 6))]),
    Submission("stdin: reads past its input", "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
               [{"stdin": "1 2\n3", "expected_stdout": "6"}, {"stdin": "", "expected_stdout": "0"}]),
    Submission("stdin: a time-out on one test", "n = int(input())\nwhile n == 7:\n    pass\nprint(n)",
               [{"stdin": str(n), "expected_stdout": str(n)} for n in (1, 7, 3)], cpu_s=0.5),
]
