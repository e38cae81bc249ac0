"""Live sessions on the client side: `async with client.session() as s: await s.run(code)`."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Mapping
from typing import Any, Protocol, overload

import httpx

from codeenv.client.errors import RequestRejected, ServerError, SessionLost, TransportError
from codeenv.models import SERVICE_FAULTS, ExecRequest, ExecResult, ForkList, Limits, SessionInfo, SnapshotInfo, Status

#: A session's kept cells (code, stdin, limits), for its replay.
History = list[tuple[str, str, dict[str, Any]]]


class Recorder(Protocol):
    """Anything that keeps a trajectory's tool calls (e.g. codeenv.rl.ToolLedger)."""

    def record(self, result: ExecResult) -> None: ...


class _Client(Protocol):
    """What a session needs of its AsyncClient."""

    async def submit(self, request: ExecRequest, *, ledger: Recorder | None = None) -> ExecResult: ...

    async def _session_request(self, method: str, path: str,
                               body: dict[str, Any] | None = None) -> SessionInfo | None: ...

    async def _session_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any: ...


class AsyncSession:
    """A live interpreter on the service: globals, imports and files last from cell to cell.

    Cells are micro-batched with the client's other calls. A cell stopped by a limit comes back with
    `rolled_back: true` and leaves the session as before it; `value` is the repr of a cell's last
    expression. Each cell carries a cell id, so a cell re-sent after a lost connection attaches to
    the first one instead of running twice. A session that ended (its worker died, it expired, it
    was deleted) raises SessionLost from its next cell, unless it replays (`replay_on_loss`).

    With `replay_on_loss`, the session keeps the code of each cell whose effects it kept, and on a
    loss runs them again in a new session (of the same profile, limits and idle TTL), then the cell
    that found the session lost. What replay does not give back: random state that was not seeded in
    a cell, the time, anything a cell read from outside the session (its process ids, the clock), and
    objects whose identity a later cell relies on; a replayed cell that does not end as it did the
    first time (rolled back, refused) ends the replay with SessionLost. `replays` counts them.
    """

    def __init__(self, client: _Client, info: SessionInfo, *, origin: dict[str, Any] | None = None,
                 history: History | None = None) -> None:
        self._client = client
        self.info = info
        self.id = info.session_id
        self.closed = False
        self.cells = info.cells
        self.replays = 0
        self._origin = origin  # the create request's body, with replay_on_loss
        self._history = history  # (code, stdin, limits) of each kept cell, with replay_on_loss

    async def run(self, code: str, *, stdin: str = "", limits: Mapping[str, Any] | None = None,
                  cell_id: str | None = None, ledger: Recorder | None = None) -> ExecResult:
        """Run the next cell; its result. SessionLost once the session has ended (after a replay into
        a new session, with `replay_on_loss`, only if the replay fails)."""
        limits_dict = dict(limits or {})
        result = await self._cell(code, stdin, limits_dict, cell_id, ledger)
        if result.status is Status.session_lost:
            if self._history is None or self.closed:
                raise self._lost(result)
            await self._replay(result)
            result = await self._cell(code, stdin, limits_dict, None, ledger)
            if result.status is Status.session_lost:
                raise self._lost(result)
        if result.execution_count is not None:
            self.cells = result.execution_count
        if self._history is not None and _kept(result):
            self._history.append((code, stdin, limits_dict))
        return result

    async def _cell(self, code: str, stdin: str, limits: dict[str, Any], cell_id: str | None,
                    ledger: Recorder | None) -> ExecResult:
        request = ExecRequest(code=code, stdin=stdin, limits=Limits.model_validate(limits, strict=False),
                              id=uuid.uuid4().hex, session=self.id, cell_id=cell_id or uuid.uuid4().hex,
                              display_last=True)
        return await self._client.submit(request, ledger=ledger)

    def _lost(self, result: ExecResult) -> SessionLost:
        return SessionLost(f"session {self.id[:40]}... ended after {self.cells} cells: {result.message}", 410,
                           cells=self.cells, result=result)

    async def _replay(self, lost: ExecResult) -> None:
        """Run the kept cells again in a new session, which this one then is; SessionLost if a cell
        does not end as it did the first time."""
        assert self._history is not None and self._origin is not None
        info = await self._client._session_request("POST", "/v1/sessions", self._origin)
        assert info is not None
        self.id, self.info = info.session_id, info
        for code, stdin, limits in self._history:
            again = await self._cell(code, stdin, limits, None, None)
            if not _kept(again):
                await self.close()
                raise SessionLost(f"session lost after {self.cells} cells ({lost.message}), and its replay failed: "
                                  f"a cell ended {again.status.value}"
                                  f"{' (rolled back)' if again.rolled_back else ''}: {again.message}", 410,
                                  cells=self.cells, result=lost)
        self.replays += 1

    @overload
    def fork(self, count: None = None) -> SessionStarter: ...

    @overload
    def fork(self, count: int) -> ForksStarter: ...

    def fork(self, count: int | None = None) -> SessionStarter | ForksStarter:
        """A new session from this one's current state (after its running cell, if any): awaited,
        the fork; used with ``async with s.fork() as f:``, one that is closed at the end of the block
        (a fork left open lives until its idle TTL). With `count`, that many made at once (a list;
        ``async with s.fork(count=8) as forks:`` closes them all). A fork replays as its parent does:
        its parent's kept cells, then its own."""
        return _forks(self._client, f"/v1/sessions/{self.id}/fork", count, self._origin, self._history)

    async def snapshot(self, ttl_s: float | None = None) -> AsyncSnapshot:
        """Keep this session's current state as a snapshot, to fork from (by any of the caller's
        clients, with `client.from_snapshot(id)`) after this session ended too, until `ttl_s` (default:
        the server's) has passed or it is deleted."""
        body = {} if ttl_s is None else {"ttl_s": ttl_s}
        answer = await self._client._session_json("POST", f"/v1/sessions/{self.id}/snapshot", body)
        info = SnapshotInfo.model_validate(answer)
        history = None if self._history is None else list(self._history)
        return AsyncSnapshot(self._client, info, origin=self._origin, history=history)

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


def _kept(result: ExecResult) -> bool:
    """Whether a cell's effects stay in its session (it ran and was not rolled back)."""
    return result.started and not result.rolled_back and result.status not in SERVICE_FAULTS


class SessionStarter:
    """What `client.session()` and `session.fork()` return: awaited, a started AsyncSession; used
    with `async with`, one that is closed at the end of the block."""

    def __init__(self, client: _Client, path: str, body: dict[str, Any] | None, *,
                 origin: dict[str, Any] | None = None,
                 history: list[tuple[str, str, dict[str, Any]]] | None = None) -> None:
        self._client = client
        self._path = path
        self._body = body
        self._origin = origin
        self._history = history
        self._session: AsyncSession | None = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._start().__await__()

    async def _start(self) -> AsyncSession:
        info = await self._client._session_request("POST", self._path, self._body)
        assert info is not None
        return AsyncSession(self._client, info, origin=self._origin, history=self._history)

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._start()
        return self._session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()


def _forks(client: _Client, path: str, count: int | None, origin: dict[str, Any] | None,
           history: History | None) -> SessionStarter | ForksStarter:
    """What a fork request at `path` starts: one session (`count` None) or `count` of them, each with
    its own copy of the kept cells it replays from."""
    history = None if history is None else list(history)
    if count is None:
        return SessionStarter(client, path, None, origin=origin, history=history)
    return ForksStarter(client, path, count, origin=origin, history=history)


class ForksStarter:
    """What `session.fork(count=N)` and `snapshot.fork(count=N)` return: awaited, the N started
    AsyncSessions; used with `async with`, they are closed at the end of the block."""

    def __init__(self, client: _Client, path: str, count: int, *, origin: dict[str, Any] | None = None,
                 history: History | None = None) -> None:
        self._client = client
        self._path = path
        self._count = count
        self._origin = origin
        self._history = history
        self._forks: list[AsyncSession] = []

    def __await__(self) -> Generator[Any, None, list[AsyncSession]]:
        return self._start().__await__()

    async def _start(self) -> list[AsyncSession]:
        made = ForkList.model_validate(await self._client._session_json("POST", self._path, {"count": self._count}))
        return [AsyncSession(self._client, info, origin=self._origin,
                             history=None if self._history is None else list(self._history))
                for info in made.sessions]

    async def __aenter__(self) -> list[AsyncSession]:
        self._forks = await self._start()
        return self._forks

    async def __aexit__(self, *exc: object) -> None:
        for fork in self._forks:
            await fork.close()


class AsyncSnapshot:
    """A session's state kept as it was on the service (`session.snapshot()`,
    `client.from_snapshot(id)`): fork it as often as needed until its TTL runs out; `close()` (or the
    end of an ``async with`` block) deletes it. Its forks live on after it."""

    def __init__(self, client: _Client, info: SnapshotInfo, *, origin: dict[str, Any] | None = None,
                 history: History | None = None) -> None:
        self._client = client
        self.info = info
        self.id = info.snapshot_id
        self.closed = False
        self._origin = origin
        self._history = history

    @overload
    def fork(self, count: None = None) -> SessionStarter: ...

    @overload
    def fork(self, count: int) -> ForksStarter: ...

    def fork(self, count: int | None = None) -> SessionStarter | ForksStarter:
        """A new session from the snapshot's state (awaited, or ``async with``); with `count`, that many
        made at once (a list)."""
        return _forks(self._client, f"/v1/snapshots/{self.id}/fork", count, self._origin, self._history)

    async def close(self) -> None:
        """Delete the snapshot (idempotent; one that ended already is fine)."""
        if self.closed:
            return
        self.closed = True
        try:
            await self._client._session_json("DELETE", f"/v1/snapshots/{self.id}")
        except SessionLost:
            pass

    async def __aenter__(self) -> AsyncSnapshot:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def session_request(http: httpx.AsyncClient, method: str, path: str,
                          body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> SessionInfo | None:
    """One session endpoint: its SessionInfo (None for a delete). SessionLost for a session that
    ended or never existed here; RequestRejected for another 4xx; ServerError for 5xx."""
    answer = await session_json(http, method, path, body, timeout_s)
    if answer is None:
        return None
    try:
        return SessionInfo.model_validate(answer)
    except ValueError as exc:
        raise ServerError(f"unreadable answer from the service: {exc}", 200) from exc


async def session_json(http: httpx.AsyncClient, method: str, path: str,
                       body: dict[str, Any] | None = None, timeout_s: float = 60.0) -> Any:
    """One session or snapshot endpoint: its JSON answer (None for a delete); raises as
    `session_request`."""
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
        return response.json()
    except ValueError as exc:
        raise ServerError(f"unreadable answer from the service: {exc}", code) from exc


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail"))[:500]
    except (ValueError, AttributeError):
        return response.text[:500]
