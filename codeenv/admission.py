"""Admission: a request checked against the server's settings before it is queued or run.

The wire schema (`codeenv.models`) says what a request may hold; admission says whether this server
runs it: limits within the caps, sizes within the settings, file paths inside the work dir, input
files that decode. Every refusal is an InvalidRequest whose message says what to fix.

`admit` is the one entry point, for a call, a judged call and a session's cell alike. It runs at the
two trust boundaries: the gateway (`check`: the same rules, once per call, before the queue) and the
worker that runs the call (the pool; a Redis worker's caps are authoritative for what Redis brings).
A queue between them is a transport and checks nothing.

Usage::

    admitted = admit(request, settings)   # raises InvalidRequest
    check(request, settings)              # the gateway's: raises InvalidRequest, builds nothing
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from codeenv.errors import InvalidRequest, LimitExceedsCap
from codeenv.models import RETURNED_BYTES, ExecRequest, JudgeRequest, JudgeTest, Limits, LimitValues

if TYPE_CHECKING:
    from codeenv.settings import SandboxSettings


#: The names of the per-call limits (Limits and LimitValues have the same fields).
LIMITS = tuple(LimitValues.model_fields)


@dataclass(frozen=True, slots=True)
class Admitted:
    """What a call runs with: its code and stdin as bytes, and its limits filled from the defaults."""

    code: bytes
    stdin: bytes
    limits: LimitValues


def resolve_limits(limits: Limits, defaults: LimitValues, caps: LimitValues) -> LimitValues:
    """Fill unset limits from `defaults`; raise LimitExceedsCap for any above `caps`."""
    values = {name: getattr(defaults, name) for name in LIMITS}
    values.update(_asked(limits, caps))
    if limits.cpu_s is None:
        # Unless asked otherwise, the CPU budget follows the wall budget.
        values["cpu_s"] = min(values["wall_s"], caps.cpu_s)
    # Every value is already valid: a default, or a validated request within its cap.
    return LimitValues.model_construct(**values)


def _asked(limits: Limits, caps: LimitValues) -> dict[str, int | float]:
    """The limits a request set; raise LimitExceedsCap for any above `caps`."""
    asked: dict[str, int | float] = {}
    for name in LIMITS:
        requested = getattr(limits, name)
        if requested is None:
            continue
        cap = getattr(caps, name)
        if requested > cap:
            raise LimitExceedsCap(f"limits.{name}", requested, cap)
        asked[name] = requested
    return asked


def admit(request: ExecRequest, settings: SandboxSettings) -> Admitted:
    """The code, stdin and limits to run with (a judged call's: its per-test limits); raise
    InvalidRequest saying what to fix."""
    if request.judge is not None:
        limits, _ = judge_limits(request, settings)
        return Admitted(request.code.encode("utf-8"), b"", limits)
    limits = resolve_limits(request.limits, settings.defaults, settings.caps)
    try:
        code = request.code.encode("utf-8")
        stdin = request.stdin.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"code and stdin must be valid Unicode text (no lone surrogates): {exc}") from exc
    check_code_size(code, settings)
    if len(stdin) > settings.max_stdin_bytes:
        raise InvalidRequest(f"stdin is {len(stdin)} bytes; the limit is {settings.max_stdin_bytes}")
    files = len(request.files) + len(request.fetch_files)
    if files > settings.max_files:
        raise InvalidRequest(f"{files} files in and out; the limit is {settings.max_files}")
    for path in [*request.files, *request.fetch_files]:
        check_path(path)
    return Admitted(code, stdin, limits)


def check(request: ExecRequest, settings: SandboxSettings) -> None:
    """`admit`'s rules without building what a worker runs with: the gateway's admission, once per
    call. A call that provably passes the rest (text too short to be over a size, no files) costs its
    limits' comparison with the caps and a few more; any other goes through `admit` itself, so the
    rules are written once. (`Text` fields hold no lone surrogate, so a short one encodes within 4
    bytes a character.)"""
    if (request.judge is None and not request.files and not request.fetch_files
            and 4 * len(request.code) <= settings.max_code_bytes
            and 4 * len(request.stdin) <= settings.max_stdin_bytes):
        if request.limits.__pydantic_fields_set__:
            _asked(request.limits, settings.caps)
        return
    admit(request, settings)


def decoded_files(request: ExecRequest, settings: SandboxSettings) -> list[tuple[str, bytes]]:
    """The input files' contents; raise InvalidRequest for bad base64 or too many bytes."""
    decoded: list[tuple[str, bytes]] = []
    total = 0
    for path, content in request.files.items():
        try:
            data = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequest(f"files[{path!r}] is not valid base64: {exc}") from None
        total += len(data)
        if total > settings.max_files_bytes:
            raise InvalidRequest(f"the input files hold more than {settings.max_files_bytes} bytes")
        decoded.append((path, data))
    dirs = {"/".join(p.split("/")[:i]) for p, _ in decoded for i in range(1, p.count("/") + 1)}
    for path, _ in decoded:
        if path in dirs:
            raise InvalidRequest(f"files[{path!r}] is both a file and a directory of another file")
    return decoded


def check_code_size(code: bytes, settings: SandboxSettings) -> None:
    """InvalidRequest for a program over `max_code_bytes` (however it travels: code, or a file to run)."""
    if len(code) > settings.max_code_bytes:
        raise InvalidRequest(f"code is {len(code)} bytes; the limit is {settings.max_code_bytes}")


def check_path(path: str) -> None:
    """A path inside the work dir: relative, no '.' or '..' parts, no NUL, not empty."""
    if not path or len(path) > 1024 or "\0" in path or path.startswith("/"):
        raise InvalidRequest(f"file path {path!r} must be a non-empty relative path without NUL")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise InvalidRequest(f"file path {path!r} must stay inside the work dir (no '', '.' or '..' parts)")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"file path {path!r} is not valid Unicode") from None


# --- judged submissions (/v1/judge) ---------------------------------------------------------------


def judge_call(request: JudgeRequest, settings: SandboxSettings) -> ExecRequest:
    """The call that judges `request`, admitted; raise InvalidRequest saying what to fix."""
    call = to_judge_call(request)
    judge_limits(call, settings)
    return call


def to_judge_call(request: JudgeRequest) -> ExecRequest:
    """The call that judges `request` (not admitted yet); InvalidRequest if it cannot be one."""
    try:
        return request.to_call()
    except ValidationError as exc:
        raise InvalidRequest("; ".join(e["msg"] for e in exc.errors(include_url=False))) from None


def judge_limits(request: ExecRequest, settings: SandboxSettings) -> tuple[LimitValues, float]:
    """A judged call's per-test limits and its total wall-clock budget; raise InvalidRequest.

    CPU time decides a test's time limit; its wall-clock limit, unless asked, is a safety net of
    3 x the CPU limit + 1 s, so that a contended host does not turn correct solutions into timeouts.
    Nothing here depends on the expected answers.
    """
    spec = request.judge
    assert spec is not None
    count = spec.count
    if count > settings.judge_max_tests:
        raise InvalidRequest(f"{count} tests; the limit is {settings.judge_max_tests}")
    check_tests_size(spec.tests, spec.fn_name, settings.judge_max_bytes)
    if request.files or request.fetch_files or request.stdin:
        raise InvalidRequest("a judged call has no stdin, files or fetch_files of its own: tests carry the input")
    check_code_size(request.code.encode("utf-8"), settings)
    asked = request.limits
    cpu = asked.cpu_s if asked.cpu_s is not None else settings.defaults.cpu_s
    # A test's output is compared in full: unless asked, up to the server's cap. Never sized from the
    # expected answers, which a test must not be able to observe (not even by where it is stopped).
    output = asked.output_bytes if asked.output_bytes is not None else settings.caps.output_bytes
    values = resolve_limits(asked.model_copy(update={"cpu_s": cpu, "wall_s": None, "output_bytes": output}),
                            settings.defaults, settings.caps)
    if asked.wall_s is not None and asked.wall_s > settings.caps.wall_s:
        raise LimitExceedsCap("limits.wall_s", asked.wall_s, settings.caps.wall_s)
    total = spec.total_wall_s
    if total is not None and total > settings.judge_max_total_wall_s:
        raise LimitExceedsCap("total_wall_s", total, settings.judge_max_total_wall_s)
    # A problem's time limits were set on another machine: time_scale scales them all, up to the caps.
    scale = spec.time_scale
    cpu = min(cpu * scale, settings.caps.cpu_s)
    wall = min(asked.wall_s * scale, settings.caps.wall_s) if asked.wall_s is not None else 3 * cpu + 1
    limits = values.model_copy(update={"cpu_s": cpu, "wall_s": wall})
    if total is not None:
        total = min(total * scale, settings.judge_max_total_wall_s)
    else:
        total = min(count * (wall + 1), settings.judge_max_total_wall_s)
    return limits, total


def check_tests_size(tests: list[JudgeTest], fn_name: str | None, max_bytes: int) -> None:
    """InvalidRequest when the tests' inputs and expected answers hold more than `max_bytes`."""
    size = 0
    for test in tests:
        if fn_name is None:
            size += len((test.stdin or "").encode()) + len((test.expected_stdout or "").encode())
        else:
            size += len(json.dumps(test.args or [])) + len(json.dumps(test.expected))
        if size > max_bytes:
            raise InvalidRequest(f"the tests hold more than {max_bytes} bytes")


def answer_bytes(request: ExecRequest, settings: SandboxSettings) -> int:
    """The most output a call's result may carry: stdout and stderr at its output cap (in the bytes
    of their JSON), or for a judged call 3 x RETURNED_BYTES per test (its streams and value)."""
    if request.judge is not None:
        return 3 * RETURNED_BYTES * request.judge.count
    asked = request.limits.output_bytes
    return 2 * (asked if asked is not None else settings.defaults.output_bytes)
