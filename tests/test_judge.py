"""The judge (/v1/judge): a submission against a problem's tests in one call, with verdicts equal to
running each test alone; the comparison rules; the client and the reward helper."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from codeenv import SlotPool
from codeenv.admission import judge_call
from codeenv.client import AsyncClient
from codeenv.compare import same_output, same_value
from codeenv.models import Compare, JudgeRequest, JudgeResult, JudgeStatus
from codeenv.rl import code_reward, is_service_fault
from tests.conftest import GatewayClient, Served

ADD = "a, b = map(int, input().split())\nprint(a + b)"


def stdin_tests(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"stdin": i, "expected_stdout": o} for i, o in pairs]


@pytest_asyncio.fixture
async def api(gateway: GatewayClient) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway(judge_max_tests=50, judge_max_bytes=1 << 16) as c:
        yield c


async def judge(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/judge", json=body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def statuses(result: dict[str, Any]) -> list[str]:
    return [t["status"] for t in result["tests"]]


# --- comparing (no jail) ----------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("actual", "expected", "compare", "ok"), [
    ("3\n", "3\n", Compare.exact, True),
    ("3", "3\n", Compare.exact, False),
    ("1 2  \n3\n\n\n", "1 2\n3", Compare.lines, True),
    ("1 2\r\n3\r\n", "1 2\n3\n", Compare.lines, True),
    ("1  2\n3", "1 2\n3", Compare.lines, False),
    ("\n1 2\n", "1 2\n", Compare.lines, False),  # a leading blank line counts
    ("1  2\n\n3", "1 2 3", Compare.tokens, True),
    ("1 2", "1 2 3", Compare.tokens, False),
    ("0.30000000000000004 x", "0.3 x", Compare.float, True),
    # open-r1's Codeforces default: whitespace squeezed, the words yes and no in any case
    ("Yes\n1  2\r\n\n", "YES 1\n2", Compare.codeforces, True),
    ("nO, yes.", "NO, YES.", Compare.codeforces, True),
    ("yesno", "YESNO", Compare.codeforces, False),  # not a word of its own
    ("Ok", "OK", Compare.codeforces, False),
    ("1 2", "1 2 3", Compare.codeforces, False),
    ("1000000.5", "1000000.0", Compare.float, True),  # relative to max(1, |expected|)
    ("0.5001", "0.5", Compare.float, False),
    ("nan inf", "nan inf", Compare.float, True),
    ("inf", "1e308", Compare.float, False),
    ("abc", "abd", Compare.float, False),
])
def test_compare_modes(actual: str, expected: str, compare: Compare, ok: bool) -> None:
    assert same_output(actual, expected, compare, 1e-6) is ok


@pytest.mark.unit
@pytest.mark.parametrize(("actual", "expected", "ok"), [
    ([1, 2], [1, 2], True),
    ([1, 2], [2, 1], False),
    (0.1 + 0.2, 0.3, True),
    (1, 1.0, True),
    (True, 1, False),
    ({"a": [1.0000000001]}, {"a": [1]}, True),
    ({"a": 1}, {"a": 1, "b": 2}, False),
    (None, None, True),
    ("1", 1, False),
    (10**30, 10**30 + 1, False),
])
def test_returned_values_compare_as_json(actual: object, expected: object, ok: bool) -> None:
    assert same_value(actual, expected, 1e-6) is ok


@pytest.mark.unit
def test_reward_helper_flags_service_faults() -> None:
    passed = JudgeResult(status=JudgeStatus.failed, passed=3, total=4)
    assert code_reward(passed) == 0.75
    assert code_reward(passed, all_or_nothing=True) == 0.0
    assert code_reward(JudgeResult(status=JudgeStatus.passed, passed=4, total=4), all_or_nothing=True) == 1.0
    assert code_reward(JudgeResult(status=JudgeStatus.compile_error, total=4)) == 0.0
    for fault in (JudgeStatus.internal_error, JudgeStatus.overloaded, JudgeStatus.rejected):
        result = JudgeResult(status=fault, total=4)
        assert is_service_fault(result) and code_reward(result) is None


# --- bad requests -------------------------------------------------------------------------------------


@pytest.mark.jail
@pytest.mark.parametrize(("body", "says"), [
    ({"code": ADD, "tests": []}, "at least 1 item"),
    ({"code": ADD, "tests": stdin_tests(("1 1", "2"))[:1] * 51}, "51 tests; the limit is 50"),
    ({"code": ADD, "tests": stdin_tests(("1" * 70000, "2"))}, "more than 65536 bytes"),
    ({"code": ADD, "tests": [{"stdin": "1 1", "expected": 2}]}, "stdin tests have stdin and expected_stdout"),
    ({"code": ADD, "fn_name": "f", "tests": [{"stdin": "1", "expected_stdout": "2"}]}, "function-call tests"),
    ({"code": ADD, "fn_name": "f", "tests": [{"args": [1]}]}, "function-call tests"),
    ({"code": ADD, "fn_name": "not a name", "tests": [{"args": [1], "expected": 1}]}, "(ASCII) identifier"),
    ({"code": ADD, "language": "go", "tests": stdin_tests(("1 1", "2"))}, "language 'go' is not supported"),
    ({"code": ADD, "checker": "def check(a, b): ...", "tests": stdin_tests(("1 1", "2"))}, "valid dictionary"),
    ({"code": ADD, "checker": {"type": "cms", "code": "x"}, "fn_name": "f", "tests": [{"args": [1], "expected": 1}]},
     "a checker or interactor judges stdin tests"),
    ({"code": ADD, "checker": {"type": "testlib", "code": "x", "files": {"../testlib.h": ""}},
      "tests": stdin_tests(("1 1", "2"))}, "checker file name '../testlib.h'"),
    ({"code": ADD, "checker": {"type": "spj", "code": "x"}, "tests": stdin_tests(("1 1", "2"))}, "testlib"),
    ({"code": ADD, "interactive": True, "tests": stdin_tests(("1 1", "2"))}, "needs its interactor"),
    ({"code": ADD, "compare": "fuzzy", "tests": stdin_tests(("1 1", "2"))}, "compare"),
    ({"code": ADD, "limits": {"cpu_s": 1000}, "tests": stdin_tests(("1 1", "2"))}, "limits.cpu_s=1000"),
    ({"code": ADD, "total_wall_s": 10**6, "tests": stdin_tests(("1 1", "2"))}, "total_wall_s=1e+06"),
    ({"code": ADD, "tests": stdin_tests(("1 1", "2")), "stdin": "x"}, "stdin"),
])
async def test_a_bad_request_is_a_422_that_says_what_to_fix(api: httpx.AsyncClient, body: dict[str, Any],
                                                            says: str) -> None:
    r = await api.post("/v1/judge", json=body)
    assert r.status_code == 422, r.text
    assert says in r.text


# --- verdicts -----------------------------------------------------------------------------------------


@pytest.mark.jail
async def test_passed_and_wrong_answer(api: httpx.AsyncClient) -> None:
    result = await judge(api, code=ADD, tests=stdin_tests(("1 2", "3\n"), ("2 2", "4"), ("0 0", "1")))
    assert (result["status"], result["passed"], result["total"]) == ("failed", 2, 3)
    assert statuses(result) == ["passed", "passed", "wrong_answer"]
    assert result["tests"][2]["stdout"] == "0\n"
    assert (result["compile"]["status"], result["compile"]["stderr"]) == ("ok", "")
    all_pass = await judge(api, code=ADD, tests=stdin_tests(*[(f"{i} {i}", str(2 * i)) for i in range(20)]))
    assert (all_pass["status"], all_pass["passed"]) == ("passed", 20)


@pytest.mark.jail
async def test_every_failure_verdict(api: httpx.AsyncClient) -> None:
    code = """
import os, sys, time
case = input()
if case == "error":
    raise ValueError("bad input")
if case == "exit":
    sys.exit(3)
if case == "spin":
    while True:
        pass
if case == "sleep":
    time.sleep(30)
if case == "memory":
    block = bytearray(400 << 20)
if case == "flood":
    while True:
        print("x" * 10000)
if case == "signal":
    os.kill(os.getpid(), 9)
print("fine")
"""
    cases = ["error", "exit", "spin", "sleep", "memory", "flood", "signal", "ok"]
    result = await judge(api, code=code, tests=stdin_tests(*[(c, "fine") for c in cases]),
                         limits={"cpu_s": 0.5, "wall_s": 2, "memory_mb": 128, "output_bytes": 65536})
    by_case = dict(zip(cases, result["tests"], strict=True))
    assert statuses(result) == ["error", "error", "timeout", "timeout", "memory", "output_limit", "killed", "passed"]
    assert by_case["error"]["error"]["type"] == "ValueError" and "bad input" in by_case["error"]["stderr"]
    assert by_case["exit"]["exit_code"] == 3
    assert by_case["spin"]["limit"] == "cpu" and 0.5 <= by_case["spin"]["cpu_s"] < 0.6  # within 50 ms
    assert by_case["sleep"]["limit"] == "wall"
    assert by_case["memory"]["limit"] == "memory"
    assert by_case["signal"]["signal"] == 9
    assert len(by_case["flood"]["stdout"]) <= 4096  # what is returned is truncated


@pytest.mark.jail
async def test_wall_limit_defaults_to_three_times_cpu_plus_one(api: httpx.AsyncClient) -> None:
    # 1.5 s asleep is within 3 x 0.2 + 1 = 1.6 s: a contended host does not make it a timeout.
    result = await judge(api, code="import time\ntime.sleep(1.5)\nprint(1)", tests=stdin_tests(("", "1")),
                         limits={"cpu_s": 0.2})
    assert statuses(result) == ["passed"]


@pytest.mark.jail
async def test_a_compile_error_runs_no_test(api: httpx.AsyncClient) -> None:
    result = await judge(api, code="def f(:\n    pass\n", tests=stdin_tests(("", "1"), ("", "2")))
    assert result["status"] == "compile_error" and result["passed"] == 0 and result["total"] == 2
    assert result["compile"]["status"] == "error" and "SyntaxError" in result["compile"]["stderr"]
    assert statuses(result) == ["skipped", "skipped"]


@pytest.mark.jail
async def test_stop_on_failure_equals_a_sequential_run(api: httpx.AsyncClient) -> None:
    tests = stdin_tests(("1 1", "2"), ("1 1", "3"), ("2 2", "4"), ("3 3", "6"))
    stopped = await judge(api, code=ADD, tests=tests, stop_on_failure=True)
    assert statuses(stopped) == ["passed", "wrong_answer", "skipped", "skipped"]
    every = await judge(api, code=ADD, tests=tests)
    assert statuses(every) == ["passed", "wrong_answer", "passed", "passed"]


@pytest.mark.jail
async def test_tests_cannot_see_each_others_effects(api: httpx.AsyncClient) -> None:
    code = """
import os, subprocess, sys
seen = sorted(os.listdir("."))
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
print(seen, others, os.environ.get("LEFT"))
open("left-behind", "w").write("x")
os.environ["LEFT"] = "yes"
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
"""
    result = await judge(api, code=code, tests=stdin_tests(*[("", "[] [] None")] * 3))
    assert statuses(result) == ["passed"] * 3, result


@pytest.mark.jail
async def test_expected_answers_never_enter_the_jail(api: httpx.AsyncClient) -> None:
    secret = "EXPECTED-5f1e09b3c2"
    code = f"""
import os
parts = [str(os.environ), open("/proc/self/cmdline", "rb").read().decode(errors="replace")]
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    for name in ("cmdline", "environ"):
        try:
            parts.append(open(f"/proc/{{pid}}/{{name}}", "rb").read().decode(errors="replace"))
        except OSError:
            pass
for top in (".", "/tmp", "/dev/shm"):
    for root, _, files in os.walk(top):
        for f in files:
            try:
                parts.append(open(os.path.join(root, f), "rb").read().decode(errors="replace"))
            except OSError:
                pass
try:
    open(f"/proc/{{os.getppid()}}/mem", "rb")
    parts.append("the judge's memory is readable")
except OSError:
    pass
print("found" if any({secret[:9]!r} + "-" in p for p in parts) or "readable" in parts[-1] else "absent")
"""
    result = await judge(api, code=code, tests=stdin_tests(("", secret)))
    assert result["tests"][0]["stdout"] == "absent\n"


@pytest.mark.jail
async def test_a_submission_that_forks_and_spawns(api: httpx.AsyncClient) -> None:
    code = """
import os, subprocess, sys
n = int(input())
out = subprocess.run([sys.executable, "-c", "print(int(input()) * 2)"], input=str(n), capture_output=True,
                     text=True, timeout=5)
pid = os.fork()
if pid == 0:
    os._exit(7)
_, status = os.waitpid(pid, 0)
print(int(out.stdout) + os.waitstatus_to_exitcode(status))
"""
    result = await judge(api, code=code, tests=stdin_tests(("1", "9"), ("5", "17")))
    assert statuses(result) == ["passed", "passed"], result


@pytest.mark.jail
async def test_a_test_that_ends_the_submissions_process_is_judged_as_if_alone(api: httpx.AsyncClient) -> None:
    # Alone, a test's parent is the jail's init, which no signal from inside reaches.
    code = ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
            "except ProcessLookupError:\n    pass\nprint(input())")
    result = await judge(api, code=code, tests=stdin_tests(("a", "a"), ("b", "b"), ("c", "x")))
    assert statuses(result) == ["passed", "passed", "wrong_answer"]
    function = ("import os, signal, sys\ndef f(x):\n    os.kill(os.getppid(), signal.SIGKILL)\n"
                "    return [x, sys.stdin.read()]\n")  # alone too, with no input
    result = await judge(api, code=function, fn_name="f", tests=[{"args": [1], "expected": [1, ""]},
                                                                  {"args": [2], "expected": [3, ""]}])
    assert statuses(result) == ["passed", "wrong_answer"] and result["tests"][1]["value"] == [2, ""]


@pytest.mark.jail
async def test_the_next_tests_files_made_ahead_are_never_left_open(api: httpx.AsyncClient) -> None:
    """While a test runs, the next one's files are made (sandbox/judge.py): whatever ends the run
    (the last test, stop_on_failure, a subtask failed, a test that ends the submission's process),
    none of them stays open in the worker, and each test still gets its own input."""
    import os

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    tests = stdin_tests(("1 1", "2"), ("1 1", "3"), ("2 2", "4"), ("3 3", "6"))
    ending = ("import os, signal\nline = input()\nif line == 'b':\n    os.kill(os.getppid(), signal.SIGKILL)\n"
              "print(line)")

    async def each_way() -> None:
        assert statuses(await judge(api, code=ADD, tests=tests)) == ["passed", "wrong_answer", "passed", "passed"]
        stopped = await judge(api, code=ADD, tests=tests, stop_on_failure=True)
        assert statuses(stopped) == ["passed", "wrong_answer", "skipped", "skipped"]
        subtasks = await judge(api, code=ADD, tests=tests, subtasks=[{"points": 1, "tests": [0, 1]},
                                                                     {"points": 1, "tests": [2, 3]}])
        assert statuses(subtasks) == ["passed", "wrong_answer", "passed", "passed"]
        alone = await judge(api, code=ending, tests=stdin_tests(("a", "a"), ("b", "b"), ("c", "x"), ("d", "d")))
        assert statuses(alone) == ["passed", "passed", "wrong_answer", "passed"]

    await each_way()  # the pool's own files (a jail recycled after the test that ended its process)
    before = fds()
    for _ in range(3):
        await each_way()
    assert fds() == before


# --- function-call tests ------------------------------------------------------------------------------


@pytest.mark.jail
async def test_function_call_tests(api: httpx.AsyncClient) -> None:
    plain = await judge(api, code="def add(a, b):\n    return a + b\n", fn_name="add", tests=[
        {"args": [1, 2], "expected": 3}, {"args": [0.1, 0.2], "expected": 0.3},
        {"args": [[1], [2]], "expected": [1, 2]}, {"args": ["a", "b"], "expected": "ba"}, {"args": [1], "expected": 1}])
    assert statuses(plain) == ["passed", "passed", "passed", "wrong_answer", "error"]
    assert plain["tests"][3]["value"] == "ab" and not plain["tests"][3]["value_truncated"]
    assert plain["tests"][4]["error"]["type"] == "TypeError"
    leetcode = await judge(api, code="""
from typing import List
class Solution:
    def twoSum(self, nums: List[int], target: int) -> List[int]:
        seen = {}
        for i, n in enumerate(nums):
            if target - n in seen:
                return [seen[target - n], i]
            seen[n] = i
        return (-1, -1)
""", fn_name="twoSum", tests=[{"args": [[2, 7, 11, 15], 9], "expected": [0, 1]},
                              {"args": [[3, 3], 6], "expected": [0, 1]}, {"args": [[1], 5], "expected": [-1, -1]}])
    assert statuses(leetcode) == ["passed"] * 3
    odd = await judge(api, code="def f():\n    return {1, 2}\n", fn_name="f", tests=[{"args": [], "expected": [1, 2]}])
    assert statuses(odd) == ["wrong_answer"] and "not JSON" in odd["tests"][0]["message"]


RETURNS = """
def f(kind):
    if kind == "dict":
        return {"a": [1, 2.5, None, True], "b": {"c": "d"}}
    if kind == "text":
        return "[1, 2]"
    if kind == "none":
        return None
    if kind == "surrogate":
        return {chr(0xDC80): [chr(0xD800) + "x"]}
    if kind == "nan":
        return [float("nan")]
    if kind == "large":
        return list(range(5000))
    x = []
    for _ in range(kind):
        x = [x]
    return x
"""


@pytest.mark.jail
async def test_a_returned_value_comes_back_as_json_not_as_text(api: httpx.AsyncClient, served: Served) -> None:
    deep: list[Any] = []
    for _ in range(10):
        deep = [deep]
    mapping = {"a": [1, 2.5, None, True], "b": {"c": "d"}}
    cases = [("dict", mapping, "passed", mapping),
             ("text", [1, 2], "wrong_answer", "[1, 2]"),  # a string that looks like JSON stays a string
             ("none", None, "passed", None), (10, deep, "passed", deep),
             ("surrogate", 0, "wrong_answer", {"\ufffd": ["\ufffdx"]})]  # as stdout shows them
    left_out = [("nan", [0], "wrong_answer"), ("large", list(range(5000)), "passed"), (500, 0, "wrong_answer")]
    result = await judge(api, code=RETURNS, fn_name="f", tests=[{"args": [k], "expected": e} for k, e, *_ in
                                                                 cases + left_out])
    got = [(t["status"], t["value"], t["value_truncated"]) for t in result["tests"]]
    assert got == [(status, value, False) for _, _, status, value in cases] + [
        (status, None, True) for _, _, status in left_out], got
    # The client's JudgeResult carries the same values.
    async with served() as url, AsyncClient(url) as client:
        judged = await client.judge(RETURNS, [{"args": ["dict"], "expected": 0}], fn_name="f")
    assert judged.tests[0].value == mapping


@pytest.mark.jail
async def test_function_tests_keep_no_state_between_tests(api: httpx.AsyncClient) -> None:
    code = "calls = []\ndef f(x):\n    calls.append(x)\n    return len(calls)\n"
    result = await judge(api, code=code, fn_name="f", tests=[{"args": [i], "expected": 1} for i in range(3)])
    assert statuses(result) == ["passed"] * 3


@pytest.mark.jail
async def test_slow_top_level_code_counts_against_every_test(api: httpx.AsyncClient, pool: SlotPool) -> None:
    code = """
import time
t = time.process_time()
while time.process_time() - t < 0.25:
    pass
def f(x):
    t = time.process_time()
    while time.process_time() - t < 0.1:
        pass
    return x
"""
    tests = [{"args": [i], "expected": i} for i in range(3)]
    roomy = await judge(api, code=code, fn_name="f", tests=tests, limits={"cpu_s": 1})
    assert statuses(roomy) == ["passed"] * 3
    assert all(t["cpu_s"] >= 0.35 for t in roomy["tests"])  # the preparation's CPU time is in each figure
    tight = await judge(api, code=code, fn_name="f", tests=tests, limits={"cpu_s": 0.3})
    assert [(t["status"], t["limit"]) for t in tight["tests"]] == [("timeout", "cpu")] * 3
    # Prepared once for all three tests.
    call = judge_call(JudgeRequest.model_validate({"code": code, "fn_name": "f", "tests": tests}), pool.settings)
    result = await pool.run(call)
    assert result.judge is not None and result.judge.prepared == 1 and result.judge.passed == 3


@pytest.mark.jail
async def test_top_level_state_a_fork_cannot_keep_is_rebuilt_per_test(api: httpx.AsyncClient) -> None:
    code = """
import threading, queue
jobs, answers = queue.Queue(), queue.Queue()
def worker():
    while True:
        answers.put(jobs.get() * 2)
threading.Thread(target=worker, daemon=True).start()
open("table", "w").write("3")
def f(x):
    jobs.put(x)
    return answers.get(timeout=5) + int(open("table").read())
"""
    result = await judge(api, code=code, fn_name="f", tests=[{"args": [i], "expected": 2 * i + 3} for i in range(3)])
    assert statuses(result) == ["passed"] * 3, result


# --- the batch and stream forms, the client --------------------------------------------------------------


@pytest.mark.jail
async def test_batch_and_stream(api: httpx.AsyncClient) -> None:
    items = [{"code": ADD, "tests": stdin_tests(("1 1", "2")), "id": "good"},
             {"code": ADD, "tests": [], "id": "empty"},
             {"code": "print(0)", "tests": stdin_tests(("", "1")), "id": "wrong"}]
    r = await api.post("/v1/judge/batch", json={"requests": items})
    assert r.status_code == 200
    results = r.json()["results"]
    assert [(x["id"], x["status"]) for x in results] == [("good", "passed"), ("empty", "rejected"), ("wrong", "failed")]
    assert "at least 1 item" in results[1]["message"]
    odd = await api.post("/v1/judge/batch", headers={"Content-Type": "application/json"},
                         content=json.dumps({"requests": [{"code": ADD, "tests": [], "id": "\ud800"}]}))
    assert odd.status_code == 200 and odd.json()["results"][0]["id"] is None  # an id nothing could send back
    r = await api.post("/v1/judge/stream", json={"requests": items})
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert lines[0] == {"accepted": 3}
    assert {line["i"]: line["result"]["status"] for line in lines[1:]} == {0: "passed", 1: "rejected", 2: "failed"}


@pytest.mark.jail
async def test_the_client_judges_micro_batched(served: Served) -> None:
    async with served() as url, \
            AsyncClient(url, max_in_flight=1) as client:
        good, bad, broken = await asyncio.gather(
            client.judge(ADD, stdin_tests(("1 2", "3"), ("2 2", "4"))),
            client.judge("print(5)", stdin_tests(("", "5"), ("", "6")), stop_on_failure=True),
            client.judge("def f(:", stdin_tests(("", "5"))),
        )
        assert (good.status, good.passed, code_reward(good)) == (JudgeStatus.passed, 2, 1.0)
        assert (bad.status, [t.status.value for t in bad.tests]) == (JudgeStatus.failed, ["passed", "wrong_answer"])
        assert broken.status is JudgeStatus.compile_error and code_reward(broken) == 0.0
        assert client.requests_sent <= 2


@pytest.mark.jail
@pytest.mark.redis
@pytest.mark.parametrize("client", ["redis"], indirect=True)  # embedded: the tests above
async def test_judging_through_redis(client: httpx.AsyncClient) -> None:
    result = await judge(client, code=ADD, tests=stdin_tests(("1 2", "3"), ("1 1", "3")))
    assert statuses(result) == ["passed", "wrong_answer"]
