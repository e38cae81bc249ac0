"""The command line, as a person runs it (a real process)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import jail_env

pytestmark = pytest.mark.jail

CLI = [sys.executable, "-m", "codeenv.cli"]


async def cli(*args: str, stdin: str = "") -> tuple[int, str, str]:
    env = jail_env()
    proc = await asyncio.create_subprocess_exec(
        *CLI, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_run_prints_the_result_as_json(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\n1/0\n")
    code, out, err = await cli("run", str(program), "--stdin", "hi", "--timeout", "5", "--memory", "256")
    assert code == 0, err
    result = json.loads(out)
    assert result["status"] == "error" and result["stdout"] == "HI\n"
    assert result["error"] == {"type": "ZeroDivisionError", "message": "division by zero", "line": 3}


async def test_run_reads_standard_input() -> None:
    code, out, err = await cli("run", "-", stdin="print(6 * 7)")
    assert code == 0, err
    assert json.loads(out)["stdout"] == "42\n"


async def test_bad_arguments_get_a_clear_message(tmp_path: Path) -> None:
    code, out, err = await cli("run", str(tmp_path / "missing.py"))
    assert code == 2 and "cannot read" in err and out == ""
    program = tmp_path / "p.py"
    program.write_text("print(1)")
    code, out, err = await cli("run", str(program), "--timeout", "100000")
    assert code == 2 and "cannot exceed the configured limit of 120" in err and "Traceback" not in err
