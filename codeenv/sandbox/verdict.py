"""Turn what the worker observed of a call into its structured result.

The status comes only from observations the program cannot forge: the wait status, the zygote's
own timer, cgroup OOM and pids events, and byte counts. The `error` field (type, message, line)
is the program's own account of an uncaught exception and is reported as such.
"""

from __future__ import annotations

import os
import signal as signals
from typing import Any

from codeenv.models import ErrorInfo, ExecResult, LimitName, LimitValues, Status, printable
from codeenv.sandbox.outside.call_io import Outcome


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


def classify(out: Outcome, limits: LimitValues) -> ExecResult:
    """Build the result of one call from its Outcome (no id, timings or identity yet)."""
    result = ExecResult(
        status=Status.internal_error,
        started=out.started,
        stdout=out.stdout.decode("utf-8", "replace"),
        stderr=out.stderr.decode("utf-8", "replace"),
        stdout_truncated=out.stdout_truncated,
        stderr_truncated=out.stderr_truncated,
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

    wait_status = exited.wait_status
    result.wall_s = round(exited.wall_s, 6)
    result.cpu_s = round(exited.cpu_s, 6)
    if result.memory_peak_kb is None and exited.maxrss_kb is not None:
        result.memory_peak_kb = exited.maxrss_kb
    if os.WIFSIGNALED(wait_status):
        result.signal = os.WTERMSIG(wait_status)
    elif os.WIFEXITED(wait_status):
        result.exit_code = os.WEXITSTATUS(wait_status)
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
