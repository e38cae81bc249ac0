"""Piston v2, as open-r1's Codeforces and IOI rewards call it (its `codeforces` and `cms_ioi` packages).

open-r1 points `PISTON_ENDPOINTS` at `http://HOST:PORT/api/v2` and posts one test per request:

- ``POST /api/v2/execute`` ``{"language", "version": "*", "files": [{"name", "content"}], "run_timeout"
  (ms), "run_memory_limit"?}`` -> ``{"language", "version", "run": {"stdout", "stderr", "code", "signal",
  "output"}, "compile": {...}}``; a request Piston refuses is a 400 ``{"message"}``.
- ``GET /api/v2/runtimes``: the languages (open-r1's health probe).

`codeforces` (languages `c++`, `c++11` to `c++20`, `python3`; aliases such as `c++17`, `cf_c++17`,
`cf_python3`): the first file is the submission; `input.txt`, `correct_output.txt`, `checker.py`
(open-r1's generated checker) and `grader_config` (`TIME_LIMIT` s, `MEMORY_LIMIT` MB) come beside it.
It is judged as one test (its CPU time against `TIME_LIMIT`): `run.stdout` is `1` or `0` and
`run.stderr` says why, as the package's run script prints them; a limit or crash exits 124, 134 or
the program's code. Without `correct_output.txt` the program's output is the answer.

`INPUT_MODE=file` in `grader_config`: the program reads `input.txt` and writes `output.txt`.

`cms_ioi` (Batch tasks): `graders/{task}.cpp` is the submission, compiled with `graders/grader.cpp`
and `graders/stub.cpp` where present and the headers beside them (`-DEVAL -std=gnu++17 -O2`), run on
`input.txt` under `graders/grader_config.json`'s `time_limit` (s) and `memory_limit` (bytes), scored
by `checker/checker.cpp` (CMS's protocol: a score on stdout, a message on stderr) or by comparing with
`correct_output.txt`: `run.stdout` is the score, `run.stderr` the checker's message or why it failed.
Communication tasks: `graders/manager.cpp` is compiled alone (with the headers beside it) and run as
the package runs it, `manager FROM_USER_0 TO_USER_0 ...` with `input.txt` on its stdin, talking with
`num_processes` processes of the submission (linked with `stub.cpp`) through their stdin and stdout
(`std_io`) or the paths they are given (`fifo_io`); its score, or the checker's on what it printed,
is `run.stdout`.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from codeenv.admission import to_judge_call
from codeenv.api.service import Gateway, body_schema, parse
from codeenv.errors import ApiError, InvalidRequest
from codeenv.models import (
    CheckerSpec,
    CheckerType,
    Compare,
    CppStd,
    ExecRequest,
    ExecResult,
    InteractorSpec,
    JudgeRequest,
    JudgeTest,
    Language,
    LimitName,
    Limits,
    Status,
    TestResult,
    TestStatus,
    Text,
)

#: The routes that take a JSON body (Guard reads and parses it).
JSON_PATHS = frozenset({"/api/v2/execute"})
VERSION = "1.0.0"
#: codeforces' languages: (C++ std or None for Python, aliases), as its package declares them.
CODEFORCES: dict[str, tuple[CppStd | None, tuple[str, ...]]] = {
    "c++": ("gnu++17", ("GNU C++", "cf_c++")),  # g++ 12 without -std: gnu++17
    "c++0x": ("c++11", ("GNU C++0x", "cf_c++0x")),
    "c++11": ("c++11", ("GNU C++11", "cf_c++11")),
    "c++14": ("c++14", ("C++14 (GCC 6-32)", "cf_c++14")),
    "c++17": ("c++17", ("C++17 (GCC 7-32)", "C++17 (GCC 9-64)", "cf_c++17")),
    "c++20": ("c++20", ("C++20 (GCC 11-64)", "C++20 (GCC 13-64)", "cf_c++20")),
    "python3": (None, ("Python 3", "cf_python3")),
}
CMS = {"cms": ("cms_ioi",)}
_ALIASES = {alias: name for name, (_, aliases) in CODEFORCES.items() for alias in (name, *aliases)}
_CMS_ALIASES = {alias: name for name, aliases in CMS.items() for alias in (name, *aliases)}
#: What the cms_ioi package compiles and links beside the submission.
IOI_LINKED = ("grader.cpp", "stub.cpp")


class PistonFile(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Text | None = None
    content: Text
    encoding: Literal["utf8", "base64", "hex"] = "utf8"

    def text(self) -> str:
        if self.encoding == "utf8":
            return self.content
        try:
            raw = base64.b64decode(self.content, validate=True) if self.encoding == "base64" \
                else bytes.fromhex(self.content)
            return raw.decode()
        except ValueError as exc:
            raise ApiError(400, f"file {self.name!r}: not {self.encoding}: {exc}") from None


class PistonExecute(BaseModel):
    """Piston v2's execute request (what open-r1 sends; other Piston fields are taken and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"language": "c++17", "version": "*", "run_timeout": 12000, "files": [
            {"name": "main.cpp", "content": "#include <bits/stdc++.h>\nint main(){int a,b;std::cin>>a>>b;"
                                            "std::cout<<a+b;}"},
            {"name": "input.txt", "content": "1 2"}, {"name": "correct_output.txt", "content": "3"},
            {"name": "grader_config", "content": "TIME_LIMIT=2\nMEMORY_LIMIT=256\nINPUT_MODE=stdio"}]},
    ]})

    language: Text
    version: Text = "*"
    files: list[PistonFile] = Field(min_length=1)
    stdin: Text = ""
    args: list[Text] = Field(default_factory=list)
    run_timeout: float | None = Field(None, allow_inf_nan=False, description="ms")
    compile_timeout: float | None = Field(None, allow_inf_nan=False, description="ms (not used: 30 s of CPU)")
    run_memory_limit: float | None = Field(None, allow_inf_nan=False, description="bytes (not used: the "
                                                                                  "problem's own limit is)")


class PistonStage(BaseModel):
    """A stage's outcome (compile or run), as Piston reports it."""

    stdout: str
    stderr: str
    code: int | None
    signal: str | None
    output: str


class PistonAnswer(BaseModel):
    language: str
    version: str
    run: PistonStage
    compile: PistonStage


class PistonRuntime(BaseModel):
    language: str
    version: str
    aliases: list[str]
    runtime: str


class PistonRefusal(BaseModel):
    """Piston's refusal (`message`; `detail` says the same, as codeenv's other errors do; a body that is
    not JSON is refused before the route, with `detail` only)."""

    message: str = ""
    detail: str


def refusal(message: str, status: int = 400, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"message": message, "detail": message}, status, headers)


def _stage(stdout: str = "", stderr: str = "", code: int | None = 0, signal: str | None = None) -> dict[str, Any]:
    return {"stdout": stdout, "stderr": stderr, "code": code, "signal": signal, "output": stdout + stderr}


def _answer(language: str, run: dict[str, Any], compiled: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"language": language, "version": VERSION, "run": run, "compile": compiled})


def _config(text: str) -> dict[str, str]:
    """grader_config's KEY=VALUE lines (as the package's run script `source`s them)."""
    config = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip().strip('"').strip("'")
    return config


def _number(config: dict[str, Any], key: str, where: str) -> float | None:
    value = config.get(key)
    if value in (None, ""):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ApiError(400, f"{where}: {key} is not a number: {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ApiError(400, f"{where}: {key} must be above 0: {value!r}")
    return number


async def _judge(request: Request, gateway: Gateway, judged: JudgeRequest) -> ExecResult:
    try:
        call = to_judge_call(judged)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc)) from None
    [result] = await gateway.answer(request, [call])
    return result


def _limits(gateway: Gateway, time_s: float | None, memory_mb: float | None, run_timeout_ms: float | None) -> Limits:
    caps = gateway.settings.caps
    cpu = min(time_s, caps.cpu_s) if time_s is not None else None
    wall = min(run_timeout_ms / 1000, caps.wall_s) if run_timeout_ms and run_timeout_ms > 0 else None
    if cpu is not None and wall is not None and wall < cpu:
        wall = None  # the package's own limit is the time limit; run_timeout is its backstop
    memory = min(math.ceil(memory_mb), caps.memory_mb) if memory_mb is not None else None
    return Limits(cpu_s=cpu, wall_s=wall, memory_mb=memory)


def _failure(test: TestResult, time_s: float | None, memory_mb: float | None) -> tuple[str, int]:
    """What the packages' run scripts print on stderr for a test that did not finish, and their exit code."""
    if test.status is TestStatus.timeout:
        return f"Time limit exceeded ({time_s:g}s)" if time_s else "Time limit exceeded", 124
    if test.status is TestStatus.memory:
        return f"Memory limit exceeded ({memory_mb:g}MB)" if memory_mb else "Memory limit exceeded", 134
    code = test.exit_code if test.exit_code else 128 + test.signal if test.signal else 1
    return f"Runtime error with exit code {code}", code


def _service_fault(result: ExecResult) -> JSONResponse | None:
    """The service's own failure to judge (overloaded, internal error): Piston's 500 with a message,
    which open-r1's client retries."""
    if result.status in (Status.ok, Status.rejected) and result.judge is not None:
        return None
    if result.status is Status.rejected:
        raise ApiError(400, result.message or "the request was refused")
    if result.status is Status.overloaded:
        return refusal(f"overloaded: {result.message or 'not run'}", 429, {"Retry-After": "1"})
    return refusal(f"{result.status.value}: {result.message or 'not judged'}", 500)


async def codeforces(request: Request, gateway: Gateway, body: PistonExecute, name: str) -> JSONResponse:
    """The codeforces package: one test, compared as its run script compares, or by checker.py."""
    std, _ = CODEFORCES[name]
    files = {f.name or f"file{i}": f for i, f in enumerate(body.files)}
    main = body.files[0].text()
    config = _config(files["grader_config"].text()) if "grader_config" in files else {}
    input_mode = config.get("INPUT_MODE", "stdio")
    if input_mode not in ("stdio", "file"):
        raise ApiError(400, f"INPUT_MODE={input_mode} is not supported: stdio or file")
    time_s = _number(config, "TIME_LIMIT", "grader_config")
    memory_mb = _number(config, "MEMORY_LIMIT", "grader_config")
    stdin = files["input.txt"].text().replace("\r\n", "\n") if "input.txt" in files else body.stdin
    language = "cpp" if std is not None else "python"
    compile_ok = _stage("Skipping compile - python3\n") if std is None else _stage()
    limits = _limits(gateway, time_s, memory_mb, body.run_timeout)
    if "correct_output.txt" not in files:  # the package prints the program's own output
        by_file = input_mode == "file"
        call = ExecRequest(code=main, stdin="" if by_file else stdin, limits=limits, language=Language(language),
                           preset="codeforces" if std else None, std=std,
                           files={"input.txt": base64.b64encode(stdin.encode()).decode()} if by_file else {},
                           fetch_files=["output.txt"] if by_file else [])
        [result] = await gateway.answer(request, [call])
        if result.compile is not None and result.compile.status != "ok":
            return _answer(name, _stage(code=None), _stage(stderr=result.compile.stderr, code=1))
        printed = result.stdout
        if by_file:
            printed = base64.b64decode((result.files or {}).get("output.txt", "")).decode("utf-8", "replace")
        return _answer(name, _stage(printed, result.stderr, result.exit_code or 0), compile_ok)
    checker = None
    if "checker.py" in files:
        checker = CheckerSpec(type=CheckerType.open_r1, code=files["checker.py"].text(), language="python")
    try:
        judged = JudgeRequest(code=main, language=language, preset="codeforces" if std else None,
                              std=std, compare=Compare.codeforces, checker=checker, limits=limits,
                              tests=[JudgeTest(stdin=stdin, expected_stdout=files["correct_output.txt"].text())],
                              input_mode="file" if input_mode == "file" else "stdio")
    except ValidationError as exc:
        raise ApiError(400, "; ".join(e["msg"] for e in exc.errors(include_url=False))) from None
    result = await _judge(request, gateway, judged)
    fault = _service_fault(result)
    if fault is not None:
        return fault
    assert result.judge is not None
    if result.judge.compile is not None and result.judge.compile.status != "ok":
        if std is not None:  # g++'s error
            compiled = _stage(stderr=result.judge.compile.stderr, code=1)
            return _answer(name, _stage(code=None), compiled)
        # python3 has no compile step: its syntax error is a runtime error with exit code 1
        return _answer(name, _stage("0\n", result.judge.compile.stderr + "Runtime error with exit code 1\n", 1),
                       compile_ok)
    test = result.judge.tests[0]
    if test.status is TestStatus.passed:
        said = "Output is correct (checker)" if checker else "Output is correct (diff)"
        return _answer(name, _stage("1\n", said + "\n"), compile_ok)
    if test.status is TestStatus.wrong_answer:
        said = "Output isn't correct (checker)" if checker else "Output isn't correct (diff)"
        return _answer(name, _stage("0\n", said + "\n"), compile_ok)
    if test.status is TestStatus.internal_error:
        return refusal(f"internal_error: {test.message}", 500)
    said, code = _failure(test, time_s, memory_mb)
    return _answer(name, _stage("0\n", said + "\n", code), compile_ok)


async def cms_ioi(request: Request, gateway: Gateway, body: PistonExecute, name: str) -> JSONResponse:
    """The cms_ioi package, Batch tasks: the submission linked with the task's grader and stub, one
    test, scored by the task's checker (CMS's protocol) or by comparing with the answer."""
    files = {f.name: f.text() for f in body.files if f.name}
    if "graders/grader_config.json" not in files:
        raise ApiError(400, "graders/grader_config.json not found: cms_ioi needs the task's grader files")
    try:
        config = json.loads(files["graders/grader_config.json"])
        assert isinstance(config, dict)
    except (ValueError, AssertionError):
        raise ApiError(400, "graders/grader_config.json is not a JSON object") from None
    task_type = config.get("task_type", "Batch")
    if task_type not in ("Batch", "Communication"):
        raise ApiError(400, f"task type {task_type!r} is not supported here (Batch and Communication tasks are)")
    graders = {path.removeprefix("graders/"): text for path, text in files.items()
               if path.startswith("graders/") and path.count("/") == 1}
    manager = _manager(config, graders) if task_type == "Communication" else None
    headers = sorted(n for n in graders if n.endswith(".h") and n != "testlib.h")
    task = headers[0].removesuffix(".h") if headers else str(config.get("code", ""))
    solution = graders.pop(f"{task}.cpp", None)
    if solution is None:
        raise ApiError(400, f"graders/{task}.cpp (the submission) not found")
    beside = {n: t for n, t in graders.items()
              if n.endswith((".h", ".hpp")) or n in IOI_LINKED}  # what the package compiles with it
    time_s = _number(config, "time_limit", "grader_config.json")
    memory_bytes = _number(config, "memory_limit", "grader_config.json")
    memory_mb = memory_bytes / (1 << 20) if memory_bytes is not None else None
    checker = None
    if "checker/checker.cpp" in files:
        checker = CheckerSpec(type=CheckerType.cms, code=files["checker/checker.cpp"], language="cpp",
                              files={p.removeprefix("checker/"): t for p, t in files.items()
                                     if p.startswith("checker/") and p.count("/") == 1 and p != "checker/checker.cpp"
                                     and not p.endswith(".cpp")})
    expected = files.get("correct_output.txt")
    if expected is None and checker is None and manager is None:
        raise ApiError(400, "correct_output.txt not found: the package prints the output, which codeenv does not "
                            "(send the answer, or call /v1/execute)")
    if manager is not None and expected is None:
        checker = None  # the package runs its checker only with the answer: the manager's score stands
    try:
        judged = JudgeRequest(code=solution, language="cpp", preset="ioi", graders=beside,
                              tests=[JudgeTest(stdin=files.get("input.txt", body.stdin),
                                               expected_stdout=expected or "")],
                              compare=Compare.tokens, checker=checker, interactor=manager,
                              limits=_limits(gateway, time_s, memory_mb, body.run_timeout))
    except ValidationError as exc:
        raise ApiError(400, "; ".join(e["msg"] for e in exc.errors(include_url=False))) from None
    result = await _judge(request, gateway, judged)
    fault = _service_fault(result)
    if fault is not None:
        return fault
    assert result.judge is not None
    compiled = result.judge.compile
    if compiled is not None and compiled.status != "ok":
        return _answer(name, _stage(code=None), _stage(stderr=compiled.stderr, code=1))
    test = result.judge.tests[0]
    if test.status in (TestStatus.passed, TestStatus.wrong_answer):
        if checker is None and manager is None:
            said = "Output is correct (diff)" if test.status is TestStatus.passed else "Output isn't correct (diff)"
            return _answer(name, _stage("1\n" if test.status is TestStatus.passed else "0\n", said + "\n"), _stage())
        score = test.score if test.score is not None else 0.0
        return _answer(name, _stage(f"{score:g}\n", (test.message or "") + "\n"), _stage())
    if test.status is TestStatus.internal_error:
        return refusal(f"internal_error: {test.message}", 500)
    said, _ = _failure(test, time_s, memory_mb)
    if test.limit is LimitName.memory:
        said = "Memory limit exceeded"
    return _answer(name, _stage("0\n", said + "\n"), _stage())  # the package exits 0 here


def _manager(config: dict[str, Any], graders: dict[str, str]) -> InteractorSpec:
    """A Communication task's manager, as the package compiles and runs it."""
    processes = config.get("task_type_parameters_Communication_num_processes") or 1
    user_io = config.get("task_type_parameters_Communication_user_io") or "std_io"
    extra = config.get("task_type_parameters_Communication_manager_args") or ""
    if "manager.cpp" not in graders:
        raise ApiError(400, "graders/manager.cpp not found: a Communication task needs its manager")
    try:
        return InteractorSpec.model_validate({
            "code": graders.pop("manager.cpp"), "protocol": "manager", "language": "cpp", "processes": processes,
            "user_io": user_io, "manager_args": str(extra).split(),  # as the run script's word splitting
            "files": {n: t for n, t in graders.items() if n.endswith((".h", ".hpp"))}})
    except ValidationError as exc:
        raise ApiError(400, "graders/grader_config.json: " + "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))) from None


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter(tags=["Piston"])

    @api.post("/api/v2/execute", openapi_extra=body_schema("PistonExecute"), response_model=PistonAnswer,
              responses={400: {"model": PistonRefusal, "description": "Piston's refusal: what is wrong"},
                         429: {"model": PistonRefusal, "description": "overloaded (not run): retry"},
                         500: {"model": PistonRefusal, "description": "the service could not judge it"}})
    async def execute(request: Request) -> JSONResponse:
        """Run one test of a Codeforces or IOI problem as open-r1's Piston packages do."""
        try:
            body = parse(request, PistonExecute)
            if body.language in _ALIASES:
                return await codeforces(request, gateway, body, _ALIASES[body.language])
            if body.language in _CMS_ALIASES:
                return await cms_ioi(request, gateway, body, _CMS_ALIASES[body.language])
            return refusal(f"{body.language}-{body.version} runtime is unknown")
        except ApiError as exc:  # as Piston answers: 400 {"message"}
            if exc.status_code not in (400, 422):
                raise
            detail = exc.detail if isinstance(exc.detail, str) else "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.detail)  # type: ignore[attr-defined]
            return refusal(detail)

    @api.get("/api/v2/runtimes", response_model=list[PistonRuntime])
    async def runtimes() -> list[dict[str, Any]]:
        """The runtimes, as Piston lists them (open-r1's health probe)."""
        return [*({"language": name, "version": VERSION, "aliases": list(aliases), "runtime": "codeforces"}
                  for name, (_, aliases) in CODEFORCES.items()),
                *({"language": name, "version": VERSION, "aliases": list(aliases), "runtime": "cms_ioi"}
                  for name, aliases in CMS.items())]

    return api
