# ruff: noqa: E501  (programs and their answers are data)
"""Rewards you can trust: the reward-hack corpus (tests/reward_hacks.py) against every reward path of a
real service over real HTTP; an observer that must see nothing of the expected answers; one hostile
program beside honest ones on every batch and stream endpoint; parity of judged verdicts with each test
run alone in a fresh interpreter (tests/parity.py)."""

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
from codeenv.bench.apis import CODE_COMPARE
from codeenv.bench.baseline import BaselineQueue
from codeenv.bench.workload import load_workload
from codeenv.client import AsyncClient
from codeenv.models import JudgeRequest, JudgeResult, JudgeTest
from codeenv.rl import ToolLedger
from codeenv.settings import GatewaySettings, SandboxSettings
from tests.conftest import pool_app, serving
from tests.parity import PRIVATE, Submission, run_alone
from tests.reward_hacks import (
    ADD_TESTS,
    CHECKER,
    EVEN_TESTS,
    HACKS,
    INTERACTOR,
    PATHS,
    ROUTER_CASES,
    Hack,
)
from tests.test_compat import HOSTILE as COMPAT_HOSTILE
from tests.test_routers import REWARD_SCRIPT, as_routed_sandbox

pytestmark = [pytest.mark.jail]

SERVICE_FAULTS = {"internal_error", "overloaded", "rejected", "SandboxError"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(pool: SlotPool, cpp_toolchain: None) -> AsyncIterator[str]:
    async with serving(pool_app(pool, judge_max_tests=64, judge_max_bytes=8 << 20, max_body_bytes=16 << 20)) as url:
        yield url


async def post(c: httpx.AsyncClient, path: str, body: Any) -> Any:
    r = await c.post(path, json=body)
    assert r.status_code == 200, f"{path}: HTTP {r.status_code}: {r.text[:500]}"
    return json.loads(r.content)  # strict: the answer is valid JSON (and UTF-8)


def judge_body(hack: Hack) -> dict[str, Any]:
    function = hack.path == "judge_function"
    body: dict[str, Any] = {"code": hack.code, "compare": hack.compare, "language": hack.language,
                            "tests": hack.tests or (EVEN_TESTS if function else ADD_TESTS)}
    if function:
        body["fn_name"] = hack.fn_name or "is_even"
    if hack.float_tol is not None:
        body["float_tol"] = hack.float_tol
    return body


async def verdict(c: httpx.AsyncClient, hack: Hack) -> str:
    """The verdict `hack` gets on its path, in that path's own terms (see tests/reward_hacks.py)."""
    if hack.path in ("judge_stdin", "judge_function", "judge_checker", "judge_interactive"):
        body = judge_body(hack)
        if hack.path == "judge_checker":
            body["checker"] = {"type": "testlib", "code": CHECKER}
        if hack.path == "judge_interactive":
            body["interactor"] = {"code": INTERACTOR, "language": "python"}
        r = await post(c, "/v1/judge", body)
        faults = [t for t in r["tests"] if t["status"] == "internal_error"]
        assert not faults and r["status"] not in SERVICE_FAULTS, r
        return f"{r['passed']}/{r['total']} {r['status']}"
    if hack.path.startswith("run_code"):
        code = f"{hack.code}\n\n{hack.asserts}" if hack.path == "run_code_assert" else hack.code
        language = "pytest" if hack.path == "run_code_pytest" else hack.language
        r = await post(c, "/run_code", {"code": code, "language": language,
                                        "run_timeout": 20})
        assert r["status"] != "SandboxError", r
        return str(r["status"])
    if hack.path == "code_judge":
        [test] = hack.tests
        r = await post(c, "/judge", {"type": hack.language, "solution": hack.code, "input": test["stdin"],
                                     "expected_output": test["expected_stdout"]})
        assert r["reason"] not in ("internal_error", "queue_timeout"), r
        return "success" if r["success"] else "fail"
    if hack.path == "router":
        script = REWARD_SCRIPT.format(code=json.dumps(hack.code), cases=json.dumps(json.dumps(ROUTER_CASES)))
        [answer] = await post(c, "/execute_batch", {"scripts": [script], "languages": ["python"], "timeout": 30,
                                                    "request_timeout": 28})
        execution = as_routed_sandbox(answer)
        try:
            return str(float(execution.text))  # as open-r1 reads it
        except (TypeError, ValueError):
            return "none"
    assert hack.path == "tool"
    ledger = ToolLedger()
    async with AsyncClient(str(c.base_url)) as client:
        result = await client.run(hack.code, ledger=ledger, display_last=True)
    assert ledger.service_faults == 0, result
    return "tool_error" if ledger.tool_errors else "ok"


def test_the_corpus_covers_every_path() -> None:
    assert {h.path for h in HACKS} == set(PATHS)
    assert len({(h.path, h.name, h.language) for h in HACKS}) == len(HACKS)


@pytest.mark.slow
async def test_every_hack_gets_its_verdict(server: str) -> None:
    sem = asyncio.Semaphore(4)

    async def one(c: httpx.AsyncClient, hack: Hack) -> str | None:
        async with sem:
            try:
                got = await verdict(c, hack)
            except Exception as exc:  # a service fault, or an answer that is no answer
                got = f"fault: {str(exc)[:300]}"
        return None if got == hack.must else f"{hack.path}: {hack.name}: got {got!r}, must get {hack.must!r}"

    async with httpx.AsyncClient(base_url=server, timeout=120) as c:
        wrong = [w for w in await asyncio.gather(*(one(c, h) for h in HACKS)) if w]
    assert not wrong, "\n".join(wrong)


# --- an observer sees nothing of the expected answers --------------------------------------------------

#: Records everything a test can see of itself; the hash of the record, and the record itself, come back.
OBSERVE = r"""
import hashlib, json, mmap, os, resource, sys

def observe():
    seen = {}
    maps, f = [], sys._getframe()
    while f is not None:
        maps += [len(v) for v in f.f_locals.values() if isinstance(v, mmap.mmap)]
        f = f.f_back
    seen["mmaps"] = maps
    seen["rlimits"] = {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}
    fds = {}
    for fd in sorted(map(int, os.listdir("/proc/self/fd"))):
        try:
            st = os.fstat(fd)
            fds[fd] = [os.readlink(f"/proc/self/fd/{fd}").split("[")[0], st.st_size, st.st_mode, st.st_blocks]
        except OSError:
            pass
    seen["fds"] = fds
    for name in ("status", "limits", "maps", "mountinfo", "cgroup", "environ", "cmdline"):
        try:
            text = open(f"/proc/self/{name}", "rb").read()
        except OSError as exc:
            text = repr(exc).encode()
        if name == "status":  # what changes from run to run whatever the answers: pids, memory figures
            text = b"\n".join(l for l in text.split(b"\n") if not l.startswith((b"Pid", b"PPid", b"Tgid", b"NSpid",
                              b"NStgid", b"NSpgid", b"NSsid", b"Vm", b"Rss", b"Hugetlb", b"voluntary", b"nonvoluntary",
                              b"Sig", b"Threads")))
        if name == "maps":  # addresses are randomised, and with them the order; what is mapped is not
            text = b"\n".join(sorted(l.split(None, 5)[-1] for l in text.split(b"\n") if len(l.split(None, 5)) > 5))
        if name == "mountinfo":  # mount ids and device numbers are the host's (a fresh work dir gets new ones)
            text = b"\n".join(b" ".join(l.split()[3:]) for l in text.split(b"\n"))
        seen[name] = hashlib.sha256(text).hexdigest()[:16]
    seen["env"] = sorted(os.environ)
    seen["cwd"] = sorted(os.listdir("."))
    seen["tmp"] = sorted(os.listdir("/tmp"))
    seen["stdin"] = len(sys.stdin.buffer.read()) if not sys.stdin.closed else None
    return json.dumps(seen, sort_keys=True)
"""


def observer(alone: bool, stdin: bool) -> str:
    kill = "    import signal\n    if os.getppid() != 1:\n        os.kill(os.getppid(), signal.SIGKILL)\n" if alone else ""
    if stdin:
        return OBSERVE + f"def main():\n{kill}    print(observe())\nmain()\n"
    return OBSERVE + f"def f(n):\n{kill}    return observe()\n"


VARIANTS = [(True, False), (1, 10**100), ("", "x" * (1 << 20))]


@pytest.mark.slow
@pytest.mark.parametrize("alone", [False, True], ids=["prepared", "run-alone"])
@pytest.mark.parametrize("stdin", [False, True], ids=["function", "stdin"])
async def test_an_observer_sees_nothing_of_the_expected_answers(pool: SlotPool, alone: bool, stdin: bool) -> None:
    """Byte-identical observations under two test sets that differ only in their expected values, on
    one slot (another slot's jail differs in ways no answer shapes: its cgroup path, its mounts)."""
    code = observer(alone, stdin)
    settings = GatewaySettings(slots=2, judge_max_bytes=8 << 20)
    seen: list[list[str]] = []
    for side in (0, 1):
        if stdin:
            request = JudgeRequest(code=code, tests=[JudgeTest(stdin="7", expected_stdout=json.dumps(v[side]))
                                                     for v in VARIANTS])
        else:
            request = JudgeRequest(code=code, fn_name="f", tests=[JudgeTest(args=[7], expected=v[side])
                                                                  for v in VARIANTS])
        r = JudgeResult.from_call(await pool.run(judge_call(request, settings), slot_index=0))
        assert r.passed == 0 and all(t.status == "wrong_answer" for t in r.tests), r
        seen.append([(t.stdout if stdin else t.value) or "" for t in r.tests])
    for left, right in zip(*seen, strict=True):
        assert left == right, f"an observation differs with the expected answer:\n{left}\n{right}"
    record = json.loads(seen[0][0])  # the observer prints, or returns, its record as JSON text
    assert record["mmaps"] and record["stdin"] == (1 if stdin else 0), record  # it saw what it looked for


# --- one program never takes its neighbours' results with it -------------------------------------------

SURROGATE = "raise ValueError(chr(0xd800) + 'x')"
HONEST = "print(6 * 7)"


async def test_a_hostile_call_leaves_its_neighbours_alone(server: str) -> None:
    judged = [{"code": HONEST, "tests": [{"stdin": "", "expected_stdout": "42"}]},
              {"code": SURROGATE, "tests": [{"stdin": "", "expected_stdout": "42"}]},
              {"code": "def f():\n    return 10**400", "fn_name": "f", "tests": [{"args": [], "expected": 0.5}]}] * 2
    async with httpx.AsyncClient(base_url=server, timeout=120) as c:
        r = await post(c, "/v1/judge/batch", {"requests": judged})
        assert [x["status"] for x in r["results"]] == ["passed", "failed", "failed"] * 2, r
        assert "\ufffd" in r["results"][1]["tests"][0]["error"]["message"]
        async with c.stream("POST", "/v1/judge/stream", json={"requests": judged}) as stream:
            lines = [json.loads(line)["result"] async for line in stream.aiter_lines() if '"result"' in line]
        assert sorted(x["status"] for x in lines) == sorted(["passed", "failed", "failed"] * 2), lines
        calls = [{"code": HONEST}, {"code": SURROGATE}, {"code": "class R:\n    def __repr__(self): return chr(0xd800)\nR()",
                                                         "display_last": True}]
        r = await post(c, "/v1/execute/batch", {"requests": calls})
        assert [x["status"] for x in r["results"]] == ["ok", "error", "ok"], r
        assert r["results"][0]["stdout"] == "42\n" and r["results"][2]["value"] == "\ufffd"
        async with c.stream("POST", "/v1/execute/stream", json={"requests": calls}) as stream:
            lines = [json.loads(line)["result"] async for line in stream.aiter_lines() if '"result"' in line]
        assert sorted(x["status"] for x in lines) == ["error", "ok", "ok"], lines
        answers = await post(c, "/execute_batch", {"scripts": ["6 * 7", SURROGATE, "1 / 2"], "languages": ["python"] * 3,
                                                   "timeout": 30, "request_timeout": 28})
        assert [as_routed_sandbox(a).text for a in answers] == ["42", None, "0.5"], answers
        assert as_routed_sandbox(answers[1]).error is not None
        morph = await post(c, "/morph/execute_batch", {"scripts": ["6 * 7", SURROGATE], "languages": ["python"] * 2,
                                                       "timeout": 30, "request_timeout": 28})
        assert morph[0]["text"] == "42", morph
        batch = await post(c, "/run/batch", {"type": "batch", "submissions": [
            {"type": "python", "solution": HONEST, "expected_output": "42"},
            {"type": "python", "solution": SURROGATE, "expected_output": "42"}]})
        assert [x["success"] for x in batch["results"]] == [True, False], batch
        fused = await post(c, "/run_code", {"code": SURROGATE, "language": "python"})
        assert fused["status"] == "Failed" and "ValueError" in fused["run_result"]["stderr"]


# --- parity: a judged verdict equals each test run alone in a fresh interpreter -----------------------

#: Tests of each shipped code-workload submission compared (its first ones and its largest, last one).
WORKLOAD_TESTS = 4


@pytest.mark.slow
async def test_judged_verdicts_equal_each_test_run_alone(server: str) -> None:
    subs = list(PRIVATE)
    for call in load_workload("code"):
        assert call.tests is not None
        if call.language != "python":  # the reference runs Python (C++'s verdicts: tests/test_cpp.py)
            continue
        chosen = [*call.tests[:WORKLOAD_TESTS], call.tests[-1]]
        subs.append(Submission(f"code workload: {call.tag}", call.code, cpu_s=call.timeout or 2.0,
                               tests=[{"stdin": t.stdin, "expected_stdout": t.expected_stdout} for t in chosen]))
    reference = BaselineQueue("naive-jail", SandboxSettings(slots=2))
    await reference.start()
    try:
        async with httpx.AsyncClient(base_url=server, timeout=300) as c:

            async def both(sub: Submission) -> str | None:
                body: dict[str, Any] = {"code": sub.code, "tests": sub.tests, "compare": CODE_COMPARE.value,
                                        "limits": {"cpu_s": sub.cpu_s}}
                if sub.fn_name is not None:
                    body["fn_name"] = sub.fn_name
                judged, alone = await asyncio.gather(post(c, "/v1/judge", body),
                                                     run_alone(reference, sub, CODE_COMPARE))
                got = [t["status"] for t in judged["tests"]]
                if judged["status"] == "compile_error":  # the judge says so once, and runs no test (README)
                    got = ["error" if g == "skipped" else g for g in got]
                return None if got == alone else f"{sub.name}: judged {got}, alone {alone}"

            differ = [d for d in await asyncio.gather(*(both(s) for s in subs)) if d]
    finally:
        await reference.close()
    assert not differ, "\n".join(differ)


@pytest.mark.slow
async def test_no_hostile_program_is_a_service_fault(server: str) -> None:
    """Every hostile program we have, judged and run through SandboxFusion: never internal_error."""
    codes = sorted({h.code for h in HACKS} | {code for code, _ in COMPAT_HOSTILE})
    limits = {"cpu_s": 1, "wall_s": 3, "memory_mb": 256}
    sem = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=server, timeout=120) as c:

        async def both(code: str) -> list[str]:
            async with sem:
                judged = await post(c, "/v1/judge", {"code": code, "limits": limits,
                                                     "tests": [{"stdin": "1 2", "expected_stdout": "3"}] * 2})
                fused = await post(c, "/run_code", {"code": code, "language": "python", "run_timeout": 3,
                                                    "memory_limit_MB": 256})
            faults = [f"judge: {judged}"] if judged["status"] in SERVICE_FAULTS or any(
                t["status"] == "internal_error" for t in judged["tests"]) else []
            return faults + ([f"run_code: {fused}"] if fused["status"] == "SandboxError" else [])

        faults = [f for fs in await asyncio.gather(*(both(code) for code in codes)) for f in fs]
    assert not faults, "\n".join(f[:500] for f in faults)
