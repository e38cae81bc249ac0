"""Every HTTP status the gateway gives a result, a refused call or a session error, per API: the
one place where what the engine says becomes HTTP (translated at the boundary, as httpx does).

Usage::

    code, headers = answered(result, NATIVE)   # 200, or 429 with Retry-After; a refused call raises
    code, headers = answered_batch(results, NATIVE)
    raise session_error(exc)                    # a SessionError, by its kind
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from codeenv.errors import ApiError, SessionError, SessionErrorKind
from codeenv.models import ExecResult, Refusal, Status

#: Seconds a client waits before sending again what was not run (overload, a queue that cannot be
#: asked now), and before asking again for a session that could not start.
RETRY_AFTER_S = "1"
SESSION_START_RETRY_AFTER_S = "5"

#: The HTTP status of a result answered alone, where it is not 200, per API: the native API answers
#: overload with 429 and Retry-After; SandboxFusion's clients retry only 504 (verl).
NATIVE: Mapping[Status, int] = {Status.rejected: 422, Status.overloaded: 429}
SANDBOX_FUSION: Mapping[Status, int] = {Status.rejected: 422, Status.overloaded: 504}
#: A session's cell (POST /v1/sessions/{id}/execute): an ended session is 410, its result says so.
SESSION_CELL: Mapping[Status, int] = {**NATIVE, Status.session_lost: 410}

#: A refused call answered alone, by why it was refused (an older worker's refusal says nothing: 422).
REFUSALS: Mapping[Refusal | None, int] = {Refusal.invalid: 422, Refusal.no_session: 404, Refusal.id_taken: 409,
                                           Refusal.problem_unknown: 409, None: 422}

#: A session request the engine cannot serve, by the kind of its SessionError.
SESSION_ERRORS: Mapping[SessionErrorKind, int] = {
    SessionErrorKind.not_found: 404, SessionErrorKind.ended: 410, SessionErrorKind.full: 429,
    SessionErrorKind.conflict: 409, SessionErrorKind.unsupported: 501, SessionErrorKind.forbidden: 403}

#: The headers of a status the client may retry.
RETRY: Mapping[int, dict[str, str]] = {429: {"Retry-After": RETRY_AFTER_S}, 504: {"Retry-After": RETRY_AFTER_S}}


def refused(result: ExecResult) -> ApiError:
    """The HTTP error of a call refused on its own (a `rejected` result), by its refusal's kind."""
    return ApiError(REFUSALS[result.refusal], result.message)


def answered(result: ExecResult, statuses: Mapping[Status, int]) -> tuple[int, dict[str, str] | None]:
    """The HTTP status and headers of one result answered alone; ApiError for a refused call."""
    code = statuses.get(result.status)
    if code is None:
        return 200, None
    if result.status is Status.rejected:
        raise refused(result)
    return code, RETRY.get(code)


def answered_batch(results: Sequence[ExecResult], statuses: Mapping[Status, int]) -> tuple[int, dict[str, str] | None]:
    """The HTTP status of a batch's answer: 200, unless every call was overloaded (none ran)."""
    if results and all(r.status is Status.overloaded for r in results):
        code = statuses[Status.overloaded]
        return code, RETRY.get(code)
    return 200, None


def session_error(exc: SessionError) -> ApiError:
    """The HTTP error of a session request the engine could not serve."""
    code = SESSION_ERRORS[exc.kind]
    return ApiError(code, str(exc), RETRY.get(code))


def session_start_failed(exc: Exception) -> ApiError:
    """A session that could not start on its worker (the host refused a family's set-up): 503."""
    return ApiError(503, f"a session could not start on this worker: {exc}",
                    {"Retry-After": SESSION_START_RETRY_AFTER_S})
