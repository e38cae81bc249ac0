"""The data codeenv takes and gives: requests, limits and structured results."""

from __future__ import annotations

import base64
import binascii
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr

from codeenv.errors import InvalidRequest, LimitExceedsCap

if TYPE_CHECKING:
    from codeenv.settings import SandboxSettings


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


#: Verdicts that are the program's doing (a tool error, from the model's point of view).
PROGRAM_FAILURES = frozenset({Status.error, Status.timeout, Status.memory, Status.output_limit, Status.killed})
#: Verdicts that are the service's doing: not held against the model.
SERVICE_FAULTS = frozenset({Status.overloaded, Status.internal_error, Status.rejected})


def code_judge_reason(status: Status) -> str:
    """code-judge's `reason` for one of our verdicts ("" for a run that ended, however it ended)."""
    return {Status.timeout: "worker_timeout", Status.overloaded: "queue_timeout",
            Status.internal_error: "internal_error", Status.rejected: "invalid_input"}.get(status, "")


class LimitName(StrEnum):
    """Which limit fired."""

    wall = "wall"
    cpu = "cpu"
    memory = "memory"
    output = "output"
    pids = "pids"
    file_size = "file_size"


class LimitValues(BaseModel):
    """One full set of per-call limits (used for both the server's caps and its defaults)."""

    wall_s: float = Field(gt=0, allow_inf_nan=False)
    cpu_s: float = Field(gt=0, allow_inf_nan=False)
    memory_mb: int = Field(gt=0)
    output_bytes: int = Field(gt=0, description="bytes kept per stream (stdout, stderr)")
    processes: int = Field(gt=0, description="processes and threads the call may have at once")
    open_files: int = Field(ge=16)
    file_size_mb: int = Field(gt=0, description="largest file the call may write")


class Limits(BaseModel):
    """Per-call limits a request may ask for; each may only lower the server's cap."""

    model_config = ConfigDict(extra="forbid")

    wall_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    cpu_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    memory_mb: int | None = Field(None, gt=0)
    output_bytes: int | None = Field(None, gt=0)
    processes: int | None = Field(None, gt=0)
    open_files: int | None = Field(None, ge=16)
    file_size_mb: int | None = Field(None, gt=0)

    def resolve(self, defaults: LimitValues, caps: LimitValues) -> LimitValues:
        """Fill unset limits from `defaults`; raise LimitExceedsCap for any above `caps`."""
        values = defaults.model_dump()
        for name, requested in self.model_dump(exclude_none=True).items():
            cap = getattr(caps, name)
            if requested > cap:
                raise LimitExceedsCap(f"limits.{name}", requested, cap)
            values[name] = requested
        if self.cpu_s is None:
            # Unless asked otherwise, the CPU budget follows the wall budget.
            values["cpu_s"] = min(values["wall_s"], caps.cpu_s)
        return LimitValues(**values)


def _valid_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid Unicode text (no lone surrogates): {exc}") from None
    return value


#: A string that can be encoded (JSON may carry lone surrogates like "\ud800"; nothing can send them on).
Text = Annotated[str, AfterValidator(_valid_text)]


class ExecRequest(BaseModel):
    """One program to run."""

    model_config = ConfigDict(extra="forbid")

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
    files: dict[Text, str] = Field(
        default_factory=dict, description="files to write into the work dir first: relative path -> base64 content"
    )
    fetch_files: list[Text] = Field(
        default_factory=list, description="files to read back from the work dir after the run (relative paths)"
    )


    def check(self, settings: SandboxSettings) -> tuple[bytes, bytes, LimitValues]:
        """The code, stdin and limits to run with; raise InvalidRequest saying what to fix."""
        limits = self.limits.resolve(settings.defaults, settings.caps)
        try:
            code = self.code.encode("utf-8")
            stdin = self.stdin.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"code and stdin must be valid Unicode text (no lone surrogates): {exc}") from exc
        if len(code) > settings.max_code_bytes:
            raise InvalidRequest(f"code is {len(code)} bytes; the limit is {settings.max_code_bytes}")
        if len(stdin) > settings.max_stdin_bytes:
            raise InvalidRequest(f"stdin is {len(stdin)} bytes; the limit is {settings.max_stdin_bytes}")
        if len(self.files) + len(self.fetch_files) > settings.max_files:
            raise InvalidRequest(f"{len(self.files) + len(self.fetch_files)} files in and out; the limit is "
                                 f"{settings.max_files}")
        for path in [*self.files, *self.fetch_files]:
            check_path(path)
        return code, stdin, limits

    def decoded_files(self, settings: SandboxSettings) -> list[tuple[str, bytes]]:
        """The input files' contents; raise InvalidRequest for bad base64 or too many bytes."""
        decoded: list[tuple[str, bytes]] = []
        total = 0
        for path, content in self.files.items():
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


class ErrorInfo(BaseModel):
    """An uncaught exception, as the program itself reported it."""

    type: str
    message: str
    line: int | None = None


class ExecResult(BaseModel):
    """The structured outcome of one call."""

    id: str | None = None
    status: Status
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
