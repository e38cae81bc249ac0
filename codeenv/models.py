"""The wire schema: what the client and the server exchange (requests, limits, results, statuses).

It knows nothing of the server's settings: checking a request against them is admission's job
(`codeenv.admission`), on the server side.
"""

from __future__ import annotations

import re
import sys
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    StringConstraints,
    field_validator,
    model_validator,
)

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # the client side runs on 3.10 too: the same behaviour, what StrEnum adds to (str, Enum)

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


#: The header that names who a session belongs to: a secret of the client's (16 to 256 visible ASCII
#: characters), sent with every request about its sessions. The server keeps only its hash.
SESSION_KEY_HEADER = "x-codeenv-session-key"


class Status(StrEnum):
    """How a call ended. Only `internal_error` and `overloaded` are the service's doing."""

    ok = "ok"
    error = "error"
    timeout = "timeout"
    memory = "memory"
    output_limit = "output_limit"
    killed = "killed"
    overloaded = "overloaded"
    internal_error = "internal_error"
    rejected = "rejected"
    session_lost = "session_lost"  # the session ended (expired, evicted, its worker restarted, or lost mid-cell)


class Refusal(StrEnum):
    """Why a call was refused (a `rejected` result), as data: each API answers it in its own terms."""

    invalid = "invalid"  # the request cannot be run as sent (its message says what to fix)
    no_session = "no_session"  # it names a session that never existed here (or is another caller's)
    id_taken = "id_taken"  # its client id already names a different call
    problem_unknown = "problem_unknown"  # it names a problem package not uploaded here (PUT /v1/problems/{sha256})


#: Verdicts that are the program's doing (a tool error, from the model's point of view).
PROGRAM_FAILURES = frozenset({Status.error, Status.timeout, Status.memory, Status.output_limit, Status.killed})
#: Verdicts that are the service's doing: not held against the model.
SERVICE_FAULTS = frozenset({Status.overloaded, Status.internal_error, Status.rejected, Status.session_lost})


class LimitName(StrEnum):
    """Which limit fired."""

    wall = "wall"
    cpu = "cpu"
    memory = "memory"
    output = "output"
    pids = "pids"
    file_size = "file_size"


# Each limit is declared once, constraint and meaning, and used both as a full set (`LimitValues`:
# the server's caps and defaults, and what a call runs with) and as a request's choices (`Limits`).
def _integral(value: Any) -> Any:
    """A JSON number with no fraction (1024.0) is the integer it names, as JSON Schema's "integer"
    says; anything else is left for strict validation (a bool or a string is not a number)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer field of a request: strict, but 1024.0 is 1024.
Integer = Annotated[int, BeforeValidator(_integral)]
WallS = Annotated[float, Field(gt=0, allow_inf_nan=False, description="wall-clock seconds")]
CpuS = Annotated[float, Field(gt=0, allow_inf_nan=False, description="CPU seconds, all processes of the call")]
MemoryMb = Annotated[int, Field(gt=0, description="memory of all processes of the call, MiB"),
    BeforeValidator(_integral)]
OutputBytes = Annotated[int, Field(gt=0, description="bytes kept per stream (stdout, stderr)"),
    BeforeValidator(_integral)]
Processes = Annotated[int, Field(gt=0, description="processes and threads the call may have at once"),
    BeforeValidator(_integral)]
OpenFiles = Annotated[int, Field(ge=16, description="open files per process"),
    BeforeValidator(_integral)]
FileSizeMb = Annotated[int, Field(gt=0, description="largest file the call may write, MiB"),
    BeforeValidator(_integral)]


class LimitValues(BaseModel):
    """One full set of per-call limits (the server's caps, its defaults, what a call runs with)."""

    wall_s: WallS
    cpu_s: CpuS
    memory_mb: MemoryMb
    output_bytes: OutputBytes
    processes: Processes
    open_files: OpenFiles
    file_size_mb: FileSizeMb


class Limits(BaseModel):
    """Per-call limits a request may ask for; each may only lower the server's cap."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"wall_s": 5, "memory_mb": 512},
    ]})

    wall_s: WallS | None = None
    cpu_s: CpuS | None = None
    memory_mb: MemoryMb | None = None
    output_bytes: OutputBytes | None = None
    processes: Processes | None = None
    open_files: OpenFiles | None = None
    file_size_mb: FileSizeMb | None = None


def _valid_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text (no lone surrogates): {exc}") from None
    return value


#: Bytes of each stream (and of a returned value) a judged test's result carries; the comparison sees all.
RETURNED_BYTES = 4096


def printable(text: str) -> str:
    """`text` (something a program produced: an exception's message, a repr) with every lone surrogate
    replaced by U+FFFD, so that any encoder takes it; one program's text never fails a response."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


#: A string that can be encoded (JSON may carry lone surrogates like "\ud800"; nothing can send them on).
Text = Annotated[str, AfterValidator(_valid_text)]


class Language(StrEnum):
    """The language of a call's code."""

    python = "python"
    cpp = "cpp"


#: The C++ compiler's flag presets (see the README's "C++"): codeforces' and IOI's own, and code-judge's.
CppPreset = Literal["codeforces", "ioi", "plain"]
#: The C++ standards a submission may ask for.
CppStd = Literal["c++11", "c++14", "c++17", "c++20", "gnu++11", "gnu++14", "gnu++17", "gnu++20"]


#: A file compiled beside C++ code (a header such as testlib.h, an IOI task's grader or stub).
SOURCE_FILE_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
#: How many such files, and the most bytes the code and they may hold together.
SOURCE_FILES_MAX, SOURCE_FILES_MAX_BYTES = 16, 4 << 20

#: A call's training-step label: a count, so the service's figures keep a bounded table of steps.
STEP_MAX = 2**31 - 1
Step = Annotated[int, Field(ge=0, le=STEP_MAX), BeforeValidator(_integral)]  # an Integer, bounded
STEP_DOC = ("the trainer's step this call belongs to (a count): each gateway keeps the figures of the last "
            "64 steps it saw (GET /v1/steps)")


def _check_source_files(code: str, files: dict[str, str], what: str) -> None:
    """ValueError unless `files` (compiled beside `code`) have plain names and fit the caps."""
    for name in files:
        if not re.fullmatch(SOURCE_FILE_PATTERN, name) or name in ("solution.cpp", "solution"):
            raise ValueError(f"{what} file name {name!r}: a plain file name (letters, digits, _ . -), not "
                             "solution.cpp")
    size = len(code.encode()) + sum(len(v.encode()) for v in files.values())
    if size > SOURCE_FILES_MAX_BYTES:
        raise ValueError(f"the {what}'s source and files hold {size} bytes; the limit is {SOURCE_FILES_MAX_BYTES}")


#: JSON Schema: a request that sets a field only C++ takes (preset, std, graders).
CPP_FIELDS_SET: dict[str, Any] = {"anyOf": [
    {"required": ["std"], "properties": {"std": {"type": "string"}}},
    {"required": ["preset"], "properties": {"preset": {"type": "string"}}},
    {"required": ["graders"], "properties": {"graders": {"minProperties": 1}}},
]}
#: JSON Schema of the names of files compiled beside C++ code.
SOURCE_FILE_NAMES: dict[str, Any] = {"propertyNames": {"pattern": SOURCE_FILE_PATTERN,
                                                       "not": {"enum": ["solution.cpp", "solution"]}}}


def _check_language(language: Language, preset: str | None, std: str | None) -> None:
    if language is not Language.cpp and (preset is not None or std is not None):
        raise ValueError("preset and std are for language cpp")


class ExecRequest(BaseModel):
    """One program to run."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"code": "import sympy\nprint(sympy.factorint(2**32 + 1))", "limits": {"wall_s": 5}},
                     {"code": "n = int(input())\nn * 2", "stdin": "21", "display_last": True}],
        "allOf": [  # what _session_cell checks
        {"if": {"required": ["cell_id"], "properties": {"cell_id": {"type": "string"}}},
         "then": {"required": ["session"], "properties": {"session": {"type": "string"}}}},
        {"if": {"required": ["session"], "properties": {"session": {"type": "string"}}},
         "then": {"properties": {"files": {"maxProperties": 0}, "fetch_files": {"maxItems": 0},
                                 "judge": {"type": "null"}}}},
        # and what admission.judge_limits checks: the tests carry a judged call's input
        {"if": {"required": ["judge"], "properties": {"judge": {"type": "object"}}},
         "then": {"properties": {"stdin": {"maxLength": 0}, "files": {"maxProperties": 0},
                                 "fetch_files": {"maxItems": 0}}}},
        # and what _check_language and _session_cell check of C++
        {"if": CPP_FIELDS_SET, "then": {"required": ["language"], "properties": {"language": {"const": "cpp"}}}},
        {"if": {"required": ["language"], "properties": {"language": {"const": "cpp"}}},
         "then": {"properties": {"session": {"type": "null"}, "display_last": {"const": False},
                                 "judge": {"anyOf": [{"type": "null"},
                                                     {"properties": {"fn_name": {"type": "null"}}}]}}}},
    ]})

    code: Text
    stdin: Text = ""
    limits: Limits = Field(default_factory=Limits)
    id: Text | None = Field(None, max_length=128, description="the caller's call id")
    profile: Text | None = Field(
        None, description="zygote profile to run in (default: the lightest that covers the imports)"
    )
    deadline_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="must start within this many seconds, or it is answered overloaded and never run",
    )
    step: Step | None = Field(None, description=STEP_DOC)
    files: dict[Text, str] = Field(
        default_factory=dict, description="files to write into the work dir first: relative path -> base64 content"
    )
    fetch_files: list[Text] = Field(
        default_factory=list, description="files to read back from the work dir after the run (relative paths)"
    )
    display_last: bool = Field(False, description="report the repr of the last top-level expression as "
                                                  "`value` (Jupyter's Out[n])")
    judge: JudgeSpec | None = Field(None, description="set by /v1/judge (and the client's judge(), which "
                                                      "batches judged calls with others): run the code "
                                                      "against these tests")
    session: Text | None = Field(None, max_length=200, description="run as the next cell of this live session "
                                                                  "(POST /v1/sessions); its value is reported")
    cell_id: Text | None = Field(None, max_length=128, description="with session: a retried cell with the same "
                                                                  "id gets the first one's result, never runs twice")
    language: Language = Field(Language.python, strict=False,
                               description="python, or cpp: the code is C++, compiled once in a jail of its own "
                                           "(preset, std) and its binary run under the limits")
    preset: CppPreset | None = Field(None, description="cpp: the compiler's flags (codeforces by default)")
    std: CppStd | None = Field(None, description="cpp: the C++ standard (the preset's by default)")
    graders: dict[str, Text] = Field(default_factory=dict, max_length=SOURCE_FILES_MAX,
                                     description="cpp: files compiled beside the code, by name (headers, an IOI "
                                                 "task's grader and stub: C++ sources among them are linked with it)",
                                     json_schema_extra=SOURCE_FILE_NAMES)

    #: With `session`: who asks (the hash of the X-Codeenv-Session-Key the gateway received; b"" for
    #: in-process callers). Never on the wire: the gateway sets it from the request's header.
    _owner: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _session_cell(self) -> ExecRequest:
        if self.cell_id is not None and self.session is None:
            raise ValueError("cell_id needs a session")
        if self.session is not None and (self.files or self.fetch_files or self.judge is not None):
            raise ValueError("a session's cell takes no files, fetch_files or judge: its files live in the "
                             "session's work dir")
        _check_language(self.language, self.preset, self.std)
        if self.language is Language.cpp:
            if self.session is not None or self.display_last:
                raise ValueError("language cpp runs a compiled program: it takes no session or display_last")
            if self.judge is not None and self.judge.fn_name is not None:
                raise ValueError("language cpp takes stdin tests only, not fn_name")
        elif self.judge is not None and self.judge.interactor is not None and self.judge.interactor.several:
            raise ValueError("a manager that talks with several processes, or gives them paths (fifo_io), judges "
                             "C++ submissions (language cpp)")
        if self.graders:
            if self.language is not Language.cpp:
                raise ValueError("graders are compiled with C++ code: they need language cpp")
            _check_source_files(self.code, self.graders, "submission")
        return self


#: A session id the client chooses: visible ASCII of a small alphabet; not beginning with hex digits
#: and a dot, the shape of the ids the service makes (a worker's tag, then epoch.counter.MAC).
CLIENT_SESSION_ID = r"^(?![0-9a-f]{1,16}\.)[A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}$"
SERVICE_ID_START = re.compile(r"[0-9a-f]{1,16}\.", re.ASCII)


#: Most host functions one session has.
HOST_FUNCTIONS_MAX = 16
#: Most bytes of one host call's arguments, and of its result, as JSON (one message of the jail's
#: channels carries each).
HOST_CALL_BYTES_MAX = 60_000


#: A host function's name (a Python identifier), a header's name and value, and a function's URL
#: (http or https, no user info), as the schema says them.
HOST_FUNCTION_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
HEADER_NAME = r"^[A-Za-z0-9-]{1,64}$"
HEADER_VALUE = r"^[\x20-\x7e]{0,4096}$"
HOST_FUNCTION_URL = r"^https?://[^/?#@\x00-\x20\x7f]+(/[^\x00-\x20\x7f]*)?$"
FunctionName = Annotated[str, StringConstraints(pattern=HOST_FUNCTION_NAME)]


class HostFunction(BaseModel):
    """A function a session's code calls by name; the worker forwards each call to `url` (POST, JSON
    `{"function", "args", "kwargs", "session_id"}`) and the answer's JSON is what the call returns."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re")

    url: str = Field(max_length=2048, pattern=HOST_FUNCTION_URL,
                     description="where the worker POSTs each call: an http(s) URL without user info that the "
                                 "operator allows (CODEENV_HOST_FUNCTION_URLS; loopback by default)")
    headers: dict[Annotated[str, StringConstraints(pattern=HEADER_NAME)],
                  Annotated[str, StringConstraints(pattern=HEADER_VALUE)]] = Field(
        default_factory=dict, max_length=16, json_schema_extra={"additionalProperties": False},
        description="sent with each call (a bearer token, say); they never enter the jail, and no answer shows "
                    "them. Content-Type, Content-Length, Transfer-Encoding and Connection are the request's own")
    timeout_s: float = Field(30.0, gt=0, le=600, allow_inf_nan=False, description="one call's limit")


#: Headers a host function's call sets itself (a function's own of these names are not sent).
HEADERS_OF_THE_REQUEST = frozenset({"content-length", "content-type", "transfer-encoding", "connection"})


class HostBudget(BaseModel):
    """How much a session's host functions may be called: per cell and per session, calls, their time
    and their bytes (arguments and results). A call past a budget is refused (the code gets an error)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    cell_calls: Integer = Field(64, ge=0, le=100_000)
    cell_s: float = Field(300.0, ge=0, le=86_400, allow_inf_nan=False, description="total wall time of a cell's calls")
    cell_bytes: Integer = Field(4 << 20, ge=0, le=1 << 30)
    session_calls: Integer = Field(4096, ge=0, le=10_000_000)
    session_s: float = Field(3600.0, ge=0, le=604_800, allow_inf_nan=False)
    session_bytes: Integer = Field(256 << 20, ge=0, le=1 << 40)


class HostFunctions(BaseModel):
    """A session's host functions and their budget, as a worker takes them."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re")

    functions: dict[FunctionName, HostFunction] = Field(max_length=HOST_FUNCTIONS_MAX,
                                                        json_schema_extra={"additionalProperties": False})
    budget: HostBudget = Field(default_factory=HostBudget)


class HostCall(BaseModel):
    """One host function call of a cell, in its result."""

    name: str
    status: Literal["ok", "error", "refused", "timeout", "cancelled"] = Field(
        description="ok (the endpoint answered 2xx with JSON), error (it answered otherwise, or could not be "
                    "reached), refused (a budget, a size or an unknown name: never sent), timeout (past the "
                    "function's timeout_s), cancelled (the cell ended first: it may still have reached the endpoint)")
    ms: float = Field(description="wall time, from the worker's receipt of the call to its answer")
    bytes_in: int = Field(description="its arguments' JSON")
    bytes_out: int = Field(0, description="its result's JSON")
    http_status: int | None = None
    message: str | None = None


class SessionCreate(BaseModel):
    """A new live session (POST /v1/sessions)."""

    model_config = ConfigDict(extra="forbid", strict=True, regex_engine="python-re", json_schema_extra={"examples": [
        {"profile": "math", "limits": {"wall_s": 10}, "idle_ttl_s": 600},
    ]})

    profile: Text | None = Field(None, description="zygote profile its interpreter forks from (default: the "
                                                   "server's CODEENV_SESSION_PROFILE, math)")
    limits: Limits = Field(default_factory=Limits, description="each cell's limits unless the cell sets its own")
    idle_ttl_s: float | None = Field(None, gt=0, le=86_400, allow_inf_nan=False,
                                     description="it ends after this long without a cell (default: the server's, "
                                                 "10 minutes)")
    session_id: str | None = Field(None, pattern=CLIENT_SESSION_ID,
                                   description="an id of the caller's choosing (1 to 128 of A-Z a-z 0-9 _ . : -, "
                                               "not beginning with hex digits and a dot): the session answers to "
                                               "it for this caller's session key only; 409 while the caller has a "
                                               "live session of that id. Default: the service makes one")

    functions: dict[FunctionName, HostFunction] = Field(
        default_factory=dict, max_length=HOST_FUNCTIONS_MAX, json_schema_extra={"additionalProperties": False},
        description="host functions its code calls by name (README, \"Host functions\"): name -> {url, headers, "
                    "timeout_s}; each call leaves the jail only through the worker, which POSTs it to url")
    host_budget: HostBudget | None = Field(None, description="limits on its host function calls, per cell and per "
                                                             "session (defaults as shown; without functions, "
                                                             "nothing to limit)")

    def host(self) -> HostFunctions | None:
        """Its host functions and their budget, as a worker takes them (None: it has none)."""
        if not self.functions:
            return None
        return HostFunctions(functions=self.functions, budget=self.host_budget or HostBudget())

    @field_validator("session_id", mode="before")
    @classmethod
    def _not_the_service_shape(cls, value: object) -> object:
        if isinstance(value, str) and SERVICE_ID_START.match(value):
            raise ValueError("a session_id that begins with hex digits and a dot has the shape of the ids the "
                             "service makes; choose another")
        return value


class SessionCell(BaseModel):
    """The next cell of a session (POST /v1/sessions/{id}/execute)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"code": "import sympy\nx = sympy.Symbol('x')\nsympy.expand((x + 1) ** 3)", "cell_id": "t1-c3"},
    ]})

    code: Text
    stdin: Text = ""
    limits: Limits = Field(default_factory=Limits)
    cell_id: Text | None = Field(None, max_length=128, description="a retried cell with the same id gets the first "
                                                                  "one's result and never runs twice")
    id: Text | None = Field(None, max_length=128, description="the caller's call id, echoed in the result")

    def to_request(self, session_id: str) -> ExecRequest:
        return ExecRequest(code=self.code, stdin=self.stdin, limits=self.limits, id=self.id, session=session_id,
                           cell_id=self.cell_id, display_last=True)


#: How many forks one request makes.
ForkCount = Annotated[int, Field(ge=1, le=1024), BeforeValidator(_integral)]


class SessionFork(BaseModel):
    """Forks of a session or a snapshot (POST /v1/sessions/{id}/fork, /v1/snapshots/{id}/fork)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"count": 8}]})

    count: ForkCount | None = Field(None, description="how many forks, made at once (each its own session); "
                                                      "without it, one, answered as a session (with it, as a list)")


class SnapshotCreate(BaseModel):
    """A snapshot of a session (POST /v1/sessions/{id}/snapshot)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"ttl_s": 3600}]})

    ttl_s: float | None = Field(None, gt=0, le=86_400, allow_inf_nan=False,
                                description="it ends this long after it was taken (default: the server's "
                                            "CODEENV_SNAPSHOT_TTL_S, 30 minutes; at most a session's lifetime)")


class SessionInfo(BaseModel):
    """A live session, or a snapshot (`kind`)."""

    session_id: str = Field(description="unguessable; usable only with the X-Codeenv-Session-Key it was created "
                                        "with (and the token, if one is set)")
    session_key: str | None = Field(None, description="only in the answer to a POST /v1/sessions sent without an "
                                                      "X-Codeenv-Session-Key header: the key made for it, to send "
                                                      "in that header with every request about it")
    kind: Literal["session", "snapshot"] = "session"
    profile: str
    worker: str | None = Field(None, description="the worker that holds it")
    age_s: float
    idle_s: float
    cells: int = Field(description="cells run so far (its execution_count; a snapshot's: its source's when taken)")
    cpu_s: float = Field(0.0, description="CPU time of the cells it ran itself")
    memory_bytes: int | None = Field(None, description="memory its own cgroup holds: what it keeps beyond the "
                                                       "pages it still shares with the session it was forked from")
    family_memory_bytes: int | None = Field(None, description="memory of its family (it and its forks)")
    family_sessions: int = Field(description="sessions and snapshots in its family (it and its forks)")
    idle_ttl_s: float
    expires_in_s: float | None = Field(None, description="a snapshot's: the time left until it ends")
    functions: list[str] | None = Field(None, description="its host functions' names")
    host_calls: int | None = Field(None, description="host function calls its cells made")
    host_s: float | None = Field(None, description="their wall time")


class SnapshotInfo(BaseModel):
    """A snapshot: a session's state kept as it was, to fork from (after the session ended too)."""

    snapshot_id: str = Field(description="unguessable; usable only with the X-Codeenv-Session-Key of the session "
                                         "it was taken from")
    profile: str
    worker: str | None = None
    age_s: float
    cells: int = Field(description="cells its session had run when it was taken")
    memory_bytes: int | None = Field(None, description="memory its own cgroup holds (its work dir's files, held in "
                                                       "its memory, and what it no longer shares)")
    family_memory_bytes: int | None = None
    expires_in_s: float

    @classmethod
    def of(cls, info: SessionInfo) -> SnapshotInfo:
        return cls(snapshot_id=info.session_id, profile=info.profile, worker=info.worker, age_s=info.age_s,
                   cells=info.cells, memory_bytes=info.memory_bytes, family_memory_bytes=info.family_memory_bytes,
                   expires_in_s=info.expires_in_s or 0.0)


class ForkList(BaseModel):
    """The forks a request with a `count` made, in one order in both lists."""

    session_ids: list[str]
    sessions: list[SessionInfo]


class SessionList(BaseModel):
    sessions: list[SessionInfo]
    snapshots: list[SnapshotInfo] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    """An uncaught exception, as the program itself reported it."""

    type: str
    message: str
    line: int | None = None


class ExecResult(BaseModel):
    """The structured outcome of one call."""

    id: str | None = None
    status: Status
    refusal: Refusal | None = Field(None, description="why a `rejected` call was refused: invalid (the request "
                                                      "cannot be run as sent), no_session (it names no session of "
                                                      "yours), id_taken (its id names a different call)")
    limit: LimitName | None = None
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: ErrorInfo | None = None
    started: bool = False
    queue_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    memory_peak_kb: int | None = None
    worker: str = ""
    profile: str | None = None
    image: str | None = None
    python: str | None = Field(None, description="the interpreter's version in the image that ran the call")
    files: dict[str, str] | None = Field(None, description="fetched files: path -> base64 content")
    file_errors: dict[str, str] | None = Field(None, description="files that could not be fetched: path -> why")
    message: str | None = None
    host_calls: list[HostCall] | None = Field(None, description="a session's cell: its host function calls, in "
                                                                "order (a rolled-back cell's too: they cannot be "
                                                                "undone)")
    host_s: float | None = Field(None, description="a session's cell: the wall time of its host calls, which its "
                                                   "CPU limit does not count (its wall limit does)")
    value: str | None = Field(None, description="with display_last: the repr of the last top-level expression, "
                                                "if it was one and not None (at most 8,192 characters)")
    judge: JudgeOutcome | None = Field(None, description="a judged call's tests (see /v1/judge)")
    compile: CompileInfo | None = Field(None, description="language cpp: the compilation (a compile error: status "
                                                          "error, and the program did not run)")
    session: str | None = Field(None, description="the session this cell ran in")
    execution_count: int | None = Field(None, description="a session's cell number (Jupyter's In[n]/Out[n])")
    rolled_back: bool | None = Field(None, description="a session's cell stopped by a limit: the session is as "
                                                       "before it, but for written_files and not_restored")
    written_files: list[str] | None = Field(None, description="files a rolled-back cell created, changed or deleted "
                                                         "(\"PATH (deleted)\"): they are not restored")
    not_restored: list[str] | None = Field(None, description="what else a rolled-back cell shared with the session "
                                                        "and the rollback could not put back: shared writable "
                                                        "memory mappings (mmap, multiprocessing.Value), open files "
                                                        "whose offset or flags it moved, pipes and sockets")

    _encoded: str | None = PrivateAttr(None)

    @classmethod
    def from_json(cls, encoded: str) -> ExecResult:
        """Parse a result a worker encoded, keeping its encoding so that it is sent on as it is."""
        result = cls.model_validate_json(encoded)
        result._encoded = encoded
        return result

    def encoded(self) -> str:
        """The result as JSON, encoded once."""
        if self._encoded is None:
            self._encoded = self.model_dump_json()
        return self._encoded


# --- code rewards: a submission judged against a problem's tests (POST /v1/judge) -----------------


class Compare(StrEnum):
    """How a test's output is compared with the expected one (outside the jail)."""

    exact = "exact"  # byte for byte
    lines = "lines"  # trailing whitespace per line and trailing blank lines ignored
    tokens = "tokens"  # whitespace-separated tokens equal
    float = "float"  # tokens equal, or both numbers with |a - b| <= tol * max(1, |b|)
    codeforces = "codeforces"  # open-r1's Codeforces default: tokens equal, the words yes and no in any case


class TestStatus(StrEnum):
    """How one test ended."""

    passed = "passed"
    wrong_answer = "wrong_answer"
    timeout = "timeout"
    memory = "memory"
    error = "error"
    output_limit = "output_limit"
    killed = "killed"
    skipped = "skipped"  # not run: an earlier test failed and stop_on_failure was set
    internal_error = "internal_error"


class JudgeStatus(StrEnum):
    """How a whole submission ended. Only `internal_error`, `overloaded` and `rejected` (one item of a
    batch that could not be run) are the service's doing."""

    passed = "passed"
    failed = "failed"
    compile_error = "compile_error"
    internal_error = "internal_error"
    overloaded = "overloaded"
    rejected = "rejected"


#: A function-call test's function name (or method of class Solution): an ASCII identifier.
FN_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
#: Languages the judge runs.
JUDGE_LANGUAGES = ("python", "cpp")


class JudgeTest(BaseModel):
    """One test: `stdin` and `expected_stdout`, or (with the request's `fn_name`) `args` and `expected`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    stdin: Text | None = Field(None, description="stdin tests: the program's input")
    expected_stdout: Text | None = Field(None, description="stdin tests: the output that passes")
    args: list[Any] | None = Field(None, description="function-call tests: the positional arguments (JSON)")
    expected: Any = Field(None, description="function-call tests: the return value that passes (JSON)")


class CheckerType(StrEnum):
    """How a checker is called and how its answer is read (README, "Checkers and problem packages")."""

    testlib = "testlib"  # checker input output answer; exit 0 AC, 1 WA, 2 PE, 3 FAIL, 7 points
    cms = "cms"  # checker input answer output; a score from 0 to 1 on stdout, a message on stderr
    open_r1 = "open_r1"  # python checker.py input answer output; prints 1 or 100 when correct


class CheckerSpec(BaseModel):
    """A problem's own checker: it decides a stdin test's verdict from the test's input, the
    submission's output and the expected answer, in a jail of its own."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: CheckerType = Field(strict=False)  # its name, from JSON
    code: Text = Field(description="the checker's source")
    language: Literal["cpp", "python"] | None = Field(
        None, description="cpp (compiled once, g++ -O2 -std=gnu++17) or python; by default cpp for testlib and "
                          "cms, python for open_r1")
    files: dict[str, Text] = Field(default_factory=dict, max_length=SOURCE_FILES_MAX,
                                   description="files compiled beside the source, by name: headers such as testlib.h "
                                               "(C++ sources among them are linked with it)",
                                   json_schema_extra=SOURCE_FILE_NAMES)

    @model_validator(mode="after")
    def _fits(self) -> CheckerSpec:
        _check_source_files(self.code, self.files, "checker")
        if self.language is None:
            self.language = "python" if self.type is CheckerType.open_r1 else "cpp"
        return self


def _check_tests(tests: list[JudgeTest], fn_name: str | None, as_sent: bool) -> None:
    """ValueError unless `tests` are all of the kind `fn_name` says (stdin tests without it). A test
    `as_sent` by a caller counts the fields it gave; after a trip through a queue, those not null."""
    if fn_name is not None and not re.fullmatch(FN_NAME_PATTERN, fn_name):
        raise ValueError(f"fn_name {fn_name!r} is not an (ASCII) identifier")
    for i, test in enumerate(tests):
        given = test.model_fields_set if as_sent else {k for k, v in test if v is not None}
        if fn_name is None and (given & {"args", "expected"} or test.expected_stdout is None):
            raise ValueError(f"tests[{i}]: stdin tests have stdin and expected_stdout (args and expected are "
                             "for function-call tests, with fn_name)")
        if fn_name is not None and (given & {"stdin", "expected_stdout"} or (as_sent and "expected" not in given)):
            raise ValueError(f"tests[{i}]: function-call tests (fn_name is set) have args and expected, not "
                             "stdin or expected_stdout")


#: The most processes of a submission a Communication task's manager talks with.
PROCESSES_MAX = 16


class InteractorSpec(BaseModel):
    """An interactive problem's interactor. testlib's protocol: it talks with the submission through
    its stdin and stdout, called as `interactor input output answer`, and exits 0 (accepted), 1 or 4
    (wrong answer), 2 (presentation error), 7 (points, on stderr) or 3 (it failed). manager: CMS's
    Communication task with one process: called as `manager FROM_USER TO_USER` (the submission's
    stdout and stdin), the test's input on its stdin, it prints a score from 0 to 1 on its stdout
    and a message on stderr (or, where the problem has a checker, what the checker reads)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    code: Text = Field(description="the interactor's source")
    protocol: Literal["testlib", "manager"] = Field("testlib", description="testlib (an interactor) or manager "
                                                                           "(CMS's Communication)")
    processes: int = Field(1, ge=1, le=PROCESSES_MAX, description="manager: how many of the submission's processes "
                                                                  "it talks with (more than 1: C++ submissions)")
    user_io: Literal["std_io", "fifo_io"] = Field("std_io", description="manager: each process talks through its "
                                                                       "stdin and stdout, or through the two paths "
                                                                       "it is given (fifo_io: C++ submissions)")
    manager_args: list[Annotated[Text, Field(max_length=256)]] = Field(
        default_factory=list, max_length=16, description="manager: arguments after the pipes' paths")
    language: Literal["cpp", "python"] = Field("cpp", description="cpp (compiled once, g++ -O2 -std=gnu++17) "
                                                                  "or python")
    files: dict[str, Text] = Field(default_factory=dict, max_length=SOURCE_FILES_MAX,
                                   description="files compiled beside the source, by name (testlib.h)",
                                   json_schema_extra=SOURCE_FILE_NAMES)

    @model_validator(mode="after")
    def _fits(self) -> InteractorSpec:
        _check_source_files(self.code, self.files, "interactor")
        if self.protocol != "manager" and (self.processes != 1 or self.user_io != "std_io" or self.manager_args):
            raise ValueError("processes, user_io and manager_args are a manager's (protocol manager)")
        return self

    @property
    def several(self) -> bool:
        """The submission runs as several processes, or is given paths: C++ only."""
        return self.processes > 1 or self.user_io == "fifo_io"

    def as_checker(self) -> CheckerSpec:
        """Prepared (compiled) as a testlib checker is."""
        return CheckerSpec(type=CheckerType.testlib, code=self.code, language=self.language, files=self.files)


#: How a stdin test's program reads its input and writes its output.
InputMode = Literal["stdio", "file"]
INPUT_MODE_DOC = ("stdio, or file: the program reads input.txt and writes output.txt in its work dir (old "
                  "Codeforces problems); stdin tests, not interactive ones")


def _check_input_mode(mode: str, fn_name: str | None, interactor: InteractorSpec | None) -> None:
    if mode == "file" and (fn_name is not None or interactor is not None):
        raise ValueError("input_mode file is for stdin tests, not function-call tests or interactive problems")


class Subtask(BaseModel):
    """A group of tests scored together (IOI, CMS): its points times the lowest score among its tests."""

    model_config = ConfigDict(extra="forbid", strict=True)

    points: float = Field(ge=0, allow_inf_nan=False, description="what the subtask is worth")
    tests: list[Annotated[int, Field(ge=0), BeforeValidator(_integral)]] = Field(
        min_length=1, max_length=10_000, description="its tests, by index into tests (from 0); a test may be in "
                                                     "several subtasks")


SUBTASKS_MAX = 256


def _check_subtasks(subtasks: list[Subtask] | None, tests: int) -> None:
    """ValueError unless every subtask names tests that exist (`tests` of them)."""
    for k, subtask in enumerate(subtasks or []):
        for i in subtask.tests:
            if not 0 <= i < tests:
                raise ValueError(f"subtasks[{k}] names test {i}; the tests are 0 to {tests - 1}")


#: A problem package's name: the sha256 of its body, in lower-case hex.
PROBLEM_SHA256 = r"^[0-9a-f]{64}$"


class ProblemPackage(BaseModel):
    """A problem uploaded once (PUT /v1/problems/{sha256}, its name the sha256 of this JSON body) and
    judged by reference: `/v1/judge` with `problem` instead of the tests."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"tests": [{"stdin": "21", "expected_stdout": "42"}, {"stdin": "0", "expected_stdout": "0"}],
         "limits": {"cpu_s": 1, "memory_mb": 256}},
    ]})

    tests: list[JudgeTest] = Field(min_length=1, description="stdin tests, or function-call tests with fn_name")
    fn_name: Text | None = Field(None, max_length=256,
                                 description="function-call tests: the function, or method of class Solution")
    compare: Compare = Field(Compare.lines, strict=False)  # its name, from JSON
    float_tol: float = Field(1e-6, ge=0, allow_inf_nan=False, description="relative tolerance of compare=float")
    checker: CheckerSpec | None = Field(None, description="stdin tests: the problem's own checker")
    graders: dict[str, Text] = Field(default_factory=dict, max_length=SOURCE_FILES_MAX,
                                     description="files compiled beside a C++ submission (an IOI task's grader and "
                                                 "stub, headers)", json_schema_extra=SOURCE_FILE_NAMES)
    limits: Limits = Field(default_factory=Limits, description="the problem's per-test limits (a request's own "
                                                               "limits override them, field by field)")
    total_wall_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                       description="wall-clock seconds for all tests (unless the request says)")
    subtasks: list[Subtask] | None = Field(None, max_length=SUBTASKS_MAX, description="tests scored in groups "
                                           "(README, \"Subtasks and time_scale\")")
    interactor: InteractorSpec | None = Field(None, description="an interactive problem's interactor (README, "
                                                                "\"Interactive problems\")")
    input_mode: InputMode = Field("stdio", description=INPUT_MODE_DOC)

    @model_validator(mode="after")
    def _fits(self) -> ProblemPackage:
        if (self.checker is not None or self.interactor is not None) and self.fn_name is not None:
            raise ValueError("a checker or interactor judges stdin tests, not function-call tests (fn_name)")
        _check_input_mode(self.input_mode, self.fn_name, self.interactor)
        _check_tests(self.tests, self.fn_name, as_sent=True)
        _check_subtasks(self.subtasks, len(self.tests))
        _check_source_files("", self.graders, "problem")
        return self


class ProblemRef(BaseModel):
    """A problem judged by reference, as it travels to the worker: its name, how many tests it has
    (the gateway's admission counts them), and where the worker fetches it when its disk lacks it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sha256: str = Field(pattern=PROBLEM_SHA256)
    tests: Annotated[int, BeforeValidator(_integral)] = Field(0, ge=0, description="set by the gateway")
    url: str | None = Field(None, description="set by the gateway (whatever a caller sends is replaced)")


class JudgeSpec(BaseModel):
    """What makes a call a judged one: the tests and how to compare. Carried inside an ExecRequest
    (`judge`) from the gateway to the worker; expected answers stay with the worker, never in the jail.
    A problem judged by reference travels as `problem` without tests: the worker fills them in."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tests: list[JudgeTest] = Field(default_factory=list)
    fn_name: Text | None = Field(None, max_length=256)
    compare: Compare = Field(Compare.lines, strict=False)  # its name, from JSON
    float_tol: float = Field(1e-6, ge=0, allow_inf_nan=False)
    stop_on_failure: bool = False
    total_wall_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    language: Language = Field(Language.python, strict=False)  # its name, from JSON
    checker: CheckerSpec | None = None
    problem: ProblemRef | None = None
    subtasks: list[Subtask] | None = Field(None, max_length=SUBTASKS_MAX)
    time_scale: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)
    interactor: InteractorSpec | None = None
    input_mode: InputMode = "stdio"

    @model_validator(mode="after")
    def _tests_fit(self) -> JudgeSpec:
        if not self.tests and self.problem is None:
            raise ValueError("a judged call has tests, or a problem that holds them")
        if self.tests and self.problem is not None:
            raise ValueError("a judged call has tests or a problem that holds them, not both")
        _check_tests(self.tests, self.fn_name, as_sent=False)
        if self.tests:
            _check_subtasks(self.subtasks, len(self.tests))
        return self

    @property
    def count(self) -> int:
        """How many tests it runs (a problem's before the worker has filled them in)."""
        return self.problem.tests if self.problem is not None and not self.tests else len(self.tests)


#: What a problem's package holds, which a request judged by reference does not send.
PROBLEM_FIELDS = frozenset({"tests", "fn_name", "compare", "float_tol", "checker", "graders", "subtasks",
                            "interactor", "input_mode"})


class JudgeRequest(BaseModel):
    """A submission and a problem's tests: POST /v1/judge."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [
        {"code": "print(int(input()) * 2)", "tests": [{"stdin": "21", "expected_stdout": "42"},
                                                      {"stdin": "0", "expected_stdout": "0"}]},
        {"code": "def add(a, b):\n    return a + b", "fn_name": "add",
         "tests": [{"args": [1, 2], "expected": 3}]},
    ]})

    code: Text
    language: Text = Field("python", description="python or cpp (in any case); cpp: stdin tests, the code "
                                                 "compiled once (preset, std) and its binary run per test",
                           json_schema_extra={"pattern": "^([Pp][Yy][Tt][Hh][Oo][Nn]|[Cc][Pp][Pp])$"})
    preset: CppPreset | None = Field(None, description="cpp: the compiler's flags (codeforces by default)")
    std: CppStd | None = Field(None, description="cpp: the C++ standard (the preset's by default)")
    graders: dict[str, Text] = Field(default_factory=dict, max_length=SOURCE_FILES_MAX,
                                     description="cpp: files compiled beside the code, by name (headers, an IOI "
                                                 "task's grader and stub: C++ sources among them are linked with it)",
                                     json_schema_extra=SOURCE_FILE_NAMES)
    tests: list[JudgeTest] | None = Field(None, min_length=1,
                                          description="stdin tests, or function-call tests with fn_name (or problem)")
    problem: str | None = Field(None, pattern=PROBLEM_SHA256,
                                description="instead of tests: a problem package uploaded with PUT "
                                            "/v1/problems/{sha256} (its tests, checker, graders and limits); 409 "
                                            "problem_unknown where it is not held: upload it and send again")
    fn_name: Text | None = Field(None, max_length=256,
                                 description="function-call tests: the function, or method of class Solution")
    compare: Compare = Field(Compare.lines, strict=False)  # its name, from JSON
    float_tol: float = Field(1e-6, ge=0, allow_inf_nan=False, description="relative tolerance of compare=float")
    stop_on_failure: bool = Field(False, description="skip every test after the first failure (as a sequential run)")
    limits: Limits = Field(default_factory=Limits, description="per test; wall_s defaults to 3 x cpu_s + 1 (with a "
                                                               "problem: its limits, these override them)")
    total_wall_s: float | None = Field(None, gt=0, allow_inf_nan=False, description="wall-clock seconds for all tests")
    id: Text | None = Field(None, max_length=128, description="the caller's call id")
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="must start within this many seconds, or it is answered overloaded")
    step: Step | None = Field(None, description=STEP_DOC)
    checker: CheckerSpec | None = Field(None, description="stdin tests: the problem's own checker decides each "
                                                          "test that ran to its end (README, \"Checkers\")")
    subtasks: list[Subtask] | None = Field(None, max_length=SUBTASKS_MAX, description="tests scored in groups: "
                                           "each subtask's points times the lowest score among its tests; a "
                                           "test whose subtasks have all failed is skipped (README, "
                                           "\"Subtasks and time_scale\")")
    time_scale: float = Field(1.0, gt=0, le=10, allow_inf_nan=False,
                              description="the time limits (cpu_s, wall_s, total_wall_s; a problem's too) times "
                                          "this, up to the server's caps")
    interactor: InteractorSpec | None = Field(None, description="stdin tests: an interactive problem's "
                                                                "interactor, talking with the submission through "
                                                                "its stdin and stdout (README, \"Interactive "
                                                                "problems\")")
    interactive: bool = Field(False, description="an interactive problem: true needs its interactor (here or in "
                                                 "the problem's package)")
    input_mode: InputMode = Field("stdio", description=INPUT_MODE_DOC)

    @model_validator(mode="after")
    def _supported(self) -> JudgeRequest:
        if (self.checker is not None or self.interactor is not None) and self.fn_name is not None:
            raise ValueError("a checker or interactor judges stdin tests, not function-call tests (fn_name)")
        if self.interactive and self.interactor is None and self.problem is None:
            raise ValueError("an interactive problem needs its interactor")
        _check_input_mode(self.input_mode, self.fn_name, self.interactor)
        if self.problem is not None:
            inline = sorted(PROBLEM_FIELDS & self.model_fields_set)
            if inline:
                raise ValueError(f"a problem's package holds its {', '.join(inline)}: send them in the package "
                                 "(PUT /v1/problems/{sha256}), not with problem")
        elif self.tests is None:
            raise ValueError("send the tests, or a problem that holds them")
        else:
            _check_tests(self.tests, self.fn_name, as_sent=True)
            _check_subtasks(self.subtasks, len(self.tests))
        if self.language.lower() not in JUDGE_LANGUAGES:
            raise ValueError(f"language {self.language!r} is not supported; the judge runs "
                             f"{', '.join(JUDGE_LANGUAGES)}")
        _check_language(Language(self.language.lower()), self.preset, self.std)
        if self.graders:
            if self.language.lower() != Language.cpp:
                raise ValueError("graders are compiled with C++ code: they need language cpp")
            _check_source_files(self.code, self.graders, "submission")
        return self

    def to_call(self) -> ExecRequest:
        """The call that judges this submission (what travels through the queue to a worker)."""
        language = Language(self.language.lower())
        spec = JudgeSpec(tests=self.tests or [], fn_name=self.fn_name, compare=self.compare,
                         float_tol=self.float_tol, stop_on_failure=self.stop_on_failure,
                         total_wall_s=self.total_wall_s, language=language, checker=self.checker,
                         problem=None if self.problem is None else ProblemRef(sha256=self.problem),
                         subtasks=self.subtasks, time_scale=self.time_scale, interactor=self.interactor,
                         input_mode=self.input_mode)
        return ExecRequest(code=self.code, limits=self.limits, id=self.id, deadline_s=self.deadline_s, judge=spec,
                           language=language, preset=self.preset, std=self.std, graders=self.graders,
                           step=self.step)


class TestResult(BaseModel):
    """The outcome of one test."""

    __test__ = False  # not a pytest test class

    status: TestStatus
    limit: LimitName | None = None
    wall_s: float = 0.0
    cpu_s: float = Field(0.0, description="the test's CPU time, the submission's preparation included")
    memory_peak_kb: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = Field("", description="truncated (the comparison saw it in full)")
    stderr: str = ""
    value: JsonValue = Field(None, description="function-call tests: the returned value, as a JSON value (null "
                                               "also when value_truncated)")
    value_truncated: bool = Field(False, description="the returned value did not come back: its JSON is over "
                                                     "4 KiB, nests deeper than 64, or holds NaN or Infinity (the "
                                                     "comparison saw it whole)")
    error: ErrorInfo | None = None
    message: str | None = None
    score: float | None = Field(None, description="a checker's score of the test (cms: 0 to 1; testlib: its points; "
                                                  "1 or 0 otherwise); null without a checker")


class SubtaskResult(BaseModel):
    """A subtask's score."""

    points: float
    score: float = Field(description="points times the lowest score among its tests (a passed test: 1, or its "
                                     "checker's score; a failed or skipped one: 0, or its checker's partial score)")
    tests: list[int]


class CompileInfo(BaseModel):
    """The submission's compilation."""

    status: str = Field(description="ok or error")
    stderr: str = Field("", description="the compiler's diagnostics (its first 64 KiB for C++)")
    limit: LimitName | None = Field(None, description="error: the compiler's limit it reached (cpu, wall, memory, "
                                                      "file_size: the binary's size)")
    message: str | None = None
    cached: bool = Field(False, description="C++: the binary came from the compile cache (same source, flags "
                                            "and toolchain)")
    wall_s: float = Field(0.0, description="C++: the compile's wall-clock time (0 from the cache)")
    cpu_s: float = Field(0.0, description="C++: the compiler's CPU time")


class JudgeOutcome(BaseModel):
    """What a worker found for a judged call (inside ExecResult.judge)."""

    passed: int = 0
    total: int = 0
    tests: list[TestResult] = Field(default_factory=list)
    compile: CompileInfo | None = None
    prepared: int = Field(0, description="how many times the submission was prepared (once per slot and restart)")
    subtasks: list[SubtaskResult] | None = None
    score: float | None = Field(None, description="with subtasks: the sum of their scores")


class JudgeResult(BaseModel):
    """The answer to POST /v1/judge."""

    id: str | None = None
    status: JudgeStatus
    passed: int = 0
    total: int = 0
    tests: list[TestResult] = Field(default_factory=list)
    compile: CompileInfo | None = None
    queue_s: float = 0.0
    wall_s: float = 0.0
    worker: str = ""
    message: str | None = None
    refusal: Refusal | None = Field(None, description="why a `rejected` submission was refused: invalid, or "
                                                      "problem_unknown (upload the problem's package and send again)")
    subtasks: list[SubtaskResult] | None = Field(None, description="with subtasks: each one's score, in order")
    score: float | None = Field(None, description="with subtasks: the sum of their scores")

    @classmethod
    def from_call(cls, result: ExecResult) -> JudgeResult:
        """The JudgeResult of a judged call's result."""
        judged = result.judge
        common: dict[str, Any] = {"id": result.id, "queue_s": result.queue_s, "wall_s": result.wall_s,
                                  "worker": result.worker, "message": result.message, "refusal": result.refusal}
        status = judge_status(result)
        if judged is None or result.status in _NOT_JUDGED:
            if judged is None and status is JudgeStatus.internal_error and not result.message:
                common["message"] = f"the call ended {result.status.value} without judging"
            return cls(status=status, **common)
        return cls(status=status, passed=judged.passed, total=judged.total, tests=judged.tests,
                   compile=judged.compile, subtasks=judged.subtasks, score=judged.score, **common)


#: A judged call's statuses that say it was not judged (the service's doing).
_NOT_JUDGED = frozenset({Status.rejected, Status.overloaded, Status.internal_error})


def judge_status(result: ExecResult) -> JudgeStatus:
    """A judged call's verdict: the service's faults, else a compile error, a test's internal error,
    passed (every test) or failed."""
    judged = result.judge
    if judged is None or result.status in _NOT_JUDGED:
        return {Status.rejected: JudgeStatus.rejected, Status.overloaded: JudgeStatus.overloaded}.get(
            result.status, JudgeStatus.internal_error)
    if judged.compile is not None and judged.compile.status == "error":
        return JudgeStatus.compile_error
    if any(t.status is TestStatus.internal_error for t in judged.tests):
        return JudgeStatus.internal_error
    return JudgeStatus.passed if judged.passed == judged.total else JudgeStatus.failed
