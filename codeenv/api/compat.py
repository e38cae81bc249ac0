"""Drop-in endpoints for the RL stacks people run: code-judge and SandboxFusion wire formats.

Both map onto the same queue as the native API. Their clients hard-code limits, so where the
native API refuses a limit above the server's cap, these endpoints clamp it and say so.

- code-judge (rStar2-Agent's training code): ``POST /run``, ``/run/batch``, ``/run/long-batch``,
  ``/judge``, ``/judge/batch``, ``/judge/long-batch``, ``GET /ping``, ``GET /status``.
- SandboxFusion (verl's sandbox tool and reward, SkyRL, ROLL, the ``sandbox-fusion`` package):
  ``POST /run_code`` (languages ``python``, ``pytest`` and ``cpp``), ``GET /v1/ping``.
"""

from __future__ import annotations

import base64
import json
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codeenv.admission import check_code_size, check_path
from codeenv.api.pytest_driver import SECRET_BYTES as PYTEST_SECRET_BYTES
from codeenv.api.service import Gateway, body_schema, merge, parse, validation_errors
from codeenv.api.statuses import SANDBOX_FUSION, answered
from codeenv.client.feedback import code_judge_reason
from codeenv.errors import ApiError, InvalidRequest
from codeenv.models import (
    CompileInfo,
    ExecRequest,
    ExecResult,
    Integer,
    Language,
    LimitName,
    Limits,
    Refusal,
    Status,
    Text,
    printable,
)
from codeenv.settings import GatewaySettings

#: The routes that take a JSON body (Guard reads and parses it).
CODE_JUDGE_JSON_PATHS = frozenset(f"/{verb}{suffix}" for verb in ("run", "judge")
                                  for suffix in ("", "/batch", "/long-batch"))
SANDBOX_FUSION_JSON_PATHS = frozenset({"/run_code"})


# --- code-judge ----------------------------------------------------------------------------------


class Submission(BaseModel):
    """One program, as code-judge takes it."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"type": "python", "solution": "print(int(input()) * 2)", "input": "21", "expected_output": "42"},
    ]})

    sub_id: Text | None = None
    # Any language name: one that does not run here is answered for its submission alone
    # (`invalid_input`), so a batch with a stray `javascript` item still runs the others.
    type: str = Field(description="the language: \"python\" or \"cpp\" (compiled with g++ -O2, as "
                                  "code-judge compiles); any other is answered for that submission alone")
    solution: str
    input: str | None = None
    expected_output: str | None = None
    options: dict[str, Any] | None = None


class BatchSubmission(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"type": "batch", "submissions": [{"type": "python", "solution": "print(1 + 1)", "expected_output": "2"}]},
    ]})

    sub_id: Text | None = None
    type: Literal["batch"] = "batch"
    submissions: list[Submission] = Field(min_length=1)


class SubmissionResult(BaseModel):
    """code-judge's answer for one submission (`stdout` and `stderr` from /run only)."""

    sub_id: str | None
    success: bool = Field(description="it ran to exit status 0 and its output matched expected_output, if given")
    run_success: bool = Field(description="it ran to exit status 0")
    cost: float = Field(description="wall-clock seconds it ran")
    reason: str = Field(description='"" for a run (good or bad), "worker_timeout", "queue_timeout" or '
                                    '"internal_error" for the service\'s own failures')
    stdout: str | None = None
    stderr: str | None = None


class BatchSubmissionResult(BaseModel):
    sub_id: str
    results: list[SubmissionResult]


class QueueStatus(BaseModel):
    """code-judge's /status."""

    queue: int = Field(description="calls waiting for a slot")
    num_workers: int


#: code-judge's languages that run here.
CODE_JUDGE_LANGUAGES = ("python", "cpp")


def _judge_result(sub: Submission, result: ExecResult, return_chars: int, with_output: bool) -> dict[str, Any]:
    """code-judge's result fields from ours. `reason` says only what code-judge's clients act on:
    a program that ran out of time, memory or output is a failed run (reason "" or worker_timeout),
    not the service's fault."""
    reason = code_judge_reason(result.status)
    run_success = result.status == Status.ok and result.exit_code == 0
    success = run_success and (sub.expected_output is None
                               or result.stdout.strip() == sub.expected_output.strip())
    out: dict[str, Any] = {"sub_id": sub.sub_id, "success": success, "run_success": run_success,
                           "cost": round(result.wall_s, 6), "reason": reason}
    if with_output:
        stderr = result.stderr
        if result.status == Status.rejected and result.message:
            stderr = result.message
        elif result.status in (Status.memory, Status.output_limit, Status.internal_error) and result.message:
            stderr = f"{stderr}\n[{result.status.value}] {result.message}".lstrip()
        out["stdout"] = result.stdout[:return_chars]
        out["stderr"] = stderr[:return_chars]
    return out


def _judge_request(sub: Submission, settings: GatewaySettings) -> ExecRequest | str:
    """Our request for a submission, or why it cannot run."""
    if sub.type not in CODE_JUDGE_LANGUAGES:
        return f"type {sub.type!r} is not supported by this server: only 'python' and 'cpp' run here"
    wall = settings.code_judge_wall_s or settings.defaults.wall_s
    try:
        cpp = sub.type == "cpp"  # compiled with code-judge's own flags (g++ -O2): the preset "plain"
        return ExecRequest(code=sub.solution, stdin=sub.input or "", deadline_s=settings.code_judge_queue_wait_s,
                           language=Language.cpp if cpp else Language.python, preset="plain" if cpp else None,
                           limits=Limits(wall_s=min(wall, settings.caps.wall_s),
                                         output_bytes=settings.code_judge_output_bytes))
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in validation_errors(exc))


def code_judge_router(gateway: Gateway) -> APIRouter:
    api = APIRouter(tags=["code-judge"])
    settings = gateway.settings

    async def run_submissions(request: Request, subs: list[Submission], with_output: bool) -> list[dict[str, Any]]:
        runnable: list[ExecRequest] = []
        refused: list[ExecResult | None] = []
        for sub in subs:
            sub.sub_id = sub.sub_id or str(uuid.uuid4())
            made = _judge_request(sub, settings)
            if isinstance(made, str):
                refused.append(ExecResult(status=Status.rejected, refusal=Refusal.invalid, message=made))
            else:  # the gateway refuses what cannot run (over a cap, bad Unicode): `rejected`
                runnable.append(made)
                refused.append(None)
        results = merge(refused, await gateway.answer(request, runnable))
        return [_judge_result(s, r, settings.code_judge_return_chars, with_output)
                for s, r in zip(subs, results, strict=True)]

    def one(with_output: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            [result] = await run_submissions(request, [parse(request, Submission)], with_output)
            return JSONResponse(result)
        return endpoint

    def batch(with_output: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            body = parse(request, BatchSubmission)
            if len(body.submissions) > settings.max_batch:
                raise ApiError(422, f"a batch holds at most {settings.max_batch} submissions")
            results = await run_submissions(request, body.submissions, with_output)
            return JSONResponse({"sub_id": body.sub_id or str(uuid.uuid4()), "results": results})
        return endpoint

    for prefix, with_output in (("/run", True), ("/judge", False)):
        api.add_api_route(prefix, one(with_output), methods=["POST"], response_model=SubmissionResult,
                          openapi_extra=body_schema("Submission"), summary=f"code-judge: {prefix[1:]} one submission")
        for path in (f"{prefix}/batch", f"{prefix}/long-batch"):
            # The same here: a submission that cannot start within code_judge_queue_wait_s (< 60 s,
            # rStar2-Agent's client timeout) is answered queue_timeout and never runs.
            api.add_api_route(path, batch(with_output), methods=["POST"], response_model=BatchSubmissionResult,
                              openapi_extra=body_schema("BatchSubmission"),
                              summary=f"code-judge: {prefix[1:]} a batch of submissions")

    @api.get("/ping")
    async def ping() -> str:
        return "pong"

    @api.get("/status", response_model=QueueStatus)
    async def status() -> dict[str, int]:
        stats = gateway.queue.stats()
        return {"queue": int(stats["waiting"]), "num_workers": int(stats["workers"])}

    return api


# --- SandboxFusion -------------------------------------------------------------------------------


class RunCodeRequest(BaseModel):
    """SandboxFusion's /run_code request (unknown fields are ignored, as SandboxFusion ignores them)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"code": "print(sum(range(10)))", "language": "python", "run_timeout": 5},
    ]})

    code: str
    language: str = "python"
    stdin: str | None = None
    run_timeout: float = 10
    compile_timeout: float = 10
    memory_limit_MB: Integer = -1
    files: dict[str, str | None] = Field(
        default_factory=dict, description="path -> base64 content; a null content is not written (as SandboxFusion)")
    fetch_files: list[str] = Field(default_factory=list)
    args: list[str] = Field(default_factory=list, description="extra command-line arguments to pytest")


class RunResult(BaseModel):
    status: Literal["Finished", "TimeLimitExceeded", "Error"]
    execution_time: float
    return_code: int | None = Field(description="the exit status, or minus the signal that ended it; null on timeout")
    stdout: str
    stderr: str


class RunCodeResponse(BaseModel):
    """SandboxFusion's /run_code answer."""

    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: RunResult | None = Field(None, description="cpp: the compilation (always there); null for python")
    run_result: RunResult | None = Field(description="null when the code did not compile")
    executor_pod_name: str | None
    files: dict[str, str] = Field(description="fetched files: path -> base64 content")


#: Languages that run as a Python program (SandboxFusion has no "python3"; clients send it anyway).
PYTHON_LANGUAGES = ("python", "python3")
PYTEST = "pytest"
#: SandboxFusion's C++ language name.
CPP = "cpp"
#: SandboxFusion skips input files whose name holds this (its datasets' placeholders).
IGNORED_FILE_MARK = "IGNORE_THIS_FILE"
_TMP_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


@dataclass(frozen=True)
class PytestRun:
    """What the gateway needs to judge a `pytest` call: where the driver leaves its tally, and the
    token that proves the tally is the driver's."""

    tally: str
    token: str


@cache
def _pytest_driver() -> str:
    return (resources.files("codeenv.api") / "pytest_driver.py").read_text(encoding="utf-8")


def _fusion_request(body: RunCodeRequest, settings: GatewaySettings) -> tuple[ExecRequest, list[str], PytestRun | None]:
    """Our request, with the client's limits clamped to the server's caps (and notes saying so).

    Raises InvalidRequest for what SandboxFusion would run differently and we cannot."""
    notes: list[str] = []
    caps = settings.caps
    wall = body.run_timeout if body.run_timeout > 0 else settings.defaults.wall_s
    if wall > caps.wall_s:
        notes.append(f"run_timeout {body.run_timeout:g}s clamped to the server's cap of {caps.wall_s:g}s")
        wall = caps.wall_s
    memory = body.memory_limit_MB if body.memory_limit_MB > 0 else settings.defaults.memory_mb
    if memory > caps.memory_mb:
        notes.append(f"memory_limit_MB {body.memory_limit_MB} clamped to the server's cap of {caps.memory_mb}")
        memory = caps.memory_mb
    # As SandboxFusion's restore_files: a file with no content, or a placeholder name, is not written.
    files = {path: content for path, content in body.files.items()
             if content is not None and IGNORED_FILE_MARK not in path}
    fetch_files = list(body.fetch_files)
    code, stdin = body.code, body.stdin or ""
    pytest_run = None
    if body.language == PYTEST:
        try:
            source = code.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"code must be valid Unicode text (no lone surrogates): {exc}") from None
        check_code_size(source, settings)  # the program travels as a file here, not as the call's code
        # As SandboxFusion: the file is a NamedTemporaryFile in the work dir, run as `pytest FILE *args`.
        name = "tmp" + "".join(secrets.choice(_TMP_NAME_CHARS) for _ in range(8)) + ".py"
        pytest_run = PytestRun(tally=f".codeenv-pytest-{secrets.token_hex(8)}.json", token=secrets.token_hex(16))
        files[name] = base64.b64encode(source).decode()
        fetch_files.append(pytest_run.tally)
        params = {"file": name, "args": body.args}
        code = f"{_pytest_driver()}\nrun({json.dumps(params)!r})\n"
        secret = json.dumps({"tally": pytest_run.tally, "token": pytest_run.token})
        stdin = (body.stdin or "") + secret.ljust(PYTEST_SECRET_BYTES)
    elif body.language == CPP and body.args:
        notes.append("args ignored: a C++ program gets none (as SandboxFusion runs it)")
    elif body.args:
        notes.append(f"args ignored: they are passed to pytest only (as SandboxFusion ignores them for "
                     f"{body.language!r})")
    request = ExecRequest(
        code=code, stdin=stdin, language=Language.cpp if body.language == CPP else Language.python,
        limits=Limits(wall_s=wall, memory_mb=memory,
                      output_bytes=min(settings.sandbox_fusion_output_bytes, caps.output_bytes)),
        files=files, fetch_files=fetch_files)
    return request, notes, pytest_run


def _pytest_verdict(result: ExecResult, run: PytestRun) -> str | None:
    """Why a `pytest` call that ran to its end is not a success, or None if it is: every test that
    pytest collected from the file's source ran and passed, at least one, as pytest's own tally
    (fetched from outside the program's output) shows."""
    encoded = (result.files or {}).get(run.tally)
    try:
        tally = json.loads(base64.b64decode(encoded)) if encoded is not None else None
        if not isinstance(tally, dict) or tally.get("token") != run.token:
            tally = None
    except ValueError:
        tally = None
    if tally is None:
        return "pytest did not finish: the driver's process ended before it could report (no tally)"
    if not tally.get("reported") or tally.get("child_exit") != tally.get("exit_status"):
        return "pytest did not finish: the program ended pytest's process before pytest could report"
    counts = tally.get("counts")
    counts = {k: n for k, n in counts.items() if type(n) is int} if isinstance(counts, dict) else {}
    def listed(key: str) -> str:
        names = tally.get(key)
        return printable(", ".join(map(str, names if isinstance(names, list) else [names])))[:2000]

    if tally.get("missing"):
        return f"test functions of the file were never collected: {listed('missing')}"
    if tally.get("rewritten"):
        return f"test functions were replaced before or while they ran: {listed('rewritten')}"
    if tally.get("plugins"):
        return f"the file registered pytest plugins: {listed('plugins')}"
    bad = {k: counts.get(k, 0) for k in ("failed", "error", "skipped", "xfailed") if counts.get(k, 0)}
    if bad:
        return "pytest reported " + ", ".join(f"{n} {k}" for k, n in bad.items())
    if counts.get("passed", 0) + counts.get("xpassed", 0) < 1:
        return "pytest ran no test"
    if tally.get("exit_status") != 0 or result.exit_code != 0:
        return f"pytest exited with status {result.exit_code}"
    return None


def _compile_result(info: CompileInfo, return_bytes: int) -> dict[str, Any]:
    """SandboxFusion's compile_result of a C++ compile."""
    status = "TimeLimitExceeded" if info.limit in (LimitName.cpu, LimitName.wall) else "Finished"
    return {"status": status, "execution_time": round(info.wall_s, 6),
            "return_code": None if status != "Finished" else 0 if info.status == "ok" else 1,
            "stdout": "", "stderr": info.stderr[:return_bytes]}


def _fusion_response(result: ExecResult, notes: list[str], return_bytes: int,
                     pytest_run: PytestRun | None = None) -> dict[str, Any]:
    compiled = result.compile
    if compiled is not None and compiled.status != "ok":  # as SandboxFusion: no run, status Failed
        return {"status": "Failed", "message": "; ".join([*([compiled.message] if compiled.message else []), *notes]),
                "compile_result": _compile_result(compiled, return_bytes), "run_result": None,
                "executor_pod_name": result.worker or None, "files": {}}
    run_status = "TimeLimitExceeded" if result.status == Status.timeout else "Finished"
    return_code = None if result.status == Status.timeout else (
        -result.signal if result.signal is not None else result.exit_code)
    files = dict(result.files or {})
    file_errors = dict(result.file_errors or {})
    if pytest_run is not None:
        files.pop(pytest_run.tally, None)
        file_errors.pop(pytest_run.tally, None)
    if result.status == Status.internal_error:
        status, run_status = "SandboxError", "Error"
    elif result.status == Status.ok and return_code == 0:
        why_not = _pytest_verdict(result, pytest_run) if pytest_run is not None else None
        status = "Success" if why_not is None else "Failed"
        if why_not is not None:
            notes = [why_not, *notes]
    else:
        status = "Failed"
    if result.status in (Status.memory, Status.output_limit, Status.internal_error) and result.message:
        notes = [result.message, *notes]
    elif result.status in (Status.memory, Status.output_limit):
        notes = [f"the program hit its {result.status.value.replace('_', ' ')}", *notes]
    notes += [f"could not fetch {path}: {why}" for path, why in file_errors.items()]
    return {
        "status": status, "message": "; ".join(notes),
        "compile_result": _compile_result(compiled, return_bytes) if compiled is not None else None,
        "run_result": {"status": run_status, "execution_time": round(result.wall_s, 6), "return_code": return_code,
                       "stdout": result.stdout[:return_bytes], "stderr": result.stderr[:return_bytes]},
        "executor_pod_name": result.worker or None, "files": files,
    }


def sandbox_fusion_router(gateway: Gateway) -> APIRouter:
    api = APIRouter(tags=["SandboxFusion"])
    settings = gateway.settings

    @api.post("/run_code", summary="SandboxFusion: run one program", response_model=RunCodeResponse,
              openapi_extra=body_schema("RunCodeRequest"),
              responses={504: {"description": "overloaded (not run): SandboxFusion's clients retry this"}})
    async def run_code(request: Request) -> Response:
        body = parse(request, RunCodeRequest)
        try:  # what the document says of every request, whatever its language
            for path in [*body.files, *body.fetch_files]:
                check_path(path)
        except InvalidRequest as exc:
            raise ApiError(422, str(exc)) from None
        if body.language not in (*PYTHON_LANGUAGES, PYTEST, CPP):
            # `Failed`, not `SandboxError`: the sandbox-fusion client retries a SandboxError (and any
            # non-200) with backoff, ~17 s for an answer that cannot change. `Failed` with neither a
            # compile nor a run result is what its summary reads as a plain failure; `message` says why.
            return JSONResponse({"status": "Failed", "compile_result": None, "run_result": None,
                                 "message": f"language {body.language!r} is not supported by this server: "
                                            "only python, pytest and cpp run here", "executor_pod_name": None,
                                 "files": {}})
        try:
            call, notes, pytest_run = _fusion_request(body, settings)
        except ValidationError as exc:
            raise ApiError(422, validation_errors(exc)) from None
        except InvalidRequest as exc:
            raise ApiError(422, str(exc)) from None
        [result] = await gateway.answer(request, [call])  # a refused call comes back `rejected`: 422
        code, headers = answered(result, SANDBOX_FUSION)
        if code != 200:  # overloaded: 504, which SandboxFusion's clients retry
            raise ApiError(code, result.message or result.status.value, headers)
        return JSONResponse(_fusion_response(result, notes, settings.sandbox_fusion_output_bytes, pytest_run))

    @api.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    return api
