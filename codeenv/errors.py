"""codeenv's own exceptions, one tree. User-code outcomes are never exceptions: they are
`ExecResult.status`. Foreign exceptions (redis, httpx, OSError) are translated where they enter,
with ``raise ... from exc``; start-up failures are raised as one of these, never a bare RuntimeError.

Hierarchy::

    CodeenvError                 base of everything codeenv raises on purpose
    ├── InvalidRequest           the caller's request cannot be run as sent (HTTP 422)
    │   ├── LimitExceedsCap      a requested limit is above the server's configured cap
    │   └── ProblemUnknown       it names a problem package not held here (HTTP 409: upload it, retry)
    ├── ApiError                 an HTTP request the gateway answers with an error status
    ├── ImageError               a sandbox image is missing, malformed or failed to build
    ├── SandboxError             the sandbox machinery itself failed (nsjail, cgroups, a zygote)
    │   └── ZygoteDied           a zygote (or its nsjail) is gone; says whether its call had started
    ├── SessionError             a session request cannot be served; its `kind` says why
    ├── ProblemUnavailable       a problem package could not be fetched from where it was uploaded
    ├── PoolClosed               the slot pool is not running (not started, or shutting down)
    ├── PoolFailed               the pool process of `serve --processes N` kept dying: serve gives up
    ├── QueueUnavailable         the queue (Redis, the host's pool process) cannot be reached now
    └── BenchError               `codeenv bench` cannot run (a bad target, a failing round)
        ├── BenchFailed          the bench could not run; its message is all the user sees
        ├── WorkloadError        a workload or expectation file that cannot be used (also a ValueError)
        └── TargetError          a target that cannot be benchmarked (down, another API, failing)
            └── ServiceError     a service the bench (or a test) started was not ready in time

The client (`codeenv.client.errors`) has a tree of its own: it runs where the server does not.
HTTP statuses are chosen at the gateway's boundary (`codeenv.api.statuses`), never here.
"""

from enum import Enum


class CodeenvError(Exception):
    """Base class of every exception codeenv raises on purpose."""


class InvalidRequest(CodeenvError, ValueError):
    """The request cannot be run as sent; the message says what to fix. `refusal`: its kind, as
    `models.Refusal` names it."""

    refusal = "invalid"


class ProblemUnknown(InvalidRequest):
    """A judged call names a problem package that is not held where it was sent: upload it
    (PUT /v1/problems/{sha256}) and send the call again."""

    refusal = "problem_unknown"

    def __init__(self, sha256: str, why: str = "") -> None:
        super().__init__(f"problem_unknown: problem {sha256} is not held here{why}: upload its package with PUT "
                         f"/v1/problems/{sha256} and send the request again")
        self.sha256 = sha256


class LimitExceedsCap(InvalidRequest):
    """A requested limit is above what the server allows."""

    def __init__(self, name: str, requested: float, cap: float) -> None:
        self.name = name
        self.requested = requested
        self.cap = cap
        super().__init__(f"{name}={_number(requested)} cannot exceed the configured limit of {_number(cap)}")


def _number(value: float) -> str:
    try:
        return f"{value:g}"
    except OverflowError:  # an int too large for a float
        return f"{str(value)[:20]}... ({len(str(value))} digits)"


class ImageError(CodeenvError):
    """A sandbox image is missing, malformed, or could not be built."""


class SandboxError(CodeenvError):
    """nsjail, a cgroup or a zygote failed in a way that is codeenv's fault, not the program's."""


class ZygoteDied(SandboxError):
    """The zygote (or its nsjail) is gone. `started` says whether the call had started."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


class PoolClosed(CodeenvError):
    """The slot pool is not accepting work."""


class ApiError(CodeenvError):
    """An HTTP request the gateway answers with an error status (a 4xx that says what to fix)."""

    def __init__(self, status_code: int, detail: object, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail
        self.headers = headers


class ProblemUnavailable(CodeenvError):
    """A worker could not fetch a problem package from the gateway that holds it (unreachable, an
    answer other than the package): a service fault, not the caller's."""


class PoolFailed(CodeenvError):
    """The pool process behind `serve --processes N` died too often to keep restarting it."""


class QueueUnavailable(CodeenvError):
    """The queue (Redis, or the host's pool process) cannot be reached right now; retry later."""


class BenchError(CodeenvError):
    """`codeenv bench` cannot run: a target that is down or speaks another API, a failing round."""


class BenchFailed(BenchError):
    """The bench could not run; the message says why (no traceback is shown)."""


class WorkloadError(BenchError, ValueError):
    """A workload or expectation file that cannot be used; the message says what to fix."""


class TargetError(BenchError):
    """A target that cannot be benchmarked (down, another API, failing); the message says which."""


class ServiceError(TargetError):
    """A service started here exited before it was ready, or was not ready in time."""


class SessionErrorKind(str, Enum):
    """Why a session request cannot be served (each API says it in its own terms: api/statuses.py)."""

    not_found = "not_found"  # no such session of the caller's: it never existed, or it is another's
    ended = "ended"  # expired, evicted, deleted, lost, or its worker restarted
    full = "full"  # the worker (or the caller) holds as many sessions as it may: retry later
    unsupported = "unsupported"  # this worker (or this gateway's queue) runs no sessions
    conflict = "conflict"  # the request conflicts with the session's state (e.g. its family is full)
    forbidden = "forbidden"  # the worker's operator does not allow what it asks (a host function's URL)


class SessionError(CodeenvError):
    """A session request that cannot be served; `kind` says why."""

    def __init__(self, message: str, kind: SessionErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


def session_not_found(session_id: str) -> SessionError:
    return SessionError(f"no session {session_id[:80]!r}: it never existed here (create one with POST /v1/sessions)",
                        SessionErrorKind.not_found)


def id_taken(call_id: str | None) -> str:
    """The message of a call whose client id already names a different call."""
    return f"id {call_id!r} already names a different call; use a new id"


def session_lost(session_id: str, why: str) -> SessionError:
    return SessionError(f"session {session_id[:80]!r} has ended: {why}", SessionErrorKind.ended)
