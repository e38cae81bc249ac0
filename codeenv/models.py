"""The wire schema: what the client and the server exchange (requests, limits, results, statuses).

It knows nothing of the server's settings: checking a request against them is admission's job
(`codeenv.admission`), on the server side.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr


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
WallS = Annotated[float, Field(gt=0, allow_inf_nan=False, description="wall-clock seconds")]
CpuS = Annotated[float, Field(gt=0, allow_inf_nan=False, description="CPU seconds, all processes of the call")]
MemoryMb = Annotated[int, Field(gt=0, description="memory of all processes of the call, MiB")]
OutputBytes = Annotated[int, Field(gt=0, description="bytes kept per stream (stdout, stderr)")]
Processes = Annotated[int, Field(gt=0, description="processes and threads the call may have at once")]
OpenFiles = Annotated[int, Field(ge=16, description="open files per process")]
FileSizeMb = Annotated[int, Field(gt=0, description="largest file the call may write, MiB")]


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

    model_config = ConfigDict(extra="forbid")

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
