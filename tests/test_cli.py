"""The command line, as a person runs it (a real process)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import jail_env

pytestmark = pytest.mark.jail

CLI = [sys.executable, "-m", "codeenv.cli"]


async def cli(*args: str, stdin: str = "", wrapper: tuple[str, ...] = (), **env_vars: str) -> tuple[int, str, str]:
    env = jail_env(**env_vars)
    proc = await asyncio.create_subprocess_exec(
        *wrapper, *CLI, *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_run_prints_the_result_as_json(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\n1/0\n")
    code, out, err = await cli("run", str(program), "--stdin", "hi", "--timeout", "5", "--memory", "256")
    assert code == 1, err  # the program's own exit status (an uncaught exception)
    result = json.loads(out)
    assert result["status"] == "error" and result["stdout"] == "HI\n"
    assert result["error"] == {"type": "ZeroDivisionError", "message": "division by zero", "line": 3}


async def test_run_reads_standard_input() -> None:
    code, out, err = await cli("run", "-", stdin="print(6 * 7)")
    assert code == 0, err
    assert json.loads(out)["stdout"] == "42\n"


async def test_a_niced_worker_starts_its_jails_without_warnings_at_its_own_nice_level() -> None:
    """nsjail warned `setpriority(0): Permission denied` at every jail start under `nice` (it cannot
    raise a priority inside the jail's user namespace); the jail runs at the worker's level, never
    at a better one."""
    code, out, err = await cli("run", "-", stdin="import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))",
                               wrapper=("nice", "-n", "5"))
    assert code == 0, err
    assert json.loads(out)["stdout"] == "5\n"
    assert "setpriority" not in err and "Permission denied" not in err, err


@pytest.mark.parametrize(("program", "profile"), [("print(1)", "light"),
                                                   ("import sympy\nprint(sympy.factorint(12))", "math")])
async def test_run_starts_only_the_profile_its_program_needs(program: str, profile: str) -> None:
    code, out, err = await cli("run", "-v", "-", stdin=program)
    assert code == 0, err
    assert json.loads(out)["profile"] == profile
    started = re.findall(r"zygote slot\d+-(\w+) ready", err)
    assert started == [profile], err  # one zygote, not one per profile of the image
    code, out, err = await cli("run", "--profile", "nope", "-", stdin="print(1)")
    assert code == 2 and "unknown profile 'nope'" in err and "Traceback" not in err, err


async def test_bad_arguments_get_a_clear_message(tmp_path: Path) -> None:
    code, out, err = await cli("run", str(tmp_path / "missing.py"))
    assert code == 2 and "cannot read" in err and out == ""
    program = tmp_path / "p.py"
    program.write_text("print(1)")
    code, out, err = await cli("run", str(program), "--timeout", "100000")
    assert code == 2 and "cannot exceed the configured limit of 120" in err and "Traceback" not in err


@pytest.mark.parametrize(("program", "status"), [
    ("import sys\nsys.exit(3)", 3), ("import os\nos.kill(os.getpid(), 9)", 137), ("while True: pass", 124),
    ("print(1)", 0)])
async def test_run_exits_with_the_programs_status(program: str, status: int) -> None:
    code, out, err = await cli("run", "-", "--timeout", "1", stdin=program)
    assert code == status, (out, err)
    assert json.loads(out)["status"]


async def test_a_taken_port_is_refused_in_one_line_before_any_jail_starts() -> None:
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        code, out, err = await cli("serve", "--port", str(port))
    assert code == 2 and err.count("\n") == 1 and f"127.0.0.1:{port}" in err and "in use" in err, err
    assert time.monotonic() - t0 < 4  # the pool takes longer than this to start: it never did
    assert "image" not in err and "slot" not in err


async def test_settings_errors_are_one_line_naming_the_setting() -> None:
    code, out, err = await cli("serve", CODEENV_SLOTS="many", CODEENV_TOKEN="short")
    assert code == 2 and err.count("\n") == 1, err
    assert "CODEENV_SLOTS" in err and "CODEENV_TOKEN: String should have at least 16 characters" in err
    assert "short" not in err.replace("should", "")  # a token is never echoed
    code, out, err = await cli("doctor", CODEENV_CLEANUP_TIMEOUT_S="soon")
    assert code == 2 and err.count("\n") == 1 and "CODEENV_CLEANUP_TIMEOUT_S" in err, err
