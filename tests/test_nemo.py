"""NeMo-Skills' sandbox API (`codeenv/api/nemo.py`), with the wire shapes read in their client
(`nemo_skills/code_execution/sandbox.py`: what it sends, how it reads `new_session_created`), their
server (`local_sandbox/local_sandbox_server.py`: the answers, the texts) and their golden outputs
(`tests/test_code_execution.py`). NeMo-Skills is not on PyPI: nothing of it is imported here; the
shapes are written out. In embedded and Redis mode (the `client` fixture), and a differential test
against the same IPython run on the host."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import uuid
from typing import Any

import httpx
import pytest

from codeenv.api.nemo import DRIVER

pytestmark = pytest.mark.jail


def body(code: str, language: str = "ipython", timeout: float = 10.0, std_input: str = "",
         max_output_characters: int = 1000, traceback_verbosity: str = "Plain") -> dict[str, Any]:
    """What their client's `_prepare_request` sends."""
    return {"generated_code": code, "std_input": std_input, "timeout": timeout, "language": language,
            "max_output_characters": max_output_characters, "traceback_verbosity": traceback_verbosity}


async def run(client: httpx.AsyncClient, code: str, session: str | None = None, **options: Any) -> dict[str, Any]:
    r = await client.post("/execute", json=body(code, **options),
                          headers={"X-Session-ID": session} if session is not None else {}, timeout=60)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def without_new(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k != "new_session_created"}


async def test_their_golden_outputs(client: httpx.AsyncClient) -> None:
    sid = uuid.uuid4().hex
    first = await run(client, "a = 2", sid)
    assert first == {"process_status": "completed", "stderr": "", "stdout": "", "new_session_created": True}
    for language in ("python", "python3", "pypy3"):
        assert await run(client, "a = 2", language=language) == {"process_status": "completed", "stderr": "",
                                                                  "stdout": ""}
    assert without_new(await run(client, "1 / 0", sid)) == {
        "process_status": "error", "stderr": "",
        "stdout": "Traceback (most recent call last):\n    1 / 0\nZeroDivisionError: division by zero\n"}
    assert await run(client, "1 / 0", language="python") == {
        "process_status": "completed", "stdout": "",
        "stderr": 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
                  "ZeroDivisionError: division by zero\n"}
    assert without_new(await run(client, "a = 2\n b = 3", sid)) == {
        "process_status": "error", "stderr": "", "stdout": "    b = 3\n    ^\nIndentationError: unexpected indent\n"}
    other = uuid.uuid4().hex
    assert (await run(client, "\n    a = 1\n    a\n    ", other))["stdout"] == "1\n"
    again = await run(client, "a + 5", other)
    assert again["stdout"] == "6\n" and again["new_session_created"] is False
    for language in ("ipython", "python", "pypy3"):
        slow = await run(client, 'import time\ntime.sleep(3)\nprint("done")', sid if language == "ipython" else None,
                         language=language, timeout=1)
        assert without_new(slow) == {"process_status": "timeout", "stdout": "",
                                     "stderr": "Execution timed out after 1 seconds\n"}
    assert (await run(client, "import time; time.sleep(3)", sid, timeout=0.5))["stderr"] == \
        "Execution timed out after 0.5 seconds\n"
    for language in ("python", "pypy3"):
        assert (await run(client, 'print(input("something "))', language=language, std_input="new"))[
            "stdout"] == "something new\n"
    cut = await run(client, "print('x' * 50)", sid, max_output_characters=10)
    assert cut["stdout"] == "x" * 10 + "<output cut>"
    for language in ("shell", "lean4"):
        refused = await run(client, "echo hello world", language=language)
        assert refused["process_status"] == "error" and language in refused["stderr"], refused


async def test_a_timed_out_cell_is_rolled_back_and_nothing_is_replayed(client: httpx.AsyncClient) -> None:
    """Their client replays its history when `new_session_created` is true: after a timeout here it is
    false, and the state is intact (their server restarts the shell and answers true twice)."""
    sid = uuid.uuid4().hex
    await run(client, "x = [1]", sid)
    stopped = await run(client, "x.append(2); print('so far', x); import time; time.sleep(5)", sid, timeout=1)
    assert without_new(stopped) == {"process_status": "timeout", "stdout": "so far [1, 2]\n",  # what it printed
                                    "stderr": "Execution timed out after 1 seconds\n"}
    long = await run(client, "print('y' * 50); import time; time.sleep(5)", sid, timeout=1, max_output_characters=10)
    assert long["stdout"] == "y" * 10 + "<output cut>", long
    after = await run(client, "x", sid)
    assert after == {"process_status": "completed", "stdout": "[1]\n", "stderr": "", "new_session_created": False}
    # Their test_state_restoration's errored cell: an exception keeps what ran before it, as IPython does.
    err = await run(client, 'print("ERR"); a = 0; raise ValueError()', sid)
    assert err["process_status"] == "error" and err["stdout"].startswith("ERR\n") and not err["new_session_created"]
    assert (await run(client, "a", sid))["stdout"] == "0\n"


async def test_sessions_belong_to_their_caller_and_end_as_their_server_says(client: httpx.AsyncClient) -> None:
    sid = f"1-{uuid.uuid4().hex[:8]}"  # one id, two callers (the pool is shared by the tests of both modes)
    mine = {"X-Codeenv-Session-Key": "the-first-callers-own-key"}
    theirs = {"X-Codeenv-Session-Key": "the-second-callers-own-key"}
    r = await client.post("/execute", json=body("v = 'mine'"), headers={"X-Session-ID": sid, **mine})
    assert r.json()["new_session_created"] is True
    r = await client.post("/execute", json=body("'v' in dir()"), headers={"X-Session-ID": sid, **theirs})
    assert r.json()["stdout"] == "False\n" and r.json()["new_session_created"] is True, r.json()  # state lost
    listed = (await client.get("/sessions", headers=mine)).json()
    assert listed["backend"] == "ipython" and sid in listed["sessions"]
    assert listed["sessions"][sid]["alive"] is True and listed["sessions"][sid]["backend"] == "ipython"
    gone = await client.delete(f"/sessions/{sid}", headers=mine)
    assert gone.status_code == 200 and gone.json() == {"message": f"IPython session {sid} deleted successfully"}
    missing = await client.delete(f"/sessions/{sid}", headers=mine)
    assert missing.status_code == 404 and missing.json() == {"error": f"IPython session {sid} not found"}
    r = await client.post("/execute", json=body("'v' in dir()"), headers={"X-Session-ID": sid, **mine})
    assert r.json()["stdout"] == "False\n" and r.json()["new_session_created"] is True  # its state was lost
    r = await client.post("/execute", json=body("v"), headers={"X-Session-ID": sid, **theirs})
    assert r.json()["process_status"] == "error" and r.json()["new_session_created"] is False
    no_header = await client.post("/execute", json=body("1"))
    assert no_header.status_code == 400
    assert no_header.json() == {"error": "X-Session-ID header required for ipython sessions"}
    assert (await client.get("/health")).status_code == 200
    assert (await run(client, "!echo hi", uuid.uuid4().hex))["process_status"] == "error"  # no shell in a jail


#: Cells for the differential test, each run once per traceback mode in one session.
CELLS = [
    "a = 1", "a", "a + 1;", "_", "__", "b = [i * i for i in range(5)]\nb", "print('out')\nb[-1]",
    "import math\nmath.sqrt(2)", "def f(x):\n    return 1 / x\nf(2)", "f(0)", "1 / 0", "undefined_name",
    "x = (", "if True:\nprint(1)", "  indented = 3\n  indented", "'é✓ unicode ñ'", "print('é✓', end='')",
    "%precision 3\n3.14159265", "import sys\nprint('err', file=sys.stderr)", "raise ValueError('bad')",
    "class A:\n    def __repr__(self):\n        return 'A()'\nA()", "{'k': [1, 2, (3, 4)]}", "None", "x = 1; x",
    "for i in range(3):\n    print(i)", "assert 1 == 2, 'no'", "import json\njson.loads('{')", "len(_)",
    "raise SystemExit(3)", "2 ** 100", "print(*range(3), sep='-')", "[][0]",
    "def g(n):\n    return g(n - 1) if n else 1 / 0\ng(3)", "%who_ls", "1;",
]


#: An object's address (Verbose tracebacks show the values of a frame's names): one process's, not another's.
ADDRESS = re.compile(r"0x[0-9a-f]{6,}")


#: Where the image keeps the standard library and packages (a traceback into them names the path).
IMAGE_PATHS = {"stdlib": "/usr/local/lib/python3.12", "purelib": "/usr/local/lib/python3.12/site-packages"}


def host_reports(cells: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The same driver and the same IPython on the host, one process for all the cells; the host's
    library paths written as the image's."""
    script = (DRIVER + "\nimport json, sys\nfor code, mode in json.loads(sys.stdin.read()):\n"
              "    _codeenv_nemo(code, mode, 100000)\n    sys.stdout.write('\\n')\n")
    out = subprocess.run([sys.executable, "-c", script], input=json.dumps(cells), capture_output=True, text=True,
                         timeout=120, cwd="/tmp", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TERM": "dumb"})
    reports = [json.loads(line.split("\x00codeenv-nemo\x00")[1]) for line in out.stdout.split("\n")
               if "\x00codeenv-nemo\x00" in line]
    assert len(reports) == len(cells), out.stderr[-3000:]
    paths = sysconfig.get_paths()
    for report in reports:
        for stream in ("stdout", "stderr"):
            for name in ("purelib", "stdlib"):  # the longer first
                report[stream] = report[stream].replace(paths[name], IMAGE_PATHS[name])
    return reports


async def test_the_same_cells_answer_as_the_same_ipython_on_the_host(client: httpx.AsyncClient) -> None:
    cells = [(code, mode) for mode in ("Plain", "Context", "Verbose", "Minimal") for code in CELLS]
    assert len(cells) >= 100
    expected = host_reports(cells)
    sid = uuid.uuid4().hex
    for (code, mode), want in zip(cells, expected, strict=True):
        got = await run(client, code, sid, traceback_verbosity=mode, max_output_characters=100_000)
        got = {k: ADDRESS.sub("0x?", v) if isinstance(v, str) else v for k, v in without_new(got).items()}
        assert got == {"process_status": "error" if want["error"] else "completed",
                       "stdout": ADDRESS.sub("0x?", want["stdout"]), "stderr": ADDRESS.sub("0x?", want["stderr"])}, \
            (code, mode)
