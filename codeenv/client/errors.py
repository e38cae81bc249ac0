"""The client's exceptions: one hierarchy, the cause always kept (``raise ... from``).

A program's outcome is never an exception: a timeout, an error or an overload that outlived its
retries is an ExecResult with that status. These are for calls that got no result at all.

    ClientError
    ├── ClientClosed        the client was closed before the call finished
    ├── TransportError      the service could not be reached (connection refused, reset, timed out)
    └── ServerError         the service answered, but not with results
        ├── RequestRejected the service refused the request as a whole (4xx: auth, size)
        └── SessionLost     a session that ended (410) or never existed there (404)
"""

from __future__ import annotations


class ClientError(Exception):
    """Base class of every exception codeenv.client raises."""


class ClientClosed(ClientError):
    """The client was closed before the call finished."""


class TransportError(ClientError):
    """The service could not be reached, after the retries allowed."""


class ServerError(ClientError):
    """The service answered with something that is not a result (e.g. a 500 from a proxy)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RequestRejected(ServerError):
    """The service refused the request as a whole (bad token, body too large, malformed)."""


class SessionLost(ServerError):
    """The session ended (expired, evicted, deleted, its worker restarted or died) or never existed
    there. From a cell: `cells` is how many cells the session had run (its last execution_count seen
    by this client), `result` the cell's `session_lost` result."""

    def __init__(self, message: str, status_code: int | None = None, *, cells: int | None = None,
                 result: object | None = None) -> None:
        super().__init__(message, status_code)
        self.cells = cells
        self.result = result
