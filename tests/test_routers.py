"""open-r1's code rewards against codeenv: the E2B and Morph router APIs, and `display_last`.

open-r1 is not on PyPI: these tests send exactly what its routed sandboxes send (`RoutedSandbox`,
`RoutedMorphSandbox`: `{"scripts", "languages", "timeout", "request_timeout"}` to
`http://{router_url}/execute_batch`) and parse the answer as they do, with e2b-code-interpreter's
own models for E2B (`Execution(results=[Result(**r)...], logs=..., error=ExecutionError(**e),
execution_count=...)`, then `float(execution.text)`) and `float(item["text"])` for Morph.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from e2b_code_interpreter.models import Execution, ExecutionError, Result

from tests.conftest import GatewayClient

# A reward script shaped like open-r1's code reward: each test case runs the candidate with
# `subprocess.run(["python3", "-c", code], ...)`; the script's last expression is the pass rate.
CANDIDATE = "a, b = map(int, input().split())\nprint(a + b)"
REWARD_SCRIPT = """
import subprocess, json

def evaluate(code, cases):
    passed = 0
    for case in cases:
        try:
            run = subprocess.run(["python3", "-c", code], input=case["input"], text=True,
                                 capture_output=True, timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if run.returncode == 0 and run.stdout.strip() == case["output"].strip():
            passed += 1
    return passed / len(cases)

code = {code}
cases = json.loads({cases})
evaluate(code, cases)
"""
CASES = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "5"}]


def reward_script(code: str = CANDIDATE) -> str:
    return REWARD_SCRIPT.format(code=json.dumps(code), cases=json.dumps(json.dumps(CASES)))


@pytest_asyncio.fixture
async def api(gateway: GatewayClient) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway() as c:
        yield c


def as_routed_sandbox(item: dict[str, Any]) -> Execution:
    """What RoutedSandbox.run_code makes of one answer."""
    if item["execution"] is None:
        return Execution()
    ex = item["execution"]
    return Execution(results=[Result(**r) for r in ex["results"]], logs=ex["logs"],
                     error=ExecutionError(**ex["error"]) if ex["error"] else None,
                     execution_count=ex["execution_count"])


async def post_batch(api: httpx.AsyncClient, path: str, scripts: list[str], languages: list[str] | None = None,
                     timeout: int = 30) -> list[dict[str, Any]]:
    payload = {"scripts": scripts, "languages": languages or ["python"] * len(scripts), "timeout": timeout,
               "request_timeout": 28}
    r = await api.post(path, json=payload)
    assert r.status_code == 200, r.text
    answer: list[dict[str, Any]] = r.json()
    assert len(answer) == len(scripts)
    return answer


@pytest.mark.jail
async def test_display_last_reports_the_last_expression(api: httpx.AsyncClient) -> None:
    cases = [("print('hi')\n2 ** 10", "1024", "hi\n"), ("x = [1, 'a']\nx", "[1, 'a']", ""),
             ("'text'", "'text'", ""), ("None", None, ""), ("x = 1", None, ""), ("print(3)", None, "3\n"),
             ("if True:\n    5", None, ""), ("1\n2\n3.5", "3.5", "")]
    r = await api.post("/v1/execute/batch", json={"requests": [{"code": c, "display_last": True} for c, _, _ in cases]})
    results = r.json()["results"]
    assert [(x["value"], x["stdout"]) for x in results] == [(v, out) for _, v, out in cases]
    plain = (await api.post("/v1/execute", json={"code": "2 ** 10"})).json()
    assert plain["value"] is None  # only when asked
    failing = (await api.post("/v1/execute", json={"code": "x = 1\nx / 0", "display_last": True})).json()
    assert failing["status"] == "error" and failing["value"] is None and failing["error"]["line"] == 2
    huge = (await api.post("/v1/execute", json={"code": "'é' * 100000", "display_last": True})).json()
    assert huge["status"] == "ok" and len(huge["value"]) == 8192


@pytest.mark.jail
async def test_open_r1_e2b_router(api: httpx.AsyncClient) -> None:
    assert (await api.get("/health")).json() == {"status": "ok"}
    scripts = [reward_script(), reward_script("print(int(input().split()[0]) * 2)"), "1 / 0",
               "import time\ntime.sleep(30)", "print('x')", "console.log(1)"]
    answer = await post_batch(api, "/execute_batch", scripts, ["python"] * 5 + ["javascript"], timeout=2)
    executions = [as_routed_sandbox(item) for item in answer]
    assert float(executions[0].text) == 0.5  # the reward: its last expression
    assert float(executions[1].text) == 0.0
    assert executions[2].text is None and executions[2].error is not None
    assert (executions[2].error.name, executions[2].error.value) == ("ZeroDivisionError", "division by zero")
    assert "Traceback" in executions[2].error.traceback
    assert answer[3]["execution"] is None and "timeout of 2s" in answer[3]["exception_str"]
    assert executions[4].text is None and executions[4].logs == {"stdout": ["x\n"], "stderr": []}
    assert answer[5]["execution"] is None and "javascript" in answer[5]["exception_str"]
    for item in answer:  # only keys the e2b models take
        assert set(item) == {"execution", "exception_str"}
        if item["execution"] is not None:
            assert set(item["execution"]) == {"results", "logs", "error", "execution_count"}


@pytest.mark.jail
async def test_open_r1_morph_router(api: httpx.AsyncClient) -> None:
    assert (await api.get("/morph/health")).json() == {"status": "ok"}
    answer = await post_batch(api, "/morph/execute_batch",
                              [reward_script(), "print(0.25)", "1 / 0", "import time\ntime.sleep(30)", "x = 1"],
                              timeout=2)
    assert set(answer[0]) == {"text", "exception_str"}
    assert float(answer[0]["text"]) == 0.5 and answer[0]["exception_str"] is None
    assert float(answer[1]["text"]) == 0.25  # no value: its output, as the Morph router falls back
    assert answer[2]["text"] == "" and answer[2]["exception_str"].startswith("ZeroDivisionError")
    assert answer[3]["text"] is None and "timeout" in answer[3]["exception_str"]
    assert answer[4] == {"text": "", "exception_str": "No output from execution"}


@pytest.mark.jail
async def test_router_batches_say_what_is_wrong(api: httpx.AsyncClient) -> None:
    # A script without a language is python's (open-r1 sends one per script).
    r = await api.post("/execute_batch", json={"scripts": ["1", "2"], "languages": ["python"], "timeout": 5})
    assert r.status_code == 200 and [as_routed_sandbox(x).text for x in r.json()] == ["1", "2"]
    r = await api.post("/execute_batch", json={"scripts": ["1"], "timeout": "5"})
    assert r.status_code == 422 and "valid number" in r.text
    r = await api.post("/execute_batch", json={"scripts": ["1"], "timeout": -1})
    assert r.status_code == 422
    older = await api.post("/execute_batch", json={"scripts": ["6 * 7"], "language": "python", "timeout": 5})
    assert as_routed_sandbox(older.json()[0]).text == "42"
