"""The code-judge and SandboxFusion endpoints, called the way their real clients call them."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from sandbox_fusion import RunCodeRequest, SummaryMapping, run_code, summary_run_code_result

from codeenv import SlotPool
from codeenv.settings import GatewaySettings
from tests.conftest import GatewayClient, pool_app, serving

pytestmark = pytest.mark.jail

SETTINGS = GatewaySettings(slots=2, code_judge_wall_s=1, code_judge_queue_wait_s=20)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pool: SlotPool) -> AsyncIterator[str]:
    """A real uvicorn server on the session's pool (sync clients call it from threads)."""
    async with serving(pool_app(pool, SETTINGS)) as url:
        yield url


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- SandboxFusion, through the sandbox-fusion package ----------------------------------------


async def fusion(server: str, **fields: Any) -> Any:
    return await asyncio.to_thread(run_code, RunCodeRequest(language="python", **fields), endpoint=server,
                                   max_attempts=1)


async def test_sandbox_fusion_client_success_error_timeout_stdin(server: str) -> None:
    ok = await fusion(server, code="print(1 + 1)")
    assert (ok.status, ok.run_result.status, ok.run_result.return_code, ok.run_result.stdout) == (
        "Success", "Finished", 0, "2\n")
    failed = await fusion(server, code="1 / 0")
    assert (failed.status, failed.run_result.status, failed.run_result.return_code) == ("Failed", "Finished", 1)
    assert "ZeroDivisionError" in failed.run_result.stderr
    slow = await fusion(server, code="while True: pass", run_timeout=1)
    assert (slow.status, slow.run_result.status, slow.run_result.return_code) == ("Failed", "TimeLimitExceeded", None)
    echo = await fusion(server, code="print(input()[::-1])", stdin="abc\n")
    assert echo.run_result.stdout == "cba\n"
    killed = await fusion(server, code="import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert killed.status == "Failed" and killed.run_result.return_code == -15


async def test_sandbox_fusion_client_files_in_and_out(server: str) -> None:
    resp = await fusion(server, code="data = open('in/data.txt').read()\nopen('out.txt', 'w').write(data.upper())",
                        files={"in/data.txt": b64(b"hello files")}, fetch_files=["out.txt", "missing.txt"])
    assert resp.status == "Success"
    assert base64.b64decode(resp.files["out.txt"]) == b"HELLO FILES"
    assert "missing.txt" not in resp.files and "could not fetch missing.txt" in resp.message


async def test_sandbox_fusion_as_verl_sends_it(server: str) -> None:
    payload = {"compile_timeout": 10, "run_timeout": 500, "code": "import sys\nprint(sys.stdin.read())",
               "stdin": "None", "memory_limit_MB": 1024, "language": "python", "files": {}, "fetch_files": [],
               "some_future_field": True}
    async with httpx.AsyncClient(base_url=server, timeout=30) as c:
        r = await c.post("/run_code", json=payload)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "Success" and body["run_result"]["stdout"] == "None\n"
        assert "run_timeout 500s clamped to the server's cap of 120s" in body["message"]
        assert (await c.post("/run_code", json={"code": "print(3)"})).json()["run_result"]["stdout"] == "3\n"
        go = (await c.post("/run_code", json={"code": "package main", "language": "go"})).json()
        assert go["status"] == "Failed" and "only python, pytest and cpp run here" in go["message"]
        assert (await c.get("/v1/ping")).json() == "pong"
        for bad in ({"code": 1}, {"code": "1", "fetch_files": ["../x"]}, {"code": "1", "files": {"/etc/x": ""}}):
            r = await c.post("/run_code", json=bad)
            assert r.status_code == 422, r.text


async def test_sandbox_fusion_client_unsupported_language_is_not_retried(server: str) -> None:
    """The package's client retries a SandboxError and any non-200 answer with backoff (5 attempts,
    ~17 s): an unsupported language must come back at once, as a failure that says why."""
    start = time.monotonic()
    resp = await asyncio.to_thread(run_code, RunCodeRequest(language="rust", code="fn main() {}"),
                                   endpoint=server)  # the client's own retry policy: max_attempts=5
    elapsed = time.monotonic() - start
    assert resp.status == "Failed" and "language 'rust' is not supported" in resp.message, resp
    assert resp.compile_result is None and resp.run_result is None
    assert summary_run_code_result(resp, SummaryMapping()) == SummaryMapping().Failed
    assert elapsed < 1.0, f"the client took {elapsed:.1f}s: it retried (its first retry waits 1-2 s)"


async def test_sandbox_fusion_fetch_refusals(server: str) -> None:
    code = ("import os\nos.symlink('/proc/1/environ', 'env')\nos.mkfifo('fifo')\nos.symlink('/dev/zero', 'zero')\n"
            "open('sparse', 'wb').truncate(48 << 20)\nprint('made')")
    resp = await fusion(server, code=code, fetch_files=["env", "fifo", "zero", "sparse"])
    assert resp.status == "Success" and resp.files == {}
    for path in ("env", "fifo", "zero", "sparse"):
        assert f"could not fetch {path}:" in resp.message


async def test_sandbox_fusion_overload_is_504(gateway: GatewayClient) -> None:
    async with gateway(max_queued=1) as c:
        replies = await asyncio.gather(*(c.post("/run_code", json={"code": "import time; time.sleep(0.3)",
                                                                  "language": "python"}) for _ in range(6)))
    codes = Counter(r.status_code for r in replies)
    assert codes[200] == 3 and codes[504] == 3, codes


# --- SandboxFusion's `pytest` language ------------------------------------------------------------

#: What ROLL's KodCode reward puts in front of the model's solution (its SOLUTION_IMPORTS, abridged to
#: the shape that matters: star imports and a raised recursion limit), then the dataset's tests.
ROLL_PREFIX = ("from string import *\nfrom re import *\nfrom collections import *\nfrom math import *\n"
               "from itertools import *\nfrom functools import *\nfrom typing import *\nfrom sys import *\n"
               "import sys\nimport math\nsys.setrecursionlimit(6*10**5)\nfrom typing import List, Dict, Any\n")
KODCODE_TESTS = """
def test_two_sum_found():
    assert two_sum([2, 7, 11, 15], 9) == [0, 1]

def test_two_sum_later_pair():
    assert two_sum([3, 2, 4], 6) == [1, 2]

def test_two_sum_none():
    assert two_sum([1, 2], 7) == []
"""
RIGHT = """
def two_sum(nums, target):
    seen = {}
    for i, n in enumerate(nums):
        if target - n in seen:
            return [seen[target - n], i]
        seen[n] = i
    return []
"""
WRONG = """
def two_sum(nums, target):
    return [0, 1]
"""


async def pytest_call(server: str, code: str, **fields: Any) -> Any:
    return await asyncio.to_thread(run_code, RunCodeRequest(language="pytest", code=code, **fields),
                                   endpoint=server, max_attempts=1)


async def test_pytest_runs_the_tests(server: str) -> None:
    passing = await pytest_call(server, "def test_a():\n    assert 1 + 1 == 2\n\ndef test_b():\n    pass\n")
    assert (passing.status, passing.run_result.return_code) == ("Success", 0), passing
    assert "2 passed" in passing.run_result.stdout and passing.files == {}
    failing = await pytest_call(server, "def test_a():\n    assert 1 + 1 == 3\n")
    assert (failing.status, failing.run_result.return_code) == ("Failed", 1), failing
    assert "assert (1 + 1) == 3" in failing.run_result.stdout and "1 failed" in failing.run_result.stdout
    # The file is named and placed as SandboxFusion names it: tmpXXXXXXXX.py in the work dir.
    assert re.search(r"\btmp[a-z0-9_]{8}\.py F", failing.run_result.stdout), failing.run_result.stdout


async def test_pytest_without_a_passing_test_is_no_success(server: str) -> None:
    none = await pytest_call(server, "def helper():\n    pass\n")
    assert (none.status, none.run_result.return_code) == ("Failed", 5), none
    assert "no tests ran" in none.run_result.stdout
    syntax = await pytest_call(server, "def test_a(:\n    pass\n")
    assert syntax.status == "Failed" and syntax.run_result.return_code == 2, syntax
    assert "SyntaxError" in syntax.run_result.stdout and "ERROR collecting" in syntax.run_result.stdout
    slow = await pytest_call(server, "import time\n\ndef test_slow():\n    time.sleep(30)\n", run_timeout=2)
    assert (slow.status, slow.run_result.status, slow.run_result.return_code) == (
        "Failed", "TimeLimitExceeded", None), slow


HOSTILE_PYTEST = {
    "exit at import": "import os\nos._exit(0)\n\ndef test_a():\n    assert False\n",
    "fake summary then exit": ("import os, sys\nprint('=== 3 passed in 0.01s ===')\nsys.stdout.flush()\n"
                               "os._exit(0)\n\ndef test_a():\n    assert False\n"),
    "sys.exit at import": "import sys\nsys.exit(0)\n\ndef test_a():\n    assert False\n",
    "deletes its tests": "def test_a():\n    assert False\n\ndef test_b():\n    pass\n\ndel test_a\n",
    "rewrites a test at import": "def test_a():\n    assert False\n\ndef test_b():\n    pass\n\n"
                                 "test_a = lambda: None\n",
    "swaps a test's code while running": (
        "def test_a():\n    import sys\n    sys.modules[__name__].test_b.__code__ = (lambda: None).__code__\n\n"
        "def test_b():\n    assert False\n"),
    "skips the hard case": "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    pytest.skip('hard')\n",
    "marks everything xfail": "import pytest\npytestmark = pytest.mark.xfail\n\ndef test_a():\n    pass\n\n"
                              "def test_b():\n    assert False\n",
    "registers a plugin that passes every report": (
        "import sys, types, pytest\nplug = types.ModuleType('plug')\n\n@pytest.hookimpl(wrapper=True)\n"
        "def pytest_runtest_makereport(item, call):\n    report = yield\n    report.outcome = 'passed'\n"
        "    return report\n\nplug.pytest_runtest_makereport = pytest_runtest_makereport\n"
        "sys.modules['plug'] = plug\npytest_plugins = ['plug']\n\ndef test_a():\n    assert False\n"),
    "builds later test classes itself": (
        "import builtins\n_build = builtins.__build_class__\n\ndef build(func, name, *bases, **kw):\n"
        "    cls = _build(func, name, *bases, **kw)\n    if name.startswith('Test'):\n"
        "        cls.__init__ = lambda self: None\n    return cls\n\nbuiltins.__build_class__ = build\n\n"
        "def test_a():\n    pass\n\nclass TestHard:\n    def test_b(self):\n        assert False\n"),
    "hides tests in a class with __init__": ("def test_a():\n    pass\n\nclass TestHard:\n    def __init__(self):\n"
                                             "        pass\n\n    def test_b(self):\n        assert False\n"),
}


@pytest.mark.parametrize("name", HOSTILE_PYTEST)
async def test_pytest_hostile_files_are_no_success(server: str, name: str) -> None:
    resp = await pytest_call(server, HOSTILE_PYTEST[name])
    assert resp.status == "Failed", (name, resp)
    assert resp.message or resp.run_result.return_code != 0, resp


async def test_pytest_kodcode_as_roll_sends_it(server: str) -> None:
    """ROLL's CodeTester posts prefix + solution + "\n" + tests with language "pytest" and extra keys;
    it rewards status == "Success" (expected_stdout is "")."""
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        async def roll(solution: str) -> dict[str, Any]:
            body = {"compile_timeout": 30, "run_timeout": 30, "code": ROLL_PREFIX + solution + "\n" + KODCODE_TESTS,
                    "language": "pytest", "stdin": "", "expected_stdout": ""}
            r = await c.post("/run_code", json=body, headers={"Accept": "application/json"})
            assert r.status_code == 200, r.text
            return dict(r.json())
        right, wrong = await asyncio.gather(roll(RIGHT), roll(WRONG))
    assert (right["status"], right["run_result"]["return_code"]) == ("Success", 0), right
    assert "3 passed" in right["run_result"]["stdout"]
    assert (wrong["status"], wrong["run_result"]["return_code"]) == ("Failed", 1), wrong
    assert "2 failed, 1 passed" in wrong["run_result"]["stdout"]


async def test_pytest_args_files_and_refusals(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        code = ("from helper import answer\n\ndef test_answer():\n    assert answer() == 42\n\n"
                "def test_other():\n    pass\n")
        body = {"code": code, "language": "pytest", "args": ["-k", "answer"],
                "files": {"helper.py": b64(b"def answer():\n    return 42\n"), "absent.txt": None,
                          "IGNORE_THIS_FILE.txt": b64(b"x")}}
        selected = (await c.post("/run_code", json=body)).json()
        assert selected["status"] == "Success", selected
        assert "1 passed, 1 deselected" in selected["run_result"]["stdout"]
        listing = (await c.post("/run_code", json={"code": "import os\nprint(sorted(os.listdir('.')))",
                                                   "files": {"absent.txt": None, "a.txt": b64(b"a"),
                                                             "IGNORE_THIS_FILE.txt": b64(b"x")}})).json()
        assert listing["run_result"]["stdout"] == "['a.txt']\n", listing
        ignored = await c.post("/run_code", json={"code": "print(1)", "language": "python", "args": ["-x"]})
        assert ignored.json()["status"] == "Success" and "args ignored" in ignored.json()["message"]
        big = await c.post("/run_code", json={"code": "#" * ((1 << 20) + 1), "language": "pytest"})
        assert big.status_code == 422 and "the limit is" in big.text


# --- code-judge, as rStar2-Agent's tool calls it ------------------------------------------------


async def long_batch(c: httpx.AsyncClient, codes: list[str], max_retries: int = 4) -> list[dict[str, Any]]:
    """rStar2-Agent's call_long_batch: re-send only the items answered queue_timeout."""
    results: list[dict[str, Any] | None] = [None] * len(codes)
    todo = list(range(len(codes)))
    for _ in range(max_retries):
        body = {"type": "batch", "submissions": [{"type": "python", "solution": codes[i], "input": None}
                                                 for i in todo]}
        r = await c.post("/run/long-batch", json=body)
        r.raise_for_status()
        again = []
        for i, res in zip(todo, r.json()["results"], strict=True):
            if res["reason"] == "queue_timeout":
                again.append(i)
            else:
                results[i] = res
        if not again:
            break
        todo = again
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


@pytest.mark.slow
async def test_a_thousand_calls_as_rstar2_agent_sends_them(server: str, pool: SlotPool) -> None:
    codes = []
    for i in range(1000):
        if i % 50 == 7:
            codes.append("while True: pass")
        elif i % 10 == 3:
            codes.append(f"raise ValueError({i})")
        else:
            codes.append(f"import math\nprint(math.factorial({i % 20}))")
    before = pool.calls_started
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        async def chunk(start: int) -> list[dict[str, Any]]:
            return await long_batch(c, codes[start:start + 32])

        parts = await asyncio.gather(*(chunk(s) for s in range(0, 1000, 32)))
    results = [r for part in parts for r in part]
    assert pool.calls_started - before == 1000  # each ran once
    import math

    for i, (code, res) in enumerate(zip(codes, results, strict=True)):
        assert set(res) == {"sub_id", "success", "run_success", "cost", "stdout", "stderr", "reason"}
        if "while True" in code:
            assert (res["run_success"], res["reason"]) == (False, "worker_timeout"), res
        elif "raise" in code:
            assert (res["run_success"], res["reason"]) == (False, "") and "ValueError" in res["stderr"], res
        else:
            assert res["run_success"] and res["success"] and res["stdout"] == f"{math.factorial(i % 20)}\n", res


async def test_code_judge_judge_and_single_endpoints(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=30) as c:
        r = (await c.post("/run", json={"type": "python", "solution": "print(input())", "input": "hi",
                                        "sub_id": "s1"})).json()
        assert (r["sub_id"], r["success"], r["run_success"], r["stdout"], r["reason"]) == ("s1", True, True, "hi\n", "")
        right, wrong = (await c.post("/judge/batch", json={"type": "batch", "sub_id": "b", "submissions": [
            {"type": "python", "solution": "print(6 * 7)", "expected_output": "42\n\n"},
            {"type": "python", "solution": "print(6 * 9)", "expected_output": "42"}]})).json()["results"]
        assert right["success"] and right["run_success"] and "stdout" not in right
        assert not wrong["success"] and wrong["run_success"] and wrong["reason"] == ""
        go = (await c.post("/run", json={"type": "go", "solution": "package main"})).json()
        assert go["reason"] == "invalid_input" and not go["run_success"] and "only 'python' and 'cpp'" in go["stderr"]
        assert (await c.post("/run/batch", json={"type": "batch", "submissions": []})).status_code == 422
        cobol = (await c.post("/run", json={"type": "cobol", "solution": "x"})).json()
        assert cobol["reason"] == "invalid_input" and "type 'cobol' is not supported" in cobol["stderr"]
        assert (await c.post("/run", json={"type": 1, "solution": "x"})).status_code == 422
        # One item in a language that does not run here is answered alone; the others run.
        batch = (await c.post("/run/batch", json={"type": "batch", "submissions": [
            {"type": "python", "solution": "print(1)", "expected_output": "1"},
            {"type": "javascript", "solution": "console.log(2)"},
            {"type": "python", "solution": "print(3)"}]}))
        assert batch.status_code == 200, batch.text
        first, js, third = batch.json()["results"]
        assert first["success"] and third["run_success"] and third["stdout"] == "3\n"
        assert (js["run_success"], js["reason"]) == (False, "invalid_input") and "'javascript'" in js["stderr"]
        bad = b'{"type": "python", "solution": "print(1)", "sub_id": "\\ud800"}'
        assert (await c.post("/run", content=bad, headers={"content-type": "application/json"})).status_code == 422
        bad = b'{"type": "python", "solution": "print(\\"\\ud800\\")"}'
        r = (await c.post("/run", content=bad, headers={"content-type": "application/json"})).json()
        assert r["reason"] == "invalid_input" and "surrogates" in r["stderr"]
        assert (await c.get("/ping")).json() == "pong"
        status = (await c.get("/status")).json()
        assert set(status) == {"queue", "num_workers"} and status["num_workers"] >= 1
        long = (await c.post("/run", json={"type": "python", "solution": "print('x' * 5000)"})).json()
        assert long["run_success"] and len(long["stdout"]) == SETTINGS.code_judge_return_chars


HOSTILE = [
    ("x = bytearray(4 * 1024**3)", "memory"),
    ("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass", "timeout"),
    ("import sys\nwhile True: sys.stdout.write('y' * 65536)", "output"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=1)", "error"),
    ("import os, signal\nfor s in range(1, 65):\n    try: os.kill(1, s)\n    except OSError: pass\nprint('done')",
     "ok"),
    ("import os\nos.kill(os.getpid(), 9)", "error"),
    ("while True: pass", "timeout"),
    ("import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})\n"
     "time.sleep(30)", "timeout"),
    ("import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('parent done')", "ok"),
    ("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe not utf-8\\n')", "ok"),
    ("import threading, time\nfor _ in range(10000):\n    threading.Thread(target=time.sleep, args=(5,)).start()",
     "error"),
]


@pytest.mark.slow
async def test_hostile_programs_on_both_compatibility_apis(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=60) as c:
        judged = (await c.post("/run/batch", json={"type": "batch", "submissions": [
            {"type": "python", "solution": code} for code, _ in HOSTILE]})).json()["results"]
        fused = await asyncio.gather(*(c.post("/run_code", json={"code": code, "language": "python",
                                                                  "run_timeout": 1, "memory_limit_MB": 256})
                                       for code, _ in HOSTILE))
    for (code, kind), cj, sf in zip(HOSTILE, judged, (r.json() for r in fused), strict=True):
        if kind == "ok":
            assert cj["run_success"] and sf["status"] == "Success", (code, cj, sf)
            continue
        assert not cj["run_success"] and cj["reason"] in ("", "worker_timeout"), (code, cj)
        assert sf["status"] == "Failed", (code, sf)
        if kind == "timeout":
            assert cj["reason"] == "worker_timeout" and sf["run_result"]["status"] == "TimeLimitExceeded"
        if kind in ("memory", "output"):
            assert kind in sf["message"] or "limit" in sf["message"], sf


async def test_a_deep_queue_with_rstar2_agent_retries_runs_each_call_once(pool: SlotPool,
                                                                          gateway: GatewayClient) -> None:
    """More queued work than the wait allows: late calls come back queue_timeout (never run), the
    client re-sends just those, and every call ends up run exactly once."""
    codes = [f"import time\ntime.sleep(0.25)\nprint({i})" for i in range(24)]  # 3 s of work on 2 slots
    before = pool.calls_started
    async with gateway(code_judge_wall_s=2, code_judge_queue_wait_s=1.0) as c:
        results = await long_batch(c, codes, max_retries=10)
    assert [r["stdout"] for r in results] == [f"{i}\n" for i in range(24)]
    assert pool.calls_started - before == 24


async def test_the_math_verify_image_runs_a_reward_check() -> None:
    """The shipped reward image recipe builds, and a trainer's reward check runs in its jails."""
    from codeenv import ExecRequest, SandboxSettings

    settings = SandboxSettings(slots=1, image="python-math-verify")
    async with SlotPool(settings) as reward_pool:
        code = ("from math_verify import parse, verify\n"
                "print(verify(parse('$\\\\frac{1}{2}$'), parse('0.5')), verify(parse('$3$'), parse('4')))")
        result = await reward_pool.run(ExecRequest(code=code))
    assert result.status == "ok" and result.stdout == "True False\n", result
    assert result.profile == "reward"
