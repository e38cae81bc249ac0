"""Live sessions on the client side: `async with client.session() as s: await s.run(code)`."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Mapping
from typing import Any, Protocol

import httpx

from codeenv.client.errors import RequestRejected, ServerError, SessionLost, TransportError
from codeenv.models import ExecRequest, ExecResult, Limits, SessionInfo


class Recorder(Protocol):
    """Anything that keeps a trajectory's tool calls (e.g. codeenv.rl.ToolLedger)."""

    def record(self, result: ExecResult) -> None: ...


class _Client(Protocol):
    """What a session needs of its AsyncClient."""

    async def submit(self, request: ExecRequest, *, ledger: Recorder | None = None) -> ExecResult: ...

    async def _session_request(self, method: str, path: str,
                               body: dict[str, Any] | None = None) -> SessionInfo | None: ...


class AsyncSession:
    """A live interpreter on the service: globals, imports and files last from cell to cell.

    Cells are micro-batched with the client's other calls. A cell stopped by a limit comes back with
    `rolled_back: true` and leaves the session as before it; `value` is the repr of a cell's last
    expression. Each cell carries a cell id, so a cell re-sent after a lost connection attaches to
    the first one instead of running twice.
    """

    def __init__(self, client: _Client, info: SessionInfo) -> None:
        self._client = client
        self.info = info
        self.id = info.session_id
        self.closed = False

    async def run(self, code: str, *, stdin: str = "", limits: Mapping[str, Any] | None = None,
                  cell_id: str | None = None, ledger: Recorder | None = None) -> ExecResult:
        """Run the next cell; its result (status `session_lost` once the session has ended)."""
        request = ExecRequest(code=code, stdin=stdin, limits=Limits.model_validate(dict(limits or {}), strict=False),
                              id=uuid.uuid4().hex,
                              session=self.id, cell_id=cell_id or uuid.uuid4().hex, display_last=True)
        return await self._client.submit(request, ledger=ledger)

    def fork(self) -> SessionStarter:
        """A new session from this one's current state (after its running cell, if any): awaited,
        the fork; used with ``async with s.fork() as f:``, one that is closed at the end of the block
        (a fork left open lives until its idle TTL)."""
        return SessionStarter(self._client, f"/v1/sessions/{self.id}/fork", None)

    async def close(self) -> None:
        """End the session (idempotent; one that ended already is fine)."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._client._session_request("DELETE", f"/v1/sessions/{self.id}")
        except SessionLost:
            pass

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SessionStarter:
    """What `client.session()` and `session.fork()` return: awaited, a started AsyncSession; used
    with `async with`, one that is closed at the end of the block."""

    def __init__(self, client: _Client, path: str, body: dict[str, Any] | None) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._session: AsyncSession | None = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._start().__await__()

    async def _start(self) -> AsyncSession:
        info = await self._client._session_request("POST", self._path, self._body)
        assert info is not None
        return AsyncSession(self._client, info)

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._start()
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()


async def session_request(http: httpx.AsyncClient, method: str, path: str,
                          body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> SessionInfo | None:
    """One session endpoint: its SessionInfo (None for a delete). SessionLost for a session that
    ended or never existed here; RequestRejected for another 4xx; ServerError for 5xx."""
    try:
        response = await http.request(method, path, json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise TransportError(f"the service could not be reached: {exc!r}") from exc
    code = response.status_code
    if code in (404, 410):
        raise SessionLost(_detail(response), code)
    if 400 <= code < 500:
        raise RequestRejected(f"the service refused the session request ({code}): {_detail(response)}", code)
    if code >= 500:
        raise ServerError(f"the service answered {code}: {_detail(response)}", code)
    if code == 204:
        return None
    try:
        return SessionInfo.model_validate(response.json())
    except ValueError as exc:
        raise ServerError(f"unreadable answer from the service: {exc}", code) from exc


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail"))[:500]
    except (ValueError, AttributeError):
        return response.text[:500]
