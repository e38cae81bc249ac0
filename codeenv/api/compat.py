"""Drop-in endpoints for the RL stacks people run: code-judge and SandboxFusion wire formats.

Both map onto the same queue as the native API. Their clients hard-code limits, so where the
native API refuses a limit above the server's cap, these endpoints clamp it and say so.

- code-judge (rStar2-Agent's training code): ``POST /run``, ``/run/batch``, ``/run/long-batch``,
  ``/judge``, ``/judge/batch``, ``/judge/long-batch``, ``GET /ping``, ``GET /status``.
- SandboxFusion (verl's sandbox tool and reward, SkyRL, the ``sandbox-fusion`` package):
  ``POST /run_code``, ``GET /v1/ping``.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codeenv.models import ExecRequest, ExecResult, Status, Text, code_judge_reason
from codeenv.queue.base import CallQueue
from codeenv.settings import GatewaySettings

#: Runs calls through the gateway (metrics, logs, a disconnecting client cancels unstarted calls).
Answer = Callable[[Request, list[ExecRequest]], Awaitable[list[ExecResult]]]
#: Where the gateway's middleware leaves a request's parsed JSON body.
JSON_BODY = "codeenv.json"


# --- code-judge ----------------------------------------------------------------------------------


class Submission(BaseModel):
    """One program, as code-judge takes it."""

    model_config = ConfigDict(extra="ignore")

    sub_id: Text | None = None
    type: Literal["python", "cpp", "math"]
    solution: str
    input: str | None = None
    expected_output: str | None = None
    options: dict[str, Any] | None = None


class BatchSubmission(BaseModel):
    model_config = ConfigDict(extra="ignore")

    sub_id: Text | None = None
    type: Literal["batch"] = "batch"
    submissions: list[Submission] = Field(min_length=1)


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
    if sub.type != "python":
        return f"type {sub.type!r} is not supported by this server: only 'python' runs here"
    wall = settings.code_judge_wall_s or settings.defaults.wall_s
    try:
        return ExecRequest(code=sub.solution, stdin=sub.input or "", deadline_s=settings.code_judge_queue_wait_s,
                           limits={"wall_s": min(wall, settings.caps.wall_s),
                                   "output_bytes": settings.code_judge_output_bytes})
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in validation_errors(exc))


def add_code_judge(app: FastAPI, settings: GatewaySettings, calls: CallQueue, answer: Answer) -> None:
    async def run_submissions(request: Request, subs: list[Submission], with_output: bool) -> list[dict[str, Any]]:
        runnable: list[ExecRequest] = []
        slots: list[ExecResult | None] = []
        for sub in subs:
            sub.sub_id = sub.sub_id or str(uuid.uuid4())
            made = _judge_request(sub, settings)
            if isinstance(made, str):
                slots.append(ExecResult(status=Status.rejected, message=made))
            else:  # the queue refuses what cannot run (over a cap, bad Unicode): `rejected`
                runnable.append(made)
                slots.append(None)
        ran = iter(await answer(request, runnable)) if runnable else iter(())
        results = [slot if slot is not None else next(ran) for slot in slots]
        return [_judge_result(s, r, settings.code_judge_return_chars, with_output)
                for s, r in zip(subs, results, strict=True)]

    def parse[M: BaseModel](request: Request, model: type[M]) -> M | Response:
        try:
            return model.model_validate(request.scope[JSON_BODY])
        except ValidationError as exc:
            return JSONResponse({"detail": validation_errors(exc)}, 422)

    def one(with_output: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            sub = parse(request, Submission)
            if isinstance(sub, Response):
                return sub
            [result] = await run_submissions(request, [sub], with_output)
            return JSONResponse(result)
        return endpoint

    def batch(with_output: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            body = parse(request, BatchSubmission)
            if isinstance(body, Response):
                return body
            if len(body.submissions) > settings.max_batch:
                return JSONResponse({"detail": f"a batch holds at most {settings.max_batch} submissions"}, 422)
            results = await run_submissions(request, body.submissions, with_output)
            return JSONResponse({"sub_id": body.sub_id or str(uuid.uuid4()), "results": results})
        return endpoint

    tags: list[str | Enum] = ["code-judge"]
    for prefix, with_output in (("/run", True), ("/judge", False)):
        app.add_api_route(prefix, one(with_output), methods=["POST"], tags=tags,
                          summary=f"code-judge: {prefix[1:]} one submission")
        for path in (f"{prefix}/batch", f"{prefix}/long-batch"):
            # The same here: a submission that cannot start within code_judge_queue_wait_s (< 60 s,
            # rStar2-Agent's client timeout) is answered queue_timeout and never runs.
            app.add_api_route(path, batch(with_output), methods=["POST"], tags=tags,
                              summary=f"code-judge: {prefix[1:]} a batch of submissions")

    @app.get("/ping", tags=tags)
    async def ping() -> str:
        return "pong"

    @app.get("/status", tags=tags)
    async def status() -> dict[str, int]:
        stats = calls.stats()
        return {"queue": int(stats["waiting"]), "num_workers": int(stats["workers"])}


# --- SandboxFusion -------------------------------------------------------------------------------


class RunCodeRequest(BaseModel):
    """SandboxFusion's /run_code request (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    code: str
    language: str = "python"
    stdin: str | None = None
    run_timeout: float = 10
    compile_timeout: float = 10
    memory_limit_MB: int = -1
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


PYTHON_LANGUAGES = ("python", "python3", "pytest")


def _fusion_request(body: RunCodeRequest, settings: GatewaySettings) -> tuple[ExecRequest, list[str]]:
    """Our request, with the client's limits clamped to the server's caps (and notes saying so)."""
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
    request = ExecRequest(
        code=body.code, stdin=body.stdin or "",
        limits={"wall_s": wall, "memory_mb": memory,
                "output_bytes": min(settings.sandbox_fusion_output_bytes, caps.output_bytes)},
        files={path: content or "" for path, content in body.files.items()}, fetch_files=body.fetch_files)
    return request, notes


def _fusion_response(result: ExecResult, notes: list[str], return_bytes: int) -> dict[str, Any]:
    run_status = "TimeLimitExceeded" if result.status == Status.timeout else "Finished"
    return_code = None if result.status == Status.timeout else (
        -result.signal if result.signal is not None else result.exit_code)
    if result.status == Status.internal_error:
        status, run_status = "SandboxError", "Error"
    elif result.status == Status.ok and return_code == 0:
        status = "Success"
    else:
        status = "Failed"
    if result.status in (Status.memory, Status.output_limit, Status.internal_error) and result.message:
        notes = [result.message, *notes]
    elif result.status in (Status.memory, Status.output_limit):
        notes = [f"the program hit its {result.status.value.replace('_', ' ')}", *notes]
    notes += [f"could not fetch {path}: {why}" for path, why in (result.file_errors or {}).items()]
    return {
        "status": status, "message": "; ".join(notes), "compile_result": None,
        "run_result": {"status": run_status, "execution_time": round(result.wall_s, 6), "return_code": return_code,
                       "stdout": result.stdout[:return_bytes], "stderr": result.stderr[:return_bytes]},
        "executor_pod_name": result.worker or None, "files": result.files or {},
    }


def add_sandbox_fusion(app: FastAPI, settings: GatewaySettings, answer: Answer) -> None:
    tags: list[str | Enum] = ["SandboxFusion"]

    @app.post("/run_code", tags=tags, summary="SandboxFusion: run one program")
    async def run_code(request: Request) -> Response:
        try:
            body = RunCodeRequest.model_validate(request.scope[JSON_BODY])
        except ValidationError as exc:
            return JSONResponse({"detail": validation_errors(exc)}, 422)
        if body.language not in PYTHON_LANGUAGES:
            return JSONResponse({"status": "SandboxError", "compile_result": None, "run_result": None,
                                 "message": f"language {body.language!r} is not supported by this server: "
                                            "only python runs here", "executor_pod_name": None, "files": {}})
        try:
            call, notes = _fusion_request(body, settings)
        except ValidationError as exc:
            return JSONResponse({"detail": validation_errors(exc)}, 422)
        [result] = await answer(request, [call])  # what the queue refuses comes back `rejected`: 422
        if result.status == Status.overloaded:
            # What SandboxFusion's clients retry (verl: only 504).
            return JSONResponse({"detail": result.message or "overloaded"}, 504, {"Retry-After": "1"})
        if result.status == Status.rejected:
            return JSONResponse({"detail": result.message}, 422)
        return JSONResponse(_fusion_response(result, notes, settings.sandbox_fusion_output_bytes))

    @app.get("/v1/ping", tags=tags)
    async def ping() -> str:
        return "pong"


def validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]}
            for e in exc.errors(include_url=False, include_context=False, include_input=False)]
