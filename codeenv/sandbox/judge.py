"""Judging: a submission run against a problem's tests in one call, on the worker.

The submission is prepared once per jail (compiled; for function-call tests its top-level code run
too), and each test runs in a fresh child of that process. Verdicts equal running each test alone:
the preparation's CPU time counts against every test's limit and shows in its figures, a test finds
the state the preparation left and nothing of the tests before it, and with `stop_on_failure` the
result is a sequential run's (every test after the first failure is skipped).

Expected answers never enter the jail: outputs are compared here, or by the problem's checker in a
jail of its own (`check`, see checker.py) once the test's process is gone.

Usage (on a worker, with the slot's zygote locked)::

    outcome = await judge(zygote, code, spec, limits, total_wall_s, restart, check)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from codeenv.errors import ZygoteDied
from codeenv.models import (
    CompileInfo,
    JudgeOutcome,
    JudgeSpec,
    JudgeTest,
    Language,
    LimitName,
    LimitValues,
    Subtask,
    SubtaskResult,
    TestResult,
    TestStatus,
)
from codeenv.sandbox.checker import Check, Interaction
from codeenv.sandbox.inside.protocol import CallFd
from codeenv.sandbox.outside.calls import CallJail
from codeenv.sandbox.outside.submission import Submission, TestOutcome
from codeenv.sandbox.verdict import verdict

#: Room for an uncaught exception's report, beside a function-call test's returned value.
REPORT_SLACK = 64 << 10

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


Restart = Callable[[str], Awaitable[CallJail]]
#: The problem's checker on one test: (its input, the submission's output, the expected answer).
Checking = Callable[[bytes, bytes, bytes], Awaitable[Check]]
#: The problem's interactor through one test: (its input, the answer, [its stdin, its stdout] which
#: it takes and closes, the test's wall limit).
Interacting = Callable[[bytes, bytes, list[int], float], Awaitable[Interaction]]

logger = logging.getLogger(__name__)


async def _alone(zygote: CallJail, code: bytes, test: JudgeTest, spec: JudgeSpec,
                 limits: LimitValues) -> TestOutcome:
    """One test run as a plain call, as if it were the only one (for a test that ended the
    submission's process: alone, its parent is the jail's init, which no signal reaches)."""
    args, stdin = _test_input(test, spec)
    out = await zygote.run(code, args if spec.fn_name is not None else stdin, limits,
                           call_function=spec.fn_name, report_bytes=report_bytes(limits),
                           binary=spec.language is Language.cpp)
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


async def judge(zygote: CallJail, code: bytes, spec: JudgeSpec, limits: LimitValues, total_wall_s: float,
                restart: Restart, check: Checking | None = None,
                interact: Interacting | None = None) -> tuple[JudgeOutcome, str | None]:
    """Run every test of `spec` against `code` in `zygote`'s jail, preparing the submission again
    after a test that ended its process. `restart(reason)` recycles the jail and returns its zygote;
    `check` runs the problem's checker (where `spec` has one) on a test that ran to its end;
    `interact` its interactor (where it has one) through each test, talking with the submission.

    Returns the outcome and, with the jail's traces wiped and checked, why it must be recycled
    (None if it is ready for the next call). Raises ZygoteDied(started=False) only if nothing ran.
    """
    return await _Judging(zygote, code, spec, limits, total_wall_s, restart, check, interact).run()


def test_score(result: TestResult) -> float:
    """A test's score within its subtasks: 1 passed (or its checker's score), 0 otherwise (or a
    checker's partial score)."""
    if result.score is not None and result.status in (TestStatus.passed, TestStatus.wrong_answer):
        return min(1.0, max(0.0, result.score))
    return 1.0 if result.status is TestStatus.passed else 0.0


def subtask_scores(subtasks: list[Subtask], tests: list[TestResult]) -> list[SubtaskResult]:
    """Each subtask's score: its points times the lowest score among its tests."""
    return [SubtaskResult(points=s.points, score=round(s.points * min(test_score(tests[i]) for i in s.tests), 6),
                          tests=list(s.tests)) for s in subtasks]


class _Judging:
    """One submission's run against its tests: which test is next, and in which process it runs."""

    def __init__(self, zygote: CallJail, code: bytes, spec: JudgeSpec, limits: LimitValues,
                 total_wall_s: float, restart: Restart, check: Checking | None,
                 interact: Interacting | None = None) -> None:
        self.zygote, self.code, self.spec, self.limits, self.restart = zygote, code, spec, limits, restart
        self.check, self.interact = check, interact
        self.interactions: dict[int, Interaction] = {}
        self.total_wall_s = total_wall_s
        self.deadline = time.monotonic() + total_wall_s
        self.tests = spec.tests
        self.results: list[TestResult | None] = [None] * len(self.tests)
        # Compared after the last test ran (a comparison's time must not tell the next test anything of
        # the expected answer), except with stop_on_failure, where a failure decides what runs next.
        self.observations: dict[int, TestOutcome] = {}
        self.outcome = JudgeOutcome(total=len(self.tests))
        self.mode = "binary" if spec.language is Language.cpp else "stdin" if spec.fn_name is None else "function"
        self.index = 0
        self.sub: Submission | None = None
        self.alone = False  # the test at `index` ended the submission's process: run it again alone
        # Subtasks: each test's, and those that have failed (a test that scored 0): a test whose
        # subtasks have all failed is skipped.
        self.subtasks_of: list[list[int]] = [[] for _ in self.tests]
        for k, subtask in enumerate(spec.subtasks or []):
            for i in subtask.tests:
                self.subtasks_of[i].append(k)
        self.failed_subtasks: set[int] = set()

    async def run(self) -> tuple[JudgeOutcome, str | None]:
        try:
            while self.index < len(self.tests):
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self.finish_all(TestStatus.timeout, "not run: the submission's total wall-clock limit of "
                                                        f"{self.total_wall_s:g}s was spent", LimitName.wall)
                    break
                if self.sub is not None:  # a restart: the last process ended; the jail must be clean first
                    await self.sub.close()
                    self.sub = None
                    await self.clean_or_restart()
                if self.alone:
                    if not await self.run_alone():
                        break
                    continue
                ready = await self.prepare(remaining)
                if ready is None:
                    continue
                if not ready:
                    break
                await self.run_tests(self.sub)
        except BaseException:
            if self.sub is not None:
                self.sub.abandon()  # e.g. cancelled: the pool recycles the jail
            raise
        problem = None
        if self.sub is not None:
            await self.sub.close()
            problem = await self.problem()
        for i, observed in self.observations.items():
            self.results[i] = await self.decide(i, observed)
        outcome = self.outcome
        outcome.tests = [r if r is not None else TestResult(status=TestStatus.internal_error, message="not run")
                         for r in self.results]
        outcome.passed = sum(r.status is TestStatus.passed for r in outcome.tests)
        if self.spec.subtasks:
            outcome.subtasks = subtask_scores(self.spec.subtasks, outcome.tests)
            outcome.score = round(sum(s.score for s in outcome.subtasks), 6)
        return outcome, problem

    async def problem(self) -> str | None:
        """Why the jail must be recycled after a process ended in it (None: clean)."""
        return "the zygote is gone" if self.zygote.dead else await self.zygote.finish()

    async def clean_or_restart(self) -> None:
        problem = await self.problem()
        if problem is not None:
            self.zygote = await self.restart(problem)

    async def decide(self, i: int, observed: TestOutcome) -> TestResult:
        """Test i's verdict: from what was observed, the problem's interactor and its checker where
        it has them. With an interactor: a limit the submission hit is its verdict; else one the
        interactor gives other than accepted (a submission it stopped talking to may have died of
        the closed pipe); else the submission's own; else the checker's, on the interactor's file."""
        result = verdict(observed, self.tests[i], self.spec, self.limits)
        output = observed.stdout
        interaction = self.interactions.get(i)
        if interaction is not None:
            said = interaction.check
            if said.status is TestStatus.internal_error:
                result.status, result.message = said.status, said.message[:500]
                return result
            if result.status in (TestStatus.timeout, TestStatus.memory, TestStatus.output_limit):
                return result
            if said.status is not TestStatus.passed:
                result.status, result.score, result.message = said.status, said.score, said.message
                result.limit = None
                return result
            output = interaction.output
            if self.spec.checker is None and result.status is TestStatus.passed:
                result.score, result.message = said.score, said.message or None
        if self.spec.checker is None or result.status is not TestStatus.passed:
            return result
        test = self.tests[i]
        try:
            if self.check is None:
                raise RuntimeError("no checker runs on this worker")
            checked = await self.check((test.stdin or "").encode(), output, (test.expected_stdout or "").encode())
        except Exception as exc:  # the checker's jail could not run: no verdict, never the program's fault
            logger.exception("a checker could not run")
            result.status, result.message = TestStatus.internal_error, f"the checker could not run: {exc!r}"[:500]
            return result
        result.status, result.score, result.message = checked.status, checked.score, checked.message
        return result

    async def settle(self, i: int, observed: TestOutcome) -> bool:
        """Keep test i's observation; whether the run goes on after it. With stop_on_failure or
        subtasks, a test's verdict decides what runs next: it is decided now."""
        if not self.spec.stop_on_failure and not self.spec.subtasks:
            self.observations[i] = observed
            return True
        self.results[i] = result = await self.decide(i, observed)
        if self.spec.stop_on_failure and result.status is not TestStatus.passed:
            self.finish_all(TestStatus.skipped, "not run: an earlier test failed (stop_on_failure)")
            return False
        if test_score(result) == 0:
            self.failed_subtasks.update(self.subtasks_of[i])
        while (self.index < len(self.tests) and self.subtasks_of[self.index]
               and self.failed_subtasks.issuperset(self.subtasks_of[self.index])):
            self.results[self.index] = TestResult(status=TestStatus.skipped,
                                                  message="not run: every subtask it belongs to has failed")
            self.index += 1
        return True

    def finish_all(self, status: TestStatus, message: str, limit: LimitName | None = None) -> None:
        for i in range(self.index, len(self.tests)):
            if self.results[i] is None:
                self.results[i] = TestResult(status=status, limit=limit, message=message)

    async def talk(self, sub: Submission, i: int) -> TestOutcome:
        """Test i of an interactive problem: the submission's stdin and stdout are pipes to the
        interactor's stdout and stdin, which runs in a jail of its own meanwhile."""
        test = self.tests[i]
        theirs, ours, procs = self.pipes()  # the interactor's ends (until it takes them), the submission's
        if self.interact is None:
            for fd in theirs:
                os.close(fd)
            self.interactions[i] = Interaction(Check(TestStatus.internal_error, None,
                                                     "no interactor runs on this worker"), b"")
            task = None
        else:
            task = asyncio.ensure_future(self.interact((test.stdin or "").encode(),
                                                       (test.expected_stdout or "").encode(), theirs,
                                                       self.limits.wall_s))
        try:
            observed = await sub.test(i, b"", b"", self.limits.output_bytes, report_bytes(self.limits),
                                      talk=None if procs is not None else (ours[0], ours[1]), procs=procs)
        except BaseException:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            for fd in ours:  # the submission's ends are in its jail now (or it is gone): the interactor
                os.close(fd)  # sees the end of its input once the test has ended
            if task is not None and task.done():
                for fd in theirs:  # a task cancelled before it ran never took them
                    os.close(fd)
                theirs.clear()
        if task is not None:
            try:
                self.interactions[i] = await task
            except Exception as exc:  # its jail could not run: no verdict, never the program's fault
                logger.exception("an interactor could not run")
                self.interactions[i] = Interaction(Check(TestStatus.internal_error, None,
                                                         f"the interactor could not run: {exc!r}"[:500]), b"")
            finally:
                for fd in theirs:
                    os.close(fd)
                theirs.clear()
        return observed

    def pipes(self) -> tuple[list[int], list[int], tuple[list[dict[str, Any]], list[int]] | None]:
        """An interactive test's pipes: the interactor's ends (testlib: its stdin and stdout; a
        manager: from and to each process, in turn), the submission's (its stdin and stdout, in
        turn), and, for several processes or fifo_io, how each process gets them (Submission.test)."""
        interactor = self.spec.interactor
        assert interactor is not None
        theirs: list[int] = []
        ours: list[int] = []
        for _ in range(interactor.processes):
            to_sub, from_interactor = os.pipe2(os.O_CLOEXEC)
            to_interactor, from_sub = os.pipe2(os.O_CLOEXEC)
            theirs += [to_interactor, from_interactor]
            ours += [to_sub, from_sub]
        if not interactor.several:
            return theirs, ours, None
        fifo, n = interactor.user_io == "fifo_io", interactor.processes
        specs: list[dict[str, Any]] = []
        for k in range(n):
            first = CallFd.PLAIN + 2 * k  # where the message's fds carry this process's two
            specs.append({"argv": [*(["/proc/self/fd/3", "/proc/self/fd/4"] if fifo else []),
                                   *([str(k)] if n != 1 else [])],
                          "fds": {"3": first, "4": first + 1} if fifo else {"0": first, "1": first + 1}})
        if fifo:  # opened by path in the jail, by its uid (the worker's pipes are root's, 0600): only the
            for fd in ours:  # two jails see these fds (each a pid namespace and a procfs of its own)
                os.fchmod(fd, 0o666)
        return theirs, ours, (specs, ours)

    async def run_alone(self) -> bool:
        """The test at `index`, alone; whether the run goes on after it."""
        self.alone = False
        try:
            observed = await _alone(self.zygote, self.code, self.tests[self.index], self.spec, self.limits)
        except ZygoteDied:
            self.zygote = await self.restart("its zygote died")
            return True  # not started: run it again
        await self.clean_or_restart()
        self.index += 1
        return await self.settle(self.index - 1, observed)

    async def prepare(self, remaining_s: float) -> bool | None:
        """Prepare the submission in a new process: True when its tests can run, None to try again
        (another mode, or a new jail), False when no test will run (every result is set)."""
        try:
            self.sub = sub = await self.zygote.prepare(self.code, self.mode, self.spec.fn_name, self.limits,
                                                       remaining_s)
        except ZygoteDied:
            if self.outcome.prepared == 0:
                raise
            self.zygote = await self.restart("its zygote died")
            self.sub = None
            return None
        self.outcome.prepared += 1
        prepared = sub.prepared
        if prepared is None:  # the preparation itself failed: as it would before every test alone
            if self.mode == "function":  # e.g. top-level code that kills itself: each test shows it
                self.mode = "function_inline"
                return None
            lost = sub.lost or ""
            if lost == "cpu":
                self.finish_all(TestStatus.timeout, "the submission's preparation ran over the CPU limit",
                                LimitName.cpu)
            elif lost == "wall":
                self.finish_all(TestStatus.timeout, "the submission's preparation ran over the wall limit",
                                LimitName.wall)
            else:
                self.finish_all(TestStatus.internal_error, f"the submission could not be prepared: {lost}")
            return False
        if "compile_error" in prepared:
            self.outcome.compile = CompileInfo(status="error", stderr=str(prepared.get("stderr", ""))[:8000])
            self.finish_all(TestStatus.skipped, "not run: the code does not compile")
            return False
        if "unshared" in prepared:
            self.mode = "function_inline"  # each test runs the top-level code itself
            return None
        self.outcome.compile = CompileInfo(status="ok")
        return True

    async def run_tests(self, sub: Submission | None) -> None:
        """Tests in the prepared process while it lives (and time remains). While a test runs, the
        next one's files are made (`Submission.prepare_next`): the jail waits for none of that."""
        assert sub is not None
        report = report_bytes(self.limits)

        def prepare_next(i: int) -> None:
            if i < len(self.tests):
                # Ahead of time and only an aid: whatever fails here (out of fds, say) fails again, and is
                # answered, where the test itself makes its files; never in the test running now.
                with contextlib.suppress(Exception):
                    sub.prepare_next(i, *_test_input(self.tests[i], self.spec), report)

        try:
            await self._run_tests(sub, report, prepare_next)
        finally:
            sub.drop_next()  # made for a test that will not run in this process (or not next)

    async def _run_tests(self, sub: Submission, report: int, prepare_next: Callable[[int], None]) -> None:
        while self.index < len(self.tests) and sub.alive:
            if time.monotonic() > self.deadline:
                break
            if self.spec.interactor is not None:
                observed = await self.talk(sub, self.index)
            else:
                args, stdin = _test_input(self.tests[self.index], self.spec)
                observed = await sub.test(self.index, args, stdin, self.limits.output_bytes, report,
                                          file_io=self.spec.input_mode == "file",
                                          meanwhile=functools.partial(prepare_next, self.index + 1))
            if (observed.lost is not None and not (observed.cpu_exceeded or observed.wall_exceeded)
                    and self.spec.interactor is None and self.spec.input_mode != "file"):
                # (an interactive test, or one with files, is not run again alone)
                self.alone = True
                break
            if observed.done is not None and not observed.done.clean:
                sub.lost = "the work dir could not be wiped after a test"
            self.index += 1
            if not await self.settle(self.index - 1, observed):
                self.index = len(self.tests)
