"""Piston v2 as open-r1's Codeforces and IOI rewards call it (issue 39).

The requests are built as open-r1 builds them (read in its source: `piston_client.py` posts
`{**data, "language", "version": "*"}` to `{endpoint}/execute`; `cf_scoring.py` sends `main.cpp` or
`main.python`, `checker.py` when the problem has a generated checker, `input.txt`,
`correct_output.txt` and `grader_config` with `TIME_LIMIT`, `MEMORY_LIMIT` and `INPUT_MODE`, with the
language `c++17` or `cf_python3` and `run_timeout` (time limit + 10) * 1000; `ioi_scoring.py` sends
`graders/{id}.cpp`, `input.txt`, `correct_output.txt` and the task's grader files as `cms_ioi` with
`run_timeout` (time limit + 3) * 1000 and `run_memory_limit`), and the answers are read as it reads
them: a test passes when `compile.code == 0`, `run.code == 0` and `run.stdout.strip() == "1"`
(Codeforces); the score is `float(run.stdout)` and the status is read from `run.stderr` (IOI)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from tests.conftest import GatewayClient

pytestmark = pytest.mark.jail

SUM_CPP = "#include <bits/stdc++.h>\nint main() { long long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }\n"
SUM_PY = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest_asyncio.fixture
async def api(cpp_toolchain: None, gateway: GatewayClient) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway() as c:
        yield c


async def codeforces(api: httpx.AsyncClient, submission: str, test_input: str, test_output: str | None, *,
                     language: str = "cpp", checker: str | None = None, time_limit: float = 2,
                     memory_limit: int = 256, input_mode: str = "stdio") -> dict[str, Any]:
    """One test as open-r1's cf_scoring.score_single_test_case sends it."""
    files = [{"name": f"main.{language}", "content": submission},
             *([{"name": "checker.py", "content": checker}] if checker else []),
             {"name": "input.txt", "content": test_input},
             *([{"name": "correct_output.txt", "content": test_output}] if test_output is not None else []),
             {"name": "grader_config", "content": "\n".join(
                 f"{k}={v}" for k, v in {"TIME_LIMIT": time_limit, "MEMORY_LIMIT": memory_limit,
                                         "INPUT_MODE": input_mode}.items())}]
    body = {"files": files, "run_timeout": (time_limit + 10) * 1000,
            "language": "cf_python3" if language == "python" else "c++17", "version": "*"}
    r = await api.post("/api/v2/execute", json=body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def cf_passed(result: dict[str, Any]) -> bool:
    """As cf_scoring.score_submission reads a test's answer."""
    return result["compile"]["code"] == 0 and result["run"]["code"] == 0 and result["run"]["stdout"].strip() == "1"


async def test_codeforces_cpp_passes_fails_and_compiles(api: httpx.AsyncClient) -> None:
    ok = await codeforces(api, SUM_CPP, "1 2\r\n", "3\r\n\r\n")
    assert cf_passed(ok), ok
    assert ok["language"] == "c++17" and ok["run"]["stderr"] == "Output is correct (diff)\n"
    wrong = await codeforces(api, SUM_CPP, "1 2", "4")
    assert not cf_passed(wrong) and wrong["run"]["stdout"] == "0\n" and wrong["compile"]["code"] == 0, wrong
    broken = await codeforces(api, "int main() { return nope; }", "1 2", "3")
    assert broken["compile"]["code"] != 0 and "nope" in broken["compile"]["stderr"], broken


async def test_codeforces_input_mode_file_reads_input_txt_and_writes_output_txt(api: httpx.AsyncClient) -> None:
    files_cpp = ('#include <cstdio>\nint main() { long long a, b; FILE* in = std::fopen("input.txt", "r"); '
                 'FILE* out = std::fopen("output.txt", "w"); std::fscanf(in, "%lld %lld", &a, &b); '
                 'std::fprintf(out, "%lld\\n", a + b); std::printf("ignored\\n"); }\n')
    files_py = "a, b = map(int, open('input.txt').read().split())\nopen('output.txt', 'w').write(str(a + b))"
    assert cf_passed(await codeforces(api, files_cpp, "1 2", "3", input_mode="file"))
    assert cf_passed(await codeforces(api, files_py, "20 22", "42", language="python", input_mode="file"))
    assert not cf_passed(await codeforces(api, files_py, "1 1", "3", language="python", input_mode="file"))
    # stdout is not the answer in file mode, and a stdin program finds no input there
    assert not cf_passed(await codeforces(api, SUM_CPP, "1 2", "3", input_mode="file"))
    # without the answer: the program's output file comes back
    printed = await codeforces(api, files_py, "2 3", None, language="python", input_mode="file")
    assert printed["run"]["stdout"] == "5", printed
    # hostile: output.txt a link to the input, or a FIFO no one writes: no answer, no hang
    link = "import os\nos.symlink('input.txt', 'output.txt')"
    fifo = "import os\nos.mkfifo('output.txt')"
    for code in (link, fifo):
        result = await codeforces(api, code, "3", "3", language="python", input_mode="file")
        assert not cf_passed(result) and result["run"]["stderr"] == "Output isn't correct (diff)\n", result


async def test_codeforces_compares_yes_and_no_in_any_case_and_squeezes_whitespace(api: httpx.AsyncClient) -> None:
    code = "print('yEs')\nprint()\nprint('1    2')"
    assert cf_passed(await codeforces(api, code, "", "YES\n1 2", language="python"))
    assert not cf_passed(await codeforces(api, code, "", "NO\n1 2", language="python"))


async def test_codeforces_python_and_its_limits(api: httpx.AsyncClient) -> None:
    ok = await codeforces(api, SUM_PY, "2 2", "4", language="python")
    assert cf_passed(ok) and ok["language"] == "python3" and ok["compile"]["code"] == 0, ok
    slow = await codeforces(api, "while True: pass", "", "1", language="python", time_limit=1)
    assert not cf_passed(slow) and slow["run"]["stdout"] == "0\n", slow
    assert (slow["run"]["code"], slow["run"]["stderr"]) == (124, "Time limit exceeded (1s)\n")
    crash = await codeforces(api, "raise SystemExit(3)", "", "1", language="python")
    assert (crash["run"]["code"], crash["run"]["stderr"]) == (3, "Runtime error with exit code 3\n"), crash
    syntax = await codeforces(api, "print(", "", "1", language="python")
    assert syntax["compile"]["code"] == 0 and syntax["run"]["code"] == 1, syntax  # python3 compiles nothing


async def test_codeforces_with_open_r1s_generated_checker(api: httpx.AsyncClient) -> None:
    checker = ("import sys\n_, answer, output = sys.argv[1:4]\n"
               "print(1 if sorted(open(answer).read().split()) == sorted(open(output).read().split()) else 0)\n")
    code = "print(*reversed(input().split()))"
    ok = await codeforces(api, code, "1 2 3", "1 2 3", language="python", checker=checker)
    assert cf_passed(ok) and ok["run"]["stderr"] == "Output is correct (checker)\n", ok
    wrong = await codeforces(api, "print(1)", "1 2 3", "1 2 3", language="python", checker=checker)
    assert not cf_passed(wrong) and wrong["run"]["stderr"] == "Output isn't correct (checker)\n", wrong


#: An IOI Batch task as its grader files come: a header, a grader that calls the contestant's
#: function, and a CMS checker; the submission is graders/{id}.cpp.
IOI_HEADER = "long long add(long long a, long long b);\n"
IOI_GRADER = ('#include "sumtask.h"\n#include <cstdio>\nint main() { long long a, b; '
              'if (std::scanf("%lld %lld", &a, &b) != 2) return 1; std::printf("%lld\\n", add(a, b)); }\n')
IOI_CHECKER = r"""#include <bits/stdc++.h>
int main(int argc, char** argv) {
    std::ifstream ans(argv[2]), out(argv[3]);
    long long want, got;
    ans >> want;
    if (!(out >> got)) { std::cout << 0 << std::endl; std::cerr << "translate:wrong" << std::endl; return 0; }
    if (got == want) { std::cout << 1 << std::endl; std::cerr << "translate:success" << std::endl; }
    else if (std::llabs(got - want) <= 1) {
        std::cout << 0.5 << std::endl; std::cerr << "translate:partial" << std::endl;
    }
    else { std::cout << 0 << std::endl; std::cerr << "translate:wrong" << std::endl; }
}
"""


#: The same task as a Communication one (one process, std_io): the stub talks with the manager
#: through its stdin and stdout; the manager sends the numbers and scores the sum.
IOI_STUB = ('#include "sumtask.h"\n#include <iostream>\nint main() { long long a, b; '
            'while (std::cin >> a >> b) std::cout << add(a, b) << std::endl; }\n')
IOI_MANAGER = r"""#include <fstream>
#include <iostream>
int main(int argc, char** argv) {
    std::ifstream from_user(argv[1]); std::ofstream to_user(argv[2]);
    long long a, b, got; std::cin >> a >> b;
    to_user << a << " " << b << std::endl;
    if (!(from_user >> got)) { std::cout << 0 << std::endl; std::cerr << "translate:wrong" << std::endl; return 0; }
    bool right = got == a + b;
    std::cout << (right ? 1 : 0) << std::endl;
    std::cerr << (right ? "translate:success" : "translate:wrong") << std::endl;
}
"""


async def ioi(api: httpx.AsyncClient, submission: str, test_input: str, test_output: str | None, *,
              checker: bool = True, task_type: str = "Batch", time_limit: float = 1,
              processes: int = 1) -> dict[str, Any]:
    """One test as open-r1's ioi_scoring.run_submission sends it."""
    communication = task_type == "Communication"
    grader_files = [("graders/sumtask.h", IOI_HEADER),
                    *([("graders/stub.cpp", IOI_STUB), ("graders/manager.cpp", IOI_MANAGER)] if communication
                      else [("graders/grader.cpp", IOI_GRADER)]),
                    ("graders/grader_config.json", json.dumps({
                        "task_type": task_type, "code": "sumtask", "time_limit": time_limit,
                        "memory_limit": 256 << 20, "task_type_parameters_Communication_num_processes": processes})),
                    ("checker/checker.cpp", IOI_CHECKER if checker else "")]
    data = {"files": [{"name": "graders/sumtask.cpp", "content": submission},
                      {"name": "input.txt", "content": test_input},
                      *([{"name": "correct_output.txt", "content": test_output}] if test_output else []),
                      *({"name": name, "content": content} for name, content in grader_files if content)],
            "run_timeout": round((time_limit + 3) * 1000), "run_memory_limit": 256}
    r = await api.post("/api/v2/execute", json=data | {"language": "cms_ioi", "version": "*"})
    result: dict[str, Any] = r.json()
    result["http_status"] = r.status_code
    return result


def ioi_score(response: dict[str, Any]) -> tuple[float, str]:
    """As ioi_scoring.execute_ioi reads an answer: (score, feedback)."""
    assert "message" not in response, response
    if "compile" in response and response["compile"]["code"] != 0:
        return 0.0, "Compilation error exit code " + str(response["compile"]["code"]) + "\n" + \
            response["compile"]["stderr"]
    if response["run"]["stdout"]:
        return float(response["run"]["stdout"]), response["run"]["stderr"]
    raise AssertionError(f"no score: {response}")


async def test_ioi_batch_task_linked_with_its_grader_and_scored_by_its_checker(api: httpx.AsyncClient) -> None:
    right = '#include "sumtask.h"\nlong long add(long long a, long long b) { return a + b; }\n'
    near = '#include "sumtask.h"\nlong long add(long long a, long long b) { return a + b + 1; }\n'
    assert ioi_score(await ioi(api, right, "20 22", "42")) == (1.0, "translate:success\n")
    assert ioi_score(await ioi(api, near, "20 22", "42")) == (0.5, "translate:partial\n")
    score, feedback = ioi_score(await ioi(api, "long long add(long long, long long) { for (;;); }", "1 2", "3"))
    assert (score, feedback) == (0.0, "Time limit exceeded (1s)\n")
    score, feedback = ioi_score(await ioi(api, "int add(", "1 2", "3"))
    assert score == 0.0 and feedback.startswith("Compilation error exit code 1\n"), feedback
    # without a checker: the output compared with the answer
    assert ioi_score(await ioi(api, right, "1 2", "3", checker=False)) == (1.0, "Output is correct (diff)\n")
    assert ioi_score(await ioi(api, near, "1 2", "3", checker=False)) == (0.0, "Output isn't correct (diff)\n")


async def test_ioi_communication_task_with_its_manager(api: httpx.AsyncClient) -> None:
    right = '#include "sumtask.h"\nlong long add(long long a, long long b) { return a + b; }\n'
    wrong = '#include "sumtask.h"\nlong long add(long long a, long long b) { return a - b; }\n'
    assert ioi_score(await ioi(api, right, "20 22", "42", checker=False, task_type="Communication")) == \
        (1.0, "translate:success\n")
    assert ioi_score(await ioi(api, wrong, "20 22", "42", checker=False, task_type="Communication")) == \
        (0.0, "translate:wrong\n")
    # With the answer and a checker, the checker scores what the manager printed (here its own 1 or 0).
    assert ioi_score(await ioi(api, right, "1 2", "1", task_type="Communication"))[0] == 1.0


async def test_what_piston_refuses_is_a_400_with_its_message(api: httpx.AsyncClient) -> None:
    right = '#include "sumtask.h"\nlong long add(long long a, long long b) { return a + b; }\n'
    communication = await ioi(api, right, "1 2", "3", task_type="Communication", processes=99)
    assert communication["http_status"] == 400
    assert "grader_config.json: processes" in communication["message"], communication
    output_only = await ioi(api, right, "1 2", "3", task_type="OutputOnly")
    assert output_only["http_status"] == 400 and "OutputOnly" in output_only["message"], output_only
    r = await api.post("/api/v2/execute", json={"language": "brainfuck", "version": "*",
                                                "files": [{"content": "+"}]})
    assert (r.status_code, r.json()["message"]) == (400, "brainfuck-* runtime is unknown")
    r = await api.post("/api/v2/execute", json={"language": "c++17", "files": []})
    assert r.status_code == 400 and "files" in r.json()["message"], r.text


async def test_runtimes_list_what_open_r1_asks_for(api: httpx.AsyncClient) -> None:
    r = await api.get("/api/v2/runtimes")
    assert r.status_code == 200
    names = {alias for runtime in r.json() for alias in (runtime["language"], *runtime["aliases"])}
    assert {"c++17", "cf_python3", "cms_ioi", "python3", "cf_c++17"} <= names
