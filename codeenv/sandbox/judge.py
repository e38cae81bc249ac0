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

from codeenv.compare import same_output, same_value
from codeenv.errors import ZygoteDied
from codeenv.models import (
    CompileInfo,
    JudgeOutcome,
    JudgeSpec,
    JudgeTest,
    LimitName,
    LimitValues,
    TestResult,
    TestStatus,
    printable,
)
from codeenv.sandbox.verdict import error_info
from codeenv.sandbox.zygote_proc import Submission, TestOutcome, ZygoteProcess

#: Bytes of each stream (and of a returned value) a test's result carries; the comparison sees all.
RETURNED_BYTES = 4096
#: Room for an uncaught exception's report, beside a function-call test's returned value.
REPORT_SLACK = 64 << 10

# --- one test's verdict -----------------------------------------------------------------------------


def _text(data: bytes, limit: int = RETURNED_BYTES) -> str:
    return data[:limit].decode("utf-8", "replace")


def verdict(t: TestOutcome, test: JudgeTest, spec: JudgeSpec, limits: LimitValues) -> TestResult:
    """Classify one test from what the worker observed, comparing its output with the expected one.
    Nothing a program returns makes this raise: a comparison that fails is the test's wrong answer."""
    result = TestResult(status=TestStatus.passed, wall_s=round(t.wall_s, 6), cpu_s=round(t.cpu_s, 6),
                        memory_peak_kb=t.memory_peak_kb, stdout=_text(t.stdout), stderr=_text(t.stderr),
                        error=error_info(t.report))
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
        return fail(TestStatus.internal_error, message=f"the test could not be set up: {printable(t.setup_error)}")
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
        return fail(TestStatus.killed, message=printable(t.lost or "the test ended abnormally"))
    if result.signal is not None:
        limit = LimitName.pids if t.pids_limit_hit else None
        return fail(TestStatus.killed, limit, f"killed by signal {result.signal}")
    if result.exit_code:
        return fail(TestStatus.error, message=f"exit code {result.exit_code}")
    if spec.fn_name is None:
        actual = t.stdout.decode("utf-8", "replace")
        try:
            ok = same_output(actual, test.expected_stdout or "", spec.compare, spec.float_tol)
        except Exception as exc:  # e.g. too deep or too large to compare: the program's doing
            return fail(TestStatus.wrong_answer, message=f"its output could not be compared: {type(exc).__name__}")
        return result if ok else fail(TestStatus.wrong_answer)
    report = t.report or {}
    if "value" in report:
        try:
            result.value = json.dumps(report["value"])[:RETURNED_BYTES]
            ok = same_value(report["value"], test.expected, spec.float_tol)
        except Exception as exc:  # e.g. 10**400 against a float, or nested past the recursion limit
            return fail(TestStatus.wrong_answer,
                        message=f"the returned value could not be compared: {type(exc).__name__}")
        return result if ok else fail(TestStatus.wrong_answer)
    if "unserializable" in report:
        result.value = printable(str(report["unserializable"]))[:RETURNED_BYTES]
        return fail(TestStatus.wrong_answer, message="the returned value is not JSON")
    if "too_large" in report:
        return fail(TestStatus.output_limit, LimitName.output, "the returned value is larger than the output limit")
    return fail(TestStatus.error, message="the program ended without the function returning")


# --- a whole submission -----------------------------------------------------------------------------


def _test_input(test: JudgeTest, spec: JudgeSpec) -> tuple[bytes, bytes]:
    """(arguments, stdin) of one test: all that enters the jail of it."""
    if spec.fn_name is None:
        return b"", (test.stdin or "").encode()
    return json.dumps(test.args or []).encode(), b""


def report_bytes(limits: LimitValues) -> int:
    """The size of every test's report memfd, which a test can observe: from the limits alone (a
    returned value's JSON may be as large as the output limit), never from an expected answer."""
    return limits.output_bytes + REPORT_SLACK


Restart = Callable[[str], Awaitable[ZygoteProcess]]


async def _alone(zygote: ZygoteProcess, code: bytes, test: JudgeTest, spec: JudgeSpec,
                 limits: LimitValues) -> TestOutcome:
    """One test run as a plain call, as if it were the only one (for a test that ended the
    submission's process: alone, its parent is the jail's init, which no signal reaches)."""
    args, stdin = _test_input(test, spec)
    out = await zygote.run(code, args if spec.fn_name is not None else stdin, limits,
                           call_function=spec.fn_name, report_bytes=report_bytes(limits))
    exited = out.exited
    observed = TestOutcome(
        done=exited, stdout=out.stdout, stderr=out.stderr, output_overflow=out.output_overflow,
        report=out.report, setup_error=out.setup_error, oom_killed=out.oom_killed,
        pids_limit_hit=out.pids_limit_hit, wall_exceeded=out.watchdog_fired,
        lost=None if exited is not None else "; ".join(out.notes) or "the test ended abnormally",
        cpu_s=exited.cpu_s if exited is not None else 0.0, wall_s=out.wall_s, memory_peak_kb=out.memory_peak_kb,
    )
    observed.cpu_exceeded = observed.cpu_s > limits.cpu_s
    return observed


async def judge(zygote: ZygoteProcess, code: bytes, spec: JudgeSpec, limits: LimitValues, total_wall_s: float,
                restart: Restart) -> tuple[JudgeOutcome, str | None]:
    """Run every test of `spec` against `code` in `zygote`'s jail, preparing the submission again
    after a test that ended its process. `restart(reason)` recycles the jail and returns its zygote.

    Returns the outcome and, with the jail's traces wiped and checked, why it must be recycled
    (None if it is ready for the next call). Raises ZygoteDied(started=False) only if nothing ran.
    """
    tests = spec.tests
    results: list[TestResult | None] = [None] * len(tests)
    # Compared after the last test ran (a comparison's time must not tell the next test anything of the
    # expected answer), except with stop_on_failure, where a failure decides what runs next.
    observations: dict[int, TestOutcome] = {}
    outcome = JudgeOutcome(total=len(tests))
    mode = "stdin" if spec.fn_name is None else "function"
    deadline = time.monotonic() + total_wall_s
    index = 0
    sub: Submission | None = None
    alone = False  # the test at `index` ended the submission's process: run it again alone

    def settle(i: int, observed: TestOutcome) -> bool:
        """Keep test i's observation; whether the run goes on after it."""
        if not spec.stop_on_failure:
            observations[i] = observed
            return True
        results[i] = result = verdict(observed, tests[i], spec, limits)
        if result.status is TestStatus.passed:
            return True
        finish_all(TestStatus.skipped, "not run: an earlier test failed (stop_on_failure)")
        return False

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
                    observed = await _alone(zygote, code, tests[index], spec, limits)
                except ZygoteDied:
                    zygote = await restart("its zygote died")
                    continue  # not started: run it again
                problem = "the zygote is gone" if zygote.dead else await zygote.finish()
                if problem is not None:
                    zygote = await restart(problem)
                index += 1
                if not settle(index - 1, observed):
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
                args, stdin = _test_input(tests[index], spec)
                observed = await sub.test(index, args, stdin, limits.output_bytes, report_bytes(limits))
                if observed.lost is not None and not (observed.cpu_exceeded or observed.wall_exceeded):
                    alone = True
                    break
                if observed.done is not None and not observed.done.clean:
                    sub.lost = "the work dir could not be wiped after a test"
                index += 1
                if not settle(index - 1, observed):
                    index = len(tests)
    except BaseException:
        if sub is not None:
            sub.abandon()  # e.g. cancelled: the pool recycles the jail
        raise
    problem = None
    if sub is not None:
        await sub.close()
        problem = "the zygote is gone" if zygote.dead else await zygote.finish()
    for i, observed in observations.items():
        results[i] = verdict(observed, tests[i], spec, limits)
    outcome.tests = [r if r is not None else TestResult(status=TestStatus.internal_error, message="not run")
                     for r in results]
    outcome.passed = sum(r.status is TestStatus.passed for r in outcome.tests)
    return outcome, problem
