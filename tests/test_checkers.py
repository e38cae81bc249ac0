"""Checkers (issue 39): a problem's own program decides each test, by the testlib, CMS and open-r1
protocols, for Python and C++ submissions, in a jail of its own; a submission never finds the answer
or the checker; a checker that fails is the service's answer (internal_error), never the program's."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from codeenv.sandbox import checker as checker_module
from tests.conftest import GatewayClient

#: A header of the problem's own, sent beside the checker (as a problem sends testlib.h).
VERDICTS_H = "enum { OK = 0, WA = 1, PE = 2, FAIL = 3, POINTS = 7 };\n"

#: testlib's protocol (argv: input, the contestant's output, the answer): two numbers whose sum is n.
SUM_CHECKER = r"""#include "verdicts.h"
#include <cstdio>
#include <fstream>
#include <string>
int main(int argc, char** argv) {
    if (argc != 4) { std::fprintf(stderr, "usage: checker input output answer"); return FAIL; }
    std::ifstream in(argv[1]), out(argv[2]), ans(argv[3]);
    long long n, a, b; std::string extra, want;
    in >> n; ans >> want;
    if (want != "any") { std::fprintf(stderr, "the answer file is not the answer"); return FAIL; }
    if (!(out >> a >> b) || (out >> extra)) { std::fprintf(stderr, "expected two numbers"); return PE; }
    if (a == -1) { std::fprintf(stderr, "the checker gives up"); return FAIL; }
    if (a + b != n) { std::fprintf(stderr, "%lld + %lld is not %lld", a, b, n); return WA; }
    if (a <= 0 || b <= 0) { std::fprintf(stderr, "points 0.5 right sum, not positive"); return POINTS; }
    std::fprintf(stderr, "ok %lld + %lld", a, b);
    return OK;
}
"""

SUM_PY = 'n = int(input())\nprint({5: "2 3", 6: "1 4", 7: "hello", 8: "-3 11", 9: "-1 10"}[n])\n'
SUM_CPP = r"""#include <bits/stdc++.h>
int main() { int n; std::cin >> n; if (n == 5) std::cout << "2 3\n"; else std::cout << "1 1\n"; }
"""

#: CMS's protocol (argv: input, the answer, the contestant's output): a score on stdout, a message on stderr.
CMS_CHECKER = r"""#include <bits/stdc++.h>
int main(int argc, char** argv) {
    std::ifstream ans(argv[2]), out(argv[3]);
    std::string want, got; ans >> want; out >> got;
    std::string lower = got; for (auto& c : lower) c = std::tolower(c);
    if (got == want) { std::cout << "1\n"; std::cerr << "translate:success\n"; }
    else if (lower == want) { std::cout << "0.5\n"; std::cerr << "translate:partial\n"; }
    else { std::cout << "0\n"; std::cerr << "translate:wrong\n"; }
}
"""

#: open-r1's checker.py (argv: input, the answer, the contestant's output): "100" when correct.
OPEN_R1_CHECKER = """import sys
_, answer, output = sys.argv[1:4]
want = sorted(open(answer).read().split())
got = sorted(open(output).read().split())
print(100 if got == want else 0)
"""


@pytest_asyncio.fixture
async def api(cpp_toolchain: None, gateway: GatewayClient) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway(judge_max_tests=50, judge_max_bytes=1 << 16) as c:
        yield c


async def judge(client: httpx.AsyncClient, code: str, tests: list[tuple[str, str]], checker: dict[str, Any],
                **body: Any) -> dict[str, Any]:
    r = await client.post("/v1/judge", json={"code": code, "checker": checker, **body,
                                             "tests": [{"stdin": i, "expected_stdout": o} for i, o in tests]})
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def statuses(result: dict[str, Any]) -> list[str]:
    return [t["status"] for t in result["tests"]]


TESTLIB = {"type": "testlib", "code": SUM_CHECKER, "files": {"verdicts.h": VERDICTS_H}}


@pytest.mark.jail
async def test_a_testlib_checker_decides_right_wrong_presentation_partial_and_its_own_failure(
        api: httpx.AsyncClient) -> None:
    result = await judge(api, SUM_PY, [(str(n), "any") for n in (5, 6, 7, 8, 9)], TESTLIB)
    tests = result["tests"]
    assert statuses(result) == ["passed", "wrong_answer", "wrong_answer", "wrong_answer", "internal_error"], tests
    assert [t["score"] for t in tests] == [1.0, 0.0, 0.0, 0.5, None]
    assert tests[0]["message"] == "ok 2 + 3"
    assert tests[1]["message"] == "1 + 4 is not 6"
    assert tests[2]["message"] == "presentation error: expected two numbers"
    assert tests[3]["message"].startswith("partial: points 0.5")
    assert "the checker failed (exit code 3): the checker gives up" == tests[4]["message"]
    assert (result["status"], result["passed"]) == ("internal_error", 1)  # a test without a verdict: not scored


@pytest.mark.jail
async def test_a_checker_judges_a_cpp_submission_too(api: httpx.AsyncClient) -> None:
    result = await judge(api, SUM_CPP, [("5", "any"), ("6", "any")], TESTLIB, language="cpp")
    assert statuses(result) == ["passed", "wrong_answer"], result
    assert result["compile"]["status"] == "ok"


@pytest.mark.jail
async def test_a_cms_checker_scores_from_0_to_1(api: httpx.AsyncClient) -> None:
    code = "print(input())"
    result = await judge(api, code, [("yes", "yes"), ("YES", "yes"), ("no", "yes")],
                         {"type": "cms", "code": CMS_CHECKER})
    assert statuses(result) == ["passed", "wrong_answer", "wrong_answer"], result
    assert [t["score"] for t in result["tests"]] == [1.0, 0.5, 0.0]
    assert [t["message"] for t in result["tests"]] == ["translate:success", "translate:partial", "translate:wrong"]


@pytest.mark.jail
async def test_open_r1s_python_checker_accepts_any_order(api: httpx.AsyncClient) -> None:
    code = "xs = input().split()\nprint(*(reversed(xs) if xs[0] != 'x' else ['x']))"
    result = await judge(api, code, [("1 2 3", "1 2 3"), ("x y", "x y")], {"type": "open_r1", "code": OPEN_R1_CHECKER})
    assert statuses(result) == ["passed", "wrong_answer"], result
    assert [t["score"] for t in result["tests"]] == [1.0, 0.0]


@pytest.mark.jail
async def test_a_submission_never_finds_the_answer_or_the_checker(api: httpx.AsyncClient) -> None:
    """The answer and the checker's source hold secrets a test looks for everywhere it can reach
    (files, its environment, every process's command line and environment); the checker accepts
    only an output that holds the answer's secret."""
    answer_secret, checker_secret = "answer-secret-5d1c", "checker-secret-9e2b"
    hunter = """import os
found = []
for key, value in os.environ.items():
    if "-secret-" in value: found.append("env")
for root, dirs, files in os.walk("/"):
    if root.startswith(("/sys", "/dev")):
        dirs[:] = []
        continue
    for name in files:
        path = os.path.join(root, name)
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 20)
        except OSError:
            continue
        if b"answer-secret-" in data or b"checker-secret-" in data:
            found.append(path)
print(" ".join(found) if found else "nothing")
"""
    checker = f"""import sys
# {checker_secret}
_, answer, output = sys.argv[1:4]
print(1 if open(answer).read().strip() in open(output).read() else 0)
"""
    result = await judge(api, hunter, [("", answer_secret)], {"type": "open_r1", "code": checker},
                         limits={"cpu_s": 10, "wall_s": 30})
    assert statuses(result) == ["wrong_answer"], result
    assert result["tests"][0]["stdout"] == "nothing\n", result["tests"][0]


@pytest.mark.jail
async def test_a_checker_that_does_not_compile_runs_no_test(api: httpx.AsyncClient) -> None:
    r = await api.post("/v1/judge", json={"code": "print(1)", "tests": [{"stdin": "", "expected_stdout": "1"}],
                                          "checker": {"type": "testlib", "code": "int main() { return nope; }"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "internal_error", body
    assert "checker does not compile" in body["message"] and "nope" in body["message"], body


@pytest.mark.jail
@pytest.mark.parametrize(("code", "says"), [
    ("int main() { for (;;) {} }", "exceeded its time limit of 1 s"),
    ("int main() { *(volatile int*)0 = 1; }", "killed by a signal"),  # (it is PID 1: raise() would not do)
    ("#include <cstdio>\nint main() { std::puts(\"2\"); }", "no score from 0 to 1"),
])
async def test_a_checker_that_fails_is_an_internal_error_never_the_programs_verdict(
        api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, code: str, says: str) -> None:
    monkeypatch.setattr(checker_module, "CPU_S", 1)
    result = await judge(api, "print(1)", [("", "1")], {"type": "cms", "code": code})
    assert statuses(result) == ["internal_error"], result
    assert says in result["tests"][0]["message"], result["tests"][0]


@pytest.mark.jail
async def test_a_test_that_fails_before_its_check_keeps_its_own_verdict(api: httpx.AsyncClient) -> None:
    code = "import sys\nn = int(input())\nif n == 1: sys.exit(3)\nif n == 2: print('x' * 10**6)\nprint(n - 1, 1)"
    result = await judge(api, code, [("1", "any"), ("2", "any"), ("4", "any")], TESTLIB,
                         limits={"output_bytes": 1000}, stop_on_failure=False)
    assert statuses(result) == ["error", "output_limit", "passed"], json.dumps(result["tests"])[:2000]
    assert [t["score"] for t in result["tests"]] == [None, None, 1.0]


@pytest.mark.unit
@pytest.mark.parametrize(("kind", "code", "out", "err", "limit", "status", "score"), [
    ("testlib", 0, b"", b"ok fine", None, "passed", 1.0),
    ("testlib", 1, b"", b"wrong", None, "wrong_answer", 0.0),
    ("testlib", 2, b"", b"bad format", None, "wrong_answer", 0.0),
    ("testlib", 4, b"", b"", None, "wrong_answer", 0.0),
    ("testlib", 7, b"", b"points 35.5 some", None, "wrong_answer", 35.5),
    ("testlib", 3, b"", b"fail", None, "internal_error", None),
    ("testlib", None, b"", b"", None, "internal_error", None),
    ("testlib", 0, b"", b"", "memory", "internal_error", None),
    ("cms", 0, b"1\n", b"translate:success\n", None, "passed", 1.0),
    ("cms", 0, b"0.25", b"", None, "wrong_answer", 0.25),
    ("cms", 0, b"1.5", b"", None, "internal_error", None),
    ("cms", 0, b"nan", b"", None, "internal_error", None),
    ("cms", 1, b"1", b"", None, "internal_error", None),
    ("open_r1", 0, b" 100\n", b"", None, "passed", 1.0),
    ("open_r1", 0, b"1", b"", None, "passed", 1.0),
    ("open_r1", 0, b"0", b"", None, "wrong_answer", 0.0),
    ("open_r1", 1, b"", b"Traceback", None, "wrong_answer", 0.0),  # open-r1: anything else is a 0
    ("open_r1", None, b"", b"", "cpu", "wrong_answer", 0.0),
])
def test_each_protocol_is_read_as_its_judges_read_it(kind: str, code: int | None, out: bytes, err: bytes,
                                                     limit: str | None, status: str, score: float | None) -> None:
    from codeenv.models import CheckerType

    check = checker_module.read_verdict(CheckerType(kind), code, out, err, limit)
    assert (check.status.value, check.score) == (status, score), check
