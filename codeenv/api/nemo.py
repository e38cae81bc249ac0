"""NeMo-Skills' sandbox API: codeenv answers as their local sandbox server does, so that NeMo-Skills'
TIR generation, NeMo-Gym's `ns_tools` and NeMo-RL through them point their sandbox client at it
(`NEMO_SKILLS_SANDBOX_HOST`, `NEMO_SKILLS_SANDBOX_PORT`).

- ``POST /execute`` ``{"generated_code", "std_input", "timeout", "language", "max_output_characters",
  "traceback_verbosity"}``, with ``X-Session-ID`` for ``ipython`` -> ``{"process_status":
  "completed"|"error"|"timeout", "stdout", "stderr"}`` (and ``"new_session_created"`` for ipython).
  ``ipython`` without the header is their 400. ``python``, ``python3`` and ``pypy3`` run as calls
  (CPython; ``completed`` whatever the exit code); ``shell`` and ``lean4`` are answered at once with
  ``error`` and a stderr that names the language.
- ``GET /sessions`` (the caller's) and ``DELETE /sessions/{id}`` (200, or 404 with their text).
- ``GET /health`` is open-r1's route (200): their client reads only the status.

An ``ipython`` session is a live session of codeenv's (named after ``X-Session-ID``, for the caller
only) in which real IPython runs each cell (`TerminalInteractiveShell.run_cell`, history in memory),
and each stream is post-processed as their server does. A cell that runs past its timeout is rolled
back: the session is exactly as before it and ``new_session_created`` stays false, so their client
replays nothing. It is true only when the state was lost (a new id, or a session that ended: its
worker died, it was evicted or expired, it was deleted).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from codeenv.api.guard import JSON_BODY
from codeenv.api.service import Gateway, body_schema, parse, session_key
from codeenv.errors import InvalidRequest, SandboxError, SessionError, SessionErrorKind
from codeenv.models import ExecRequest, ExecResult, Integer, Limits, Refusal, Status

#: The routes that take a JSON body (Guard reads and parses it).
JSON_PATHS = frozenset({"/execute"})
#: What their client sends as a language that runs Python (pypy3 runs on CPython here).
PYTHON = frozenset({"python", "python3", "pypy3"})
#: Where the driver's report begins in a cell's stdout (anything the cell wrote to fd 1 itself comes before).
MARK = "\x00codeenv-nemo\x00"
#: The session names this route makes: a prefix of their own, so that the caller's other sessions
#: (and the ids the service makes) never meet them.
PREFIX = "nemo:"
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,120}", re.ASCII)
#: Their sessions never expire by default: this route's idle TTL is at least this.
IDLE_TTL_S = 3600.0

#: The cell that runs `code` in the session's IPython shell (made by the first cell that needs it)
#: and reports its outcome after MARK: as their server, it captures sys.stdout and sys.stderr around
#: `run_cell`, post-processes each stream (Plain and Minimal: ANSI codes, ``File <ipython-`` lines,
#: ``Out[n]:`` prefixes and leading blank lines go, one final newline) and cuts each to the limit.
DRIVER = r'''
try:
    _codeenv_nemo
except NameError:
    def _codeenv_nemo(code, verbosity, limit):
        import contextlib, io, json, re, signal, sys
        shell = globals().get("_codeenv_shell")
        if shell is None:
            from IPython.terminal.interactiveshell import TerminalInteractiveShell
            from traitlets.config import Config
            config = Config()
            config.HistoryManager.hist_file = ":memory:"
            shell = globals()["_codeenv_shell"] = TerminalInteractiveShell(config=config)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        shell.InteractiveTB.set_mode(mode=verbosity)

        class Tee(io.StringIO):  # what the cell prints also reaches fd 1 (up to the limit): kept on a timeout
            left = limit + 1

            def write(self, text):
                if Tee.left > 0:
                    real.write(text[:Tee.left])
                    real.flush()
                    Tee.left -= len(text[:Tee.left])
                return super().write(text)

        real, out, err = sys.stdout, Tee(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = shell.run_cell(code)
        ansi = re.compile(r"\x1B(?:[@-Z\-_]|\[[0-?]*[ -/]*[@-~])")

        def tidy(text):
            if verbosity not in ("Minimal", "Plain"):
                return text
            lines = [re.sub(r"^Out\[\d+\]:\s*", "", line) for line in ansi.sub("", text).split("\n")
                     if not line.strip().startswith("File <ipython-")]
            while lines and lines[0] == "":
                lines.pop(0)
            text = "\n".join(lines).rstrip()
            return text + ("\n" if text else "")

        def cut(text):
            return text[:limit] + "<output cut>" if len(text) > limit else text

        error = bool(result.error_before_exec or result.error_in_exec)
        sys.stdout.write(MARK + json.dumps({"error": error, "stdout": cut(tidy(out.getvalue())),
                                            "stderr": cut(tidy(err.getvalue()))}))
'''.replace("MARK", repr(MARK))


#: A python/python3/pypy3 program, run as their server runs `python -c CODE`: compiled as "<string>"
#: (so a traceback shows no source line, as CPython's does for -c), in a fresh __main__ namespace; an
#: uncaught exception's traceback leaves this wrapper's frame out.
PROGRAM = r'''
import sys as _sys
_globals = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(CODE, "<string>", "exec"), _globals)
except SystemExit:
    raise
except BaseException as _error:
    import traceback as _traceback
    _traceback.print_exception(type(_error), _error, _error.__traceback__.tb_next)
    _sys.exit(1)
'''


class NemoError(BaseModel):
    """Their server's error answer."""

    error: str


class NemoExecute(BaseModel):
    """What their client's `_prepare_request` sends (extra fields ignored, as their server does)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"generated_code": "a = 1\na", "std_input": "", "timeout": 10.0, "language": "ipython",
         "max_output_characters": 1000, "traceback_verbosity": "Plain"},
    ]})

    generated_code: str
    std_input: str = ""
    timeout: float = Field(10.0, gt=0, allow_inf_nan=False, description="seconds (echoed as sent in a "
                           "timeout's message); above the wall cap, the cap")
    language: str = "ipython"
    max_output_characters: Integer = Field(1000, ge=0, description="each stream is cut to this, then "
                                       "'<output cut>' is appended")
    traceback_verbosity: str = Field("Plain", pattern="^(Plain|Context|Verbose|Minimal)$")
    #: `timeout` as the client wrote it (an int stays an int in the timeout's message).
    _shown_timeout: int | float | None = PrivateAttr(None)

    def timeout_text(self) -> str:
        shown = self._shown_timeout if self._shown_timeout is not None else self.timeout
        return f"Execution timed out after {shown} seconds\n"


def nemo_owner(request: Request) -> bytes:
    """Whose sessions: the caller's session key when it sends one, else its bearer token, so that two
    callers of one id never share state (one token, one caller)."""
    key = session_key(request)
    if key is not None:
        return hashlib.sha256(key.encode()).digest()
    token = request.headers.get("authorization", "")
    return hashlib.sha256(b"nemo-skills/" + token.encode()).digest()


def session_name(session_id: str) -> str:
    """The codeenv session that stands for their `X-Session-ID`."""
    if NAME.fullmatch(session_id):
        return PREFIX + session_id
    return PREFIX + "sha256-" + hashlib.sha256(session_id.encode()).hexdigest()[:40]


def _cut(text: str, limit: int) -> str:
    return text[:limit] + "<output cut>" if len(text) > limit else text


def _limits(gateway: Gateway, body: NemoExecute) -> Limits:
    caps = gateway.settings.caps
    seconds = min(float(body.timeout), caps.wall_s)
    # Each stream is cut to max_output_characters: what the cell may write covers that (UTF-8, JSON).
    output = min(caps.output_bytes, max(1 << 16, 16 * body.max_output_characters + (1 << 12)))
    return Limits(wall_s=seconds, cpu_s=min(seconds, caps.cpu_s), output_bytes=output)


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(tags=["NeMo-Skills"])

    @api.post("/execute", openapi_extra={**body_schema("NemoExecute"), "parameters": [
        {"name": "X-Session-ID", "in": "header", "required": False, "schema": {"type": "string"},
         "description": "the caller's session (required with language ipython)"}]}, responses={
        400: {"description": "language ipython without an X-Session-ID header (their text), or a body that is not "
                             "JSON", "content": {"application/json": {"schema": {"anyOf": [
                                 {"$ref": "#/components/schemas/NemoError"},
                                 {"$ref": "#/components/schemas/Error"}]}}}}})
    async def execute(request: Request) -> Response:
        """Run one cell (ipython, in the session X-Session-ID names) or one program (python, python3,
        pypy3), as NeMo-Skills' sandbox does."""
        raw = request.scope.get(JSON_BODY)
        body = parse(request, NemoExecute)
        sent = raw.get("timeout") if isinstance(raw, dict) else None
        if isinstance(sent, int | float) and not isinstance(sent, bool):
            body._shown_timeout = sent  # their message prints it as sent: 1 -> "1 seconds"
        if body.language == "ipython":
            session_id = request.headers.get("x-session-id")
            if session_id is None:
                return JSONResponse({"error": "X-Session-ID header required for ipython sessions"}, 400)
            return JSONResponse(await ipython(gateway, lambda calls: gateway.answer(request, calls),
                                              nemo_owner(request), body, session_id))
        if body.language not in PYTHON:
            return JSONResponse({"process_status": "error", "stdout": "", "stderr": (
                f"codeenv does not run language {body.language!r}: it runs ipython, python, python3 and pypy3 "
                "(as CPython)\n")})
        program = PROGRAM.replace("CODE", repr(body.generated_code), 1)
        call = ExecRequest(code=program, stdin=body.std_input, limits=_limits(gateway, body))
        [result] = await gateway.answer(request, [call])
        return JSONResponse(_program(result, body), headers={"X-Codeenv-Python": "CPython"}
                            if body.language == "pypy3" else None)

    @api.get("/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        """The caller's ipython sessions, as their server lists them."""
        if gateway.sessions is None:
            return {"sessions": {}, "backend": "ipython"}
        now = time.time()
        listed = {}
        for info in await gateway.sessions.describe(nemo_owner(request)):
            if info.session_id.startswith(PREFIX):
                listed[info.session_id[len(PREFIX):]] = {
                    "backend": "ipython", "created": round(now - info.age_s, 3),
                    "last_used": round(now - info.idle_s, 3), "alive": True}
        return {"sessions": listed, "backend": "ipython"}

    @api.delete("/sessions/{session_id}", responses={404: {"model": NemoError, "description": "no such session "
                                                                                             "of the caller's"},
                                                     500: {"model": NemoError}})
    async def delete(session_id: str, request: Request) -> Response:
        """End an ipython session: 200, or 404 when the caller has none of that id."""
        try:
            if gateway.sessions is None:
                raise SessionError("no sessions here", SessionErrorKind.not_found)
            await gateway.sessions.delete(session_name(session_id), nemo_owner(request))
        except SessionError as exc:
            if exc.kind in (SessionErrorKind.not_found, SessionErrorKind.ended):
                return JSONResponse({"error": f"IPython session {session_id} not found"}, 404)
            return JSONResponse({"error": f"Error deleting IPython session {session_id}: {exc}"}, 500)
        return JSONResponse({"message": f"IPython session {session_id} deleted successfully"})

    return api


def _program(result: ExecResult, body: NemoExecute) -> dict[str, Any]:
    """A python/python3/pypy3 call's answer: `completed` whatever its exit code, as their server."""
    limit = body.max_output_characters
    if result.status is Status.timeout:
        return {"process_status": "timeout", "stdout": "", "stderr": _cut(body.timeout_text(), limit)}
    stderr = result.stderr
    if result.status not in (Status.ok, Status.error):
        stderr += f"codeenv: {result.status.value}: {result.message or ''}\n"
    status = "completed" if result.status in (Status.ok, Status.error) else "error"
    return {"process_status": status, "stdout": _cut(result.stdout, limit), "stderr": _cut(stderr, limit)}


async def ipython(gateway: Gateway, run: Callable[[list[ExecRequest]], Awaitable[list[ExecResult]]], who: bytes,
                  body: NemoExecute, session_id: str) -> dict[str, Any]:
    """One ipython cell in `who`'s session `session_id` (made when it has none, or lost it); `run`
    answers calls (the caller's request's). Also the MCP tool `stateful_python_code_exec`."""
    service = gateway.sessions
    if service is None:
        return {"process_status": "error", "stdout": "", "stderr": "codeenv runs no sessions here\n",
                "new_session_created": False}
    name, limit = session_name(session_id), body.max_output_characters
    code = f"{DRIVER}_codeenv_nemo({body.generated_code!r}, {body.traceback_verbosity!r}, {limit})\n"
    call = ExecRequest(code=code, stdin=body.std_input, limits=_limits(gateway, body), session=name)
    call._owner = who
    new = False
    for _ in range(3):
        [result] = await run([call])
        lost = result.status is Status.session_lost or result.refusal is Refusal.no_session
        if not lost:
            break
        new = True
        try:
            await service.create(gateway.settings.session_profile, None,
                                 max(IDLE_TTL_S, gateway.settings.session_idle_ttl_s), who, name)
        except SessionError as exc:
            if exc.kind is not SessionErrorKind.conflict:  # made meanwhile by a concurrent cell: run there
                return _failed(f"a session could not start: {exc}", new)
        except (InvalidRequest, SandboxError) as exc:
            return _failed(f"a session could not start: {exc}", new)
    return _cell_answer(result, body, new)


def _failed(why: str, new: bool) -> dict[str, Any]:
    return {"process_status": "error", "stdout": "", "stderr": f"codeenv: {why}\n", "new_session_created": new}


def _cell_answer(result: ExecResult, body: NemoExecute, new: bool) -> dict[str, Any]:
    limit = body.max_output_characters
    if result.status is Status.timeout:  # what it printed before it was stopped, as their interrupted cell
        return {"process_status": "timeout", "stdout": _cut(result.stdout.partition(MARK)[0], limit),
                "stderr": _cut(body.timeout_text(), limit), "new_session_created": new}
    _, mark, report = result.stdout.rpartition(MARK)
    if result.status in (Status.ok, Status.error) and mark:
        try:
            done = json.loads(report)
            return {"process_status": "error" if done["error"] else "completed", "stdout": done["stdout"],
                    "stderr": done["stderr"], "new_session_created": new}
        except (ValueError, KeyError, TypeError):
            pass
    why = result.message or result.status.value
    if result.rolled_back:
        why += " (the cell was rolled back: the session is as it was before it)"
    return {"process_status": "error", "stdout": "", "stderr": _cut(f"codeenv: {result.status.value}: {why}\n", limit),
            "new_session_created": new or result.status is Status.session_lost}
