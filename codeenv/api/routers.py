"""open-r1's code-reward routers: codeenv answers as its E2B and Morph routers do.

open-r1 (TRL GRPO) posts a batch of reward scripts to a router (`code_provider: e2b` with
`e2b_router_url: "HOST:PORT"`, or `morph` with `morph_router_url: "HOST:PORT/morph"`); the script's
last expression is the reward (`float(execution.text)`).

- E2B: ``POST /execute_batch`` ``{"scripts", "languages", "timeout", "request_timeout"}`` -> a list,
  in request order, of ``{"execution": {"results": [{"text", "is_main_result"}], "logs": {"stdout",
  "stderr"}, "error": {"name", "value", "traceback"} | null, "execution_count"} | null,
  "exception_str": str | null}`` (only keys that e2b-code-interpreter's models take).
- Morph: ``POST /morph/execute_batch`` (the same body) -> ``[{"text", "exception_str"}]``.
- ``GET /health`` and ``GET /morph/health``: ``{"status": "ok"}``.

A script runs as a call with `display_last` and the wall limit `timeout` (clamped to the cap);
one that runs past it has no execution, and an `exception_str` that says so, as the routers' own
timeouts do. Only Python runs: any other language is answered with an `exception_str`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from codeenv.api.service import Gateway, body_schema, parse
from codeenv.errors import ApiError
from codeenv.models import ExecRequest, ExecResult, Limits, Status, Text

#: The routes that take a JSON body (Guard reads and parses it).
JSON_PATHS = frozenset({"/execute_batch", "/morph/execute_batch"})
#: What open-r1 sends as a script's language (it always sends "python").
PYTHON = frozenset({"python", "python3", "py"})


class ScriptBatch(BaseModel):
    """The body both routers take. Older open-r1 clients send one `language` for all scripts."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"scripts": ["0.5 + 0.5"], "languages": ["python"], "timeout": 10},
    ]})

    scripts: list[Text]
    languages: list[Text] | None = None
    language: Text | None = None
    timeout: float = Field(300, gt=0, allow_inf_nan=False, description="seconds per script")
    request_timeout: float | None = Field(None, description="the hosted sandbox's HTTP timeout: not used")

    @model_validator(mode="after")
    def _one_language_per_script(self) -> ScriptBatch:
        # One per script (open-r1 sends that); a script without one is `language`'s (or python),
        # languages past the last script name nothing.
        given = self.languages or []
        self.languages = [*given[: len(self.scripts)],
                          *[self.language or "python"] * max(0, len(self.scripts) - len(given))]
        return self


class E2BResult(BaseModel):
    text: str | None
    is_main_result: bool


class E2BLogs(BaseModel):
    stdout: list[str]
    stderr: list[str]


class E2BError(BaseModel):
    name: str
    value: str
    traceback: str


class E2BExecution(BaseModel):
    results: list[E2BResult]
    logs: E2BLogs
    error: E2BError | None
    execution_count: int


class E2BAnswer(BaseModel):
    """One script's answer, as open-r1's E2B router gives it."""

    execution: E2BExecution | None
    exception_str: str | None


class MorphAnswer(BaseModel):
    """One script's answer, as open-r1's Morph router gives it."""

    text: str | None
    exception_str: str | None


class Health(BaseModel):
    status: str = "ok"


def _limits(batch: ScriptBatch, gateway: Gateway) -> Limits:
    return Limits(wall_s=min(batch.timeout, gateway.settings.caps.wall_s))


async def _run(request: Request, gateway: Gateway) -> tuple[ScriptBatch, list[ExecResult | str]]:
    """Each script's result, or why it was not run (a language other than Python)."""
    batch = parse(request, ScriptBatch)
    if len(batch.scripts) > gateway.settings.max_batch:
        raise ApiError(422, f"a batch holds at most {gateway.settings.max_batch} scripts; "
                            f"this one has {len(batch.scripts)}")
    assert batch.languages is not None
    limits = _limits(batch, gateway)
    runnable = [ExecRequest(code=script, limits=limits, display_last=True)
                for script, language in zip(batch.scripts, batch.languages, strict=True)
                if language.lower() in PYTHON]
    results = iter(await gateway.answer(request, runnable))
    return batch, [next(results) if language.lower() in PYTHON
                   else f"language {language!r} is not supported: codeenv runs python"
                   for language in batch.languages]


def _failure(result: ExecResult, timeout: float) -> str | None:
    """Why a script has no execution (the router's exception_str), or None if it has one."""
    if result.status == Status.timeout:
        return f"TimeoutError: the script ran past its timeout of {timeout:g}s"
    if result.status in (Status.overloaded, Status.internal_error, Status.rejected):
        return f"{result.status.value}: {result.message or 'the script could not be run'}"
    return None


def _error(result: ExecResult) -> dict[str, str] | None:
    """E2B's execution.error for a script that failed (an uncaught exception as Jupyter shows it)."""
    if result.status == Status.ok:
        return None
    if result.error is not None:
        return {"name": result.error.type, "value": result.error.message, "traceback": result.stderr}
    names = {Status.memory: "MemoryError", Status.output_limit: "OutputLimitExceeded", Status.killed: "Killed"}
    if result.status in names:
        return {"name": names[result.status], "value": result.message or "", "traceback": result.stderr}
    return {"name": "SystemExit", "value": str(result.exit_code), "traceback": result.stderr}


def e2b_answer(result: ExecResult | str, timeout: float) -> dict[str, Any]:
    if isinstance(result, str):
        return {"execution": None, "exception_str": result}
    failure = _failure(result, timeout)
    if failure is not None:
        return {"execution": None, "exception_str": failure}
    main = [{"text": result.value, "is_main_result": True}] if result.value is not None and result.status == Status.ok \
        else []
    return {"execution": {"results": main,
                          "logs": {"stdout": [result.stdout] if result.stdout else [],
                                   "stderr": [result.stderr] if result.stderr else []},
                          "error": _error(result), "execution_count": 1},
            "exception_str": None}


def morph_answer(result: ExecResult | str, timeout: float) -> dict[str, Any]:
    if isinstance(result, str):
        return {"text": None, "exception_str": result}
    failure = _failure(result, timeout)
    if failure is not None:
        return {"text": None, "exception_str": failure}
    text = (result.value if result.status == Status.ok else None) or result.stdout
    if text:
        return {"text": text, "exception_str": None}
    error = _error(result)
    return {"text": "", "exception_str": f"{error['name']}: {error['value']}" if error else "No output from execution"}


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()

    @api.post("/execute_batch", tags=["open-r1"], response_model=list[E2BAnswer],
              openapi_extra=body_schema("ScriptBatch"))
    async def execute_batch(request: Request) -> JSONResponse:
        """open-r1's E2B router: run scripts, answer each as an E2B execution."""
        batch, results = await _run(request, gateway)
        return JSONResponse([e2b_answer(r, batch.timeout) for r in results])

    @api.post("/morph/execute_batch", tags=["open-r1"], response_model=list[MorphAnswer],
              openapi_extra=body_schema("ScriptBatch"))
    async def morph_execute_batch(request: Request) -> JSONResponse:
        """open-r1's Morph router: run scripts, answer each with its text."""
        batch, results = await _run(request, gateway)
        return JSONResponse([morph_answer(r, batch.timeout) for r in results])

    @api.get("/health", tags=["open-r1"], response_model=Health)
    @api.get("/morph/health", tags=["open-r1"], response_model=Health)
    async def health() -> dict[str, str]:
        """As the routers answer it."""
        return {"status": "ok"}

    return api
