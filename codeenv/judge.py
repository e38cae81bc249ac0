"""Judging: a submission run against a problem's tests in one call, on the worker.

The submission is prepared once per jail (compiled; for function-call tests its top-level code run
too), and each test runs in a fresh child of that process. Verdicts equal running each test alone:
the preparation's CPU time counts against every test's limit and shows in its figures, a test finds
the state the preparation left and nothing of the tests before it, and with `stop_on_failure` the
result is a sequential run's (every test after the first failure is skipped).

Expected answers never enter the jail: outputs are compared here.

Usage (on a worker, with the slot's zygote locked)::

    outcome = await judge(zygote, code, spec, limits, total_wall_s, restart)
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from codeenv.compare import same_output, same_value
from codeenv.errors import ZygoteDied
from codeenv.models import (
    CompileInfo,
    ErrorInfo,
    JudgeOutcome,
    JudgeSpec,
    JudgeTest,
    LimitName,
    LimitValues,
    TestResult,
    TestStatus,
)
from codeenv.sandbox.zygote_proc import Submission, TestOutcome, ZygoteProcess

#: Bytes of each stream (and of a returned value) a test's result carries; the comparison sees all.
RETURNED_BYTES = 4096
#: Room for an uncaught exception's report, beside a function-call test's returned value.
REPORT_SLACK = 64 << 10

# --- one test's verdict -----------------------------------------------------------------------------


def _text(data: bytes, limit: int = RETURNED_BYTES) -> str:
    return data[:limit].decode("utf-8", "replace")


def _error(report: dict[str, Any] | None) -> ErrorInfo | None:
    info = report.get("error") if report else None
    if not isinstance(info, dict):
        return None
    line = info.get("line")
    return ErrorInfo(type=str(info.get("type", "?"))[:200], message=str(info.get("message", ""))[:4000],
                     line=line if isinstance(line, int) and not isinstance(line, bool) else None)


def verdict(t: TestOutcome, test: JudgeTest, spec: JudgeSpec, limits: LimitValues) -> TestResult:
    """Classify one test from what the worker observed, comparing its output with the expected one."""
    result = TestResult(status=TestStatus.passed, wall_s=round(t.wall_s, 6), cpu_s=round(t.cpu_s, 6),
                        memory_peak_kb=t.memory_peak_kb, stdout=_text(t.stdout), stderr=_text(t.stderr),
                        error=_error(t.report))
    done = t.done
    if done is not None:
        status = done.wait_status
        if status & 0x7F == 0:
            result.exit_code = (status >> 8) & 0xFF
        else:
            result.signal = status & 0x7F

    def fail(status: TestStatus, limit: LimitName | None = None, message: str | None = None) -> TestResult:
        result.status, result.limit, result.message = status, limit, message
        return result

    if t.setup_error is not None:
        return fail(TestStatus.internal_error, message=f"the test could not be set up: {t.setup_error}")
    if t.cpu_exceeded or result.signal == signal.SIGXCPU:
        return fail(TestStatus.timeout, LimitName.cpu, f"over its CPU limit of {limits.cpu_s:g}s "
                                                       "(the submission's preparation included)")
    if t.oom_killed:
        return fail(TestStatus.memory, LimitName.memory, f"over its memory limit of {limits.memory_mb} MiB")
    if t.output_overflow:
        return fail(TestStatus.output_limit, LimitName.output, "its output was larger than the output limit")
    if t.wall_exceeded or (done is not None and done.timed_out):
        return fail(TestStatus.timeout, LimitName.wall, f"over its wall-clock limit of {limits.wall_s:g}s")
    if t.lost is not None or done is None:
        return fail(TestStatus.killed, message=t.lost or "the test ended abnormally")
    if result.signal is not None:
        limit = LimitName.pids if t.pids_limit_hit else None
        return fail(TestStatus.killed, limit, f"killed by signal {result.signal}")
    if result.exit_code:
        return fail(TestStatus.error, message=f"exit code {result.exit_code}")
    if spec.fn_name is None:
        actual = t.stdout.decode("utf-8", "replace")
        ok = same_output(actual, test.expected_stdout or "", spec.compare, spec.float_tol)
        return result if ok else fail(TestStatus.wrong_answer)
    report = t.report or {}
    if "value" in report:
        result.value = json.dumps(report["value"])[:RETURNED_BYTES]
        return result if same_value(report["value"], test.expected, spec.float_tol) else fail(TestStatus.wrong_answer)
    if "unserializable" in report:
        result.value = str(report["unserializable"])[:RETURNED_BYTES]
        return fail(TestStatus.wrong_answer, message="the returned value is not JSON")
    if "too_large" in report:
        return fail(TestStatus.output_limit, LimitName.output, "the returned value is larger than the output limit")
    return fail(TestStatus.error, message="the program ended without the function returning")


# --- a whole submission -----------------------------------------------------------------------------


def _test_input(test: JudgeTest, spec: JudgeSpec) -> tuple[bytes, bytes, int, int]:
    """(args, stdin, output cap, report size) of one test: outputs are read in full up to at least
    twice the expected size."""
    if spec.fn_name is None:
        expected = len((test.expected_stdout or "").encode())
        return b"", (test.stdin or "").encode(), 2 * expected, REPORT_SLACK
    expected = len(json.dumps(test.expected))
    return json.dumps(test.args or []).encode(), b"", 0, 2 * expected + REPORT_SLACK


Restart = Callable[[str], Awaitable[ZygoteProcess]]


async def _alone(zygote: ZygoteProcess, code: bytes, test: JudgeTest, spec: JudgeSpec,
                 limits: LimitValues) -> TestResult:
    """One test run as a plain call, as if it were the only one (for a test that ended the
    submission's process: alone, its parent is the jail's init, which no signal reaches)."""
    args, stdin, cap, report = _test_input(test, spec)
    out = await zygote.run(code, args if spec.fn_name is not None else stdin,
                           limits.model_copy(update={"output_bytes": max(limits.output_bytes, cap)}),
                           call_function=spec.fn_name, report_bytes=max(report, REPORT_SLACK))
    exited = out.exited
    observed = TestOutcome(
        done=exited, stdout=out.stdout, stderr=out.stderr, output_overflow=out.output_overflow,
        report=out.report, setup_error=out.setup_error, oom_killed=out.oom_killed,
        pids_limit_hit=out.pids_limit_hit, wall_exceeded=out.watchdog_fired,
        lost=None if exited is not None else "; ".join(out.notes) or "the test ended abnormally",
        cpu_s=exited.cpu_s if exited is not None else 0.0, wall_s=out.wall_s, memory_peak_kb=out.memory_peak_kb,
    )
    observed.cpu_exceeded = observed.cpu_s > limits.cpu_s
    return verdict(observed, test, spec, limits)


async def judge(zygote: ZygoteProcess, code: bytes, spec: JudgeSpec, limits: LimitValues, total_wall_s: float,
                restart: Restart) -> tuple[JudgeOutcome, str | None]:
    """Run every test of `spec` against `code` in `zygote`'s jail, preparing the submission again
    after a test that ended its process. `restart(reason)` recycles the jail and returns its zygote.

    Returns the outcome and, with the jail's traces wiped and checked, why it must be recycled
    (None if it is ready for the next call). Raises ZygoteDied(started=False) only if nothing ran.
    """
    tests = spec.tests
    results: list[TestResult | None] = [None] * len(tests)
    outcome = JudgeOutcome(total=len(tests))
    mode = "stdin" if spec.fn_name is None else "function"
    deadline = time.monotonic() + total_wall_s
    index = 0
    sub: Submission | None = None
    alone = False  # the test at `index` ended the submission's process: run it again alone

    def finish_all(status: TestStatus, message: str, limit: LimitName | None = None) -> None:
        for i in range(index, len(tests)):
            if results[i] is None:
                results[i] = TestResult(status=status, limit=limit, message=message)

    try:
        while index < len(tests):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                finish_all(TestStatus.timeout, f"not run: the submission's total wall-clock limit of {total_wall_s:g}s "
                                               "was spent", LimitName.wall)
                break
            if sub is not None:  # a restart: the last process ended; the jail must be clean first
                await sub.close()
                sub = None
                problem = "the zygote is gone" if zygote.dead else await zygote.finish()
                if problem is not None:
                    zygote = await restart(problem)
            if alone:
                alone = False
                try:
                    results[index] = result = await _alone(zygote, code, tests[index], spec, limits)
                except ZygoteDied:
                    zygote = await restart("its zygote died")
                    continue  # not started: run it again
                problem = "the zygote is gone" if zygote.dead else await zygote.finish()
                if problem is not None:
                    zygote = await restart(problem)
                index += 1
                if spec.stop_on_failure and result.status is not TestStatus.passed:
                    finish_all(TestStatus.skipped, "not run: an earlier test failed (stop_on_failure)")
                    break
                continue
            try:
                sub = await zygote.prepare(code, mode, spec.fn_name, limits, remaining)
            except ZygoteDied:
                if outcome.prepared == 0:
                    raise
                zygote = await restart("its zygote died")
                sub = None
                continue
            outcome.prepared += 1
            prepared = sub.prepared
            if prepared is None:  # the preparation itself failed: as it would before every test alone
                if mode == "function":  # e.g. top-level code that kills itself: each test shows it
                    mode = "function_inline"
                    continue
                lost = sub.lost or ""
                if lost == "cpu":
                    finish_all(TestStatus.timeout, "the submission's preparation ran over the CPU limit",
                               LimitName.cpu)
                elif lost == "wall":
                    finish_all(TestStatus.timeout, "the submission's preparation ran over the wall limit",
                               LimitName.wall)
                else:
                    finish_all(TestStatus.internal_error, f"the submission could not be prepared: {lost}")
                break
            if "compile_error" in prepared:
                outcome.compile = CompileInfo(status="error", stderr=str(prepared.get("stderr", ""))[:8000])
                finish_all(TestStatus.skipped, "not run: the code does not compile")
                break
            if "unshared" in prepared:
                mode = "function_inline"  # each test runs the top-level code itself
                continue
            outcome.compile = CompileInfo(status="ok")
            while index < len(tests) and sub.alive:
                if time.monotonic() > deadline:
                    break
                args, stdin, cap, report = _test_input(tests[index], spec)
                observed = await sub.test(index, args, stdin, max(limits.output_bytes, cap), report)
                if observed.lost is not None and not (observed.cpu_exceeded or observed.wall_exceeded):
                    alone = True
                    break
                if observed.done is not None and not observed.done.clean:
                    sub.lost = "the work dir could not be wiped after a test"
                result = verdict(observed, tests[index], spec, limits)
                results[index] = result
                index += 1
                if spec.stop_on_failure and result.status is not TestStatus.passed:
                    finish_all(TestStatus.skipped, "not run: an earlier test failed (stop_on_failure)")
                    index = len(tests)
    except BaseException:
        if sub is not None:
            sub.abandon()  # e.g. cancelled: the pool recycles the jail
        raise
    problem = None
    if sub is not None:
        await sub.close()
        problem = "the zygote is gone" if zygote.dead else await zygote.finish()
    outcome.tests = [r if r is not None else TestResult(status=TestStatus.internal_error, message="not run")
                     for r in results]
    outcome.passed = sum(r.status is TestStatus.passed for r in outcome.tests)
    return outcome, problem
