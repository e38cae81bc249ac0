"""Turn what the worker observed of a call, or of one judged test, into its structured result.

The status comes only from observations the program cannot forge: the wait status, the zygote's
own timer, cgroup OOM and pids events, and byte counts. The `error` field (type, message, line)
is the program's own account of an uncaught exception and is reported as such.

Usage::

    result = classify(outcome, limits)            # a call or a session cell
    test_result = verdict(observed, test, spec, limits)  # one test of a judged submission
"""

from __future__ import annotations

import json
import os
import signal as signals
from typing import Any

from codeenv.compare import same_output, same_value
from codeenv.models import (
    RETURNED_BYTES,
    ErrorInfo,
    ExecResult,
    JudgeSpec,
    JudgeTest,
    Language,
    LimitName,
    LimitValues,
    Status,
    TestResult,
    TestStatus,
    printable,
)
from codeenv.sandbox.outside.call_io import Outcome
from codeenv.sandbox.outside.submission import TestOutcome

#: How deep a returned value may nest and still come back as itself: JSON parsers on its way
#: (pydantic's among them, at about 200 levels) refuse deeper values, which must not turn a
#: program's result into a service fault.
RETURNED_DEPTH = 64


def wait_status(status: int) -> tuple[int | None, int | None]:
    """(exit code, signal) of a wait status: one of them is set for a process that ended."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def error_info(report: dict[str, Any] | None) -> ErrorInfo | None:
    """The program's own account of its uncaught exception, made safe to send on."""
    if not report or not isinstance(report.get("error"), dict):
        return None
    err = report["error"]
    line = err.get("line")
    return ErrorInfo(
        type=printable(str(err.get("type", ""))[:200]),
        message=printable(str(err.get("message", ""))[:4000]),
        line=line if isinstance(line, int) and not isinstance(line, bool) else None,
    )


#: Bytes that JSON writes escaped: \uXXXX for the control characters, two bytes for these seven.
_ESCAPED = bytes(range(0x20)) + b'"\\'
_SHORT_ESCAPES = (b"\n", b"\t", b"\r", b"\b", b"\f", b'"', b"\\")
_NOT_ESCAPED = bytes(b for b in range(256) if b not in _ESCAPED)


def json_size(text: str, raw: bytes) -> int:
    """How many bytes `text` (`raw` decoded as UTF-8 with replacement) takes as a JSON string
    (quotes left out; non-ASCII written raw, as the service's answers write it)."""
    escaped = raw.translate(None, _NOT_ESCAPED)  # ASCII: decoded as itself, whatever surrounds it
    short = sum(escaped.count(c) for c in _SHORT_ESCAPES)
    utf8 = len(text) if text.isascii() else len(text.encode())  # invalid bytes became U+FFFD
    return utf8 + short + 5 * (len(escaped) - short)


def json_text(raw: bytes, cap: int) -> tuple[str, bool]:
    """`raw` output as the text a result carries, cut so that its JSON takes at most `cap` bytes
    (output of control bytes is six times larger as JSON: the cap holds for what is sent), and
    whether it was cut."""
    text = raw.decode("utf-8", "replace")
    size = json_size(text, raw)
    if size <= cap:
        return text, False
    while size > cap:  # cut in proportion, then a little more, until it fits
        raw = raw[:max(0, min(len(raw) - 1, len(raw) * cap // size - 4))]
        text = raw.decode("utf-8", "replace")
        size = json_size(text, raw)
    return text, True


def classify(out: Outcome, limits: LimitValues) -> ExecResult:
    """Build the result of one call from its Outcome (no id, timings or identity yet)."""
    stdout, stdout_cut = json_text(out.stdout, limits.output_bytes)
    stderr, stderr_cut = json_text(out.stderr, limits.output_bytes)
    result = ExecResult(
        status=Status.internal_error,
        started=out.started,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=out.stdout_truncated or stdout_cut,
        stderr_truncated=out.stderr_truncated or stderr_cut,
        memory_peak_kb=out.memory_peak_kb,
        wall_s=round(out.wall_s, 6),
    )
    exited = out.exited
    if exited is None:
        if out.watchdog_fired:
            result.status, result.limit = Status.timeout, LimitName.wall
        elif out.oom_killed:
            result.status, result.limit = Status.memory, LimitName.memory
        else:
            result.status = Status.internal_error
        result.message = "; ".join(out.notes) or "the sandbox failed during the call"
        return result

    report = out.report or {}
    if out.setup_error is not None:
        result.message = f"the sandbox could not set up the call: {out.setup_error}"
        return result
    if exited.refused is not None:
        result.message = f"the sandbox refused the call: {exited.refused}"
        return result

    result.wall_s = round(exited.wall_s, 6)
    result.cpu_s = round(exited.cpu_s, 6)
    if result.memory_peak_kb is None and exited.maxrss_kb is not None:
        result.memory_peak_kb = exited.maxrss_kb
    result.exit_code, result.signal = wait_status(exited.wait_status)
    result.error = error_info(report)  # advisory: the program can write its report
    if isinstance(report.get("value"), str):  # display_last: the program's own account, like stdout
        result.value = printable(report["value"])

    if out.output_overflow:
        result.status, result.limit = Status.output_limit, LimitName.output
        result.message = f"output exceeded {limits.output_bytes} bytes on a stream; the call was stopped"
    elif out.oom_killed:  # the kernel's OOM event, never the program's own report (it can write that)
        result.status, result.limit = Status.memory, LimitName.memory
        result.message = f"the call exceeded its memory limit of {limits.memory_mb} MB"
    elif exited.timed_out:
        result.status, result.limit = Status.timeout, LimitName.wall
        result.message = f"the call exceeded its wall-clock limit of {limits.wall_s:g}s"
    elif result.signal == signals.SIGXCPU or (
        result.signal == signals.SIGKILL and result.cpu_s >= limits.cpu_s
    ):
        result.status, result.limit = Status.timeout, LimitName.cpu
        result.message = f"the call exceeded its CPU-time limit of {limits.cpu_s:g}s"
    elif exited.killed:
        result.status = Status.killed
        result.message = "the call was stopped by the service"
    elif result.signal is not None:
        result.status = Status.killed
        result.message = f"the program was killed by signal {result.signal} ({signals.strsignal(result.signal)})"
    elif result.exit_code == 0:
        result.status = Status.ok
    else:
        result.status = Status.error

    if result.limit is None:
        if out.pids_limit_hit:
            result.limit = LimitName.pids
            result.message = f"the call reached its limit of {limits.processes} processes and threads"
        elif result.error and result.error.message.startswith("[Errno 27]"):
            result.limit = LimitName.file_size
            result.message = f"the call reached its file-size limit of {limits.file_size_mb} MB"
    return result


# --- one judged test ---------------------------------------------------------------------------------


def _text(data: bytes, limit: int = RETURNED_BYTES) -> str:
    """A test's stream as its result shows it: at most `limit` bytes of JSON."""
    return json_text(data[:limit], limit)[0]


def _depth(value: Any) -> int:
    """How deep a JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, list):
            stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, dict):
            stack.extend((x, depth + 1) for x in item.values())
    return deepest


def returned(value: Any) -> tuple[Any, bool]:
    """A function's returned value as a test's result carries it: (the JSON value, its lone
    surrogates replaced, False), or
    (None, True) when it cannot come back whole: its JSON over RETURNED_BYTES, nested deeper than
    RETURNED_DEPTH, or holding NaN or Infinity (which JSON has no value for)."""
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (ValueError, RecursionError):
        return None, True
    if size > RETURNED_BYTES or _depth(value) > RETURNED_DEPTH:
        return None, True
    return _encodable(value), False


def _encodable(value: Any) -> Any:
    """`value` with every string (and key) made encodable (a lone surrogate becomes U+FFFD, as in
    stdout): one program's value never fails a response. Nested at most RETURNED_DEPTH."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [_encodable(x) for x in value]
    if isinstance(value, dict):
        return {printable(k): _encodable(x) for k, x in value.items()}
    return value


def verdict(t: TestOutcome, test: JudgeTest, spec: JudgeSpec, limits: LimitValues) -> TestResult:
    """Classify one test from what the worker observed, comparing its output with the expected one.
    Nothing a program returns makes this raise: a comparison that fails is the test's wrong answer."""
    result = TestResult(status=TestStatus.passed, wall_s=round(t.wall_s, 6), cpu_s=round(t.cpu_s, 6),
                        memory_peak_kb=t.memory_peak_kb, stdout=_text(t.stdout), stderr=_text(t.stderr),
                        error=error_info(t.report))
    done = t.done
    if done is not None:
        result.exit_code, result.signal = wait_status(done.wait_status)

    def fail(status: TestStatus, limit: LimitName | None = None, message: str | None = None) -> TestResult:
        result.status, result.limit, result.message = status, limit, message
        return result

    if t.setup_error is not None:
        return fail(TestStatus.internal_error, message=f"the test could not be set up: {printable(t.setup_error)}")
    if t.cpu_exceeded or result.signal == signals.SIGXCPU:
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
        if spec.language is Language.cpp and result.signal != signals.SIGKILL:  # a compiled program's crash
            return fail(TestStatus.error, limit, f"crashed with signal {result.signal} "
                                                 f"({signals.strsignal(result.signal)})")
        return fail(TestStatus.killed, limit, f"killed by signal {result.signal}")
    if result.exit_code:
        return fail(TestStatus.error, message=f"exit code {result.exit_code}")
    if spec.fn_name is None:
        if spec.checker is not None or spec.interactor is not None:  # they decide (sandbox/judge.py): passed so far
            return result
        actual = t.stdout.decode("utf-8", "replace")
        try:
            ok = same_output(actual, test.expected_stdout or "", spec.compare, spec.float_tol)
        except Exception as exc:  # e.g. too deep or too large to compare: the program's doing
            return fail(TestStatus.wrong_answer, message=f"its output could not be compared: {type(exc).__name__}")
        return result if ok else fail(TestStatus.wrong_answer)
    report = t.report or {}
    if "value" in report:
        result.value, result.value_truncated = returned(report["value"])
        try:
            ok = same_value(report["value"], test.expected, spec.float_tol)
        except Exception as exc:  # e.g. 10**400 against a float, or nested past the recursion limit
            return fail(TestStatus.wrong_answer,
                        message=f"the returned value could not be compared: {type(exc).__name__}")
        return result if ok else fail(TestStatus.wrong_answer)
    if "unserializable" in report:
        shown = printable(str(report["unserializable"]))[:RETURNED_BYTES]
        return fail(TestStatus.wrong_answer, message=f"the returned value is not JSON: {shown}")
    if "too_large" in report:
        return fail(TestStatus.output_limit, LimitName.output, "the returned value is larger than the output limit")
    return fail(TestStatus.error, message="the program ended without the function returning")
