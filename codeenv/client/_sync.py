"""A blocking facade over AsyncClient, for scripts and notebooks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from codeenv.client._async import AsyncClient, check_base_url
from codeenv.client._problem import Problem
from codeenv.client._session import AsyncSession, AsyncSnapshot, Recorder
from codeenv.models import ExecRequest, ExecResult, JudgeResult

T = TypeVar("T")  # not def _call[T]: the client runs on Python 3.10


class Client:
    """The same client, blocking. Its event loop runs in a thread of its own, so it also works
    where a loop is already running (Jupyter).

    Usage::

        with Client("http://127.0.0.1:8000") as client:
            print(client.run("print(6 * 7)").stdout)
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", **options: Any) -> None:
        check_base_url(base_url)  # before the thread starts: a refused URL leaves nothing running
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="codeenv-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> AsyncClient:
            return AsyncClient(base_url, **options)

        self._client = self._call(make())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, code: str, *, stdin: str = "", limits: Mapping[str, Any] | None = None, id: str | None = None,
            profile: str | None = None, deadline_s: float | None = None, files: Mapping[str, str] | None = None,
            fetch_files: Iterable[str] | None = None, ledger: Recorder | None = None,
            display_last: bool = False) -> ExecResult:
        return self._call(self._client.run(code, stdin=stdin, limits=limits, id=id, profile=profile,
                                           deadline_s=deadline_s, files=files, fetch_files=fetch_files, ledger=ledger,
                                           display_last=display_last))

    def judge(self, code: str, tests: Sequence[Mapping[str, Any]] | None = None, **options: Any) -> JudgeResult:
        """AsyncClient.judge, blocking."""
        return self._call(self._client.judge(code, tests, **options))

    def step_metrics(self, prefix: str = "codeenv/") -> dict[str, float]:
        """AsyncClient.step_metrics."""
        return self._client.step_metrics(prefix)

    @property
    def step(self) -> int | None:
        """AsyncClient.step: the training step every call is labelled with unless it has its own."""
        return self._client.step

    @step.setter
    def step(self, value: int | None) -> None:
        self._client.step = value

    def upload_problem(self, problem: Problem) -> dict[str, Any]:
        """AsyncClient.upload_problem, blocking."""
        return self._call(self._client.upload_problem(problem))

    def run_many(self, requests: Iterable[ExecRequest | str | Mapping[str, Any]]) -> list[ExecResult]:
        return self._call(self._client.run_many(list(requests)))

    def session(self, **options: Any) -> Session:
        """A live session (AsyncClient.session's options), blocking: ``with client.session() as s:``."""
        return Session(self, self._call(self._client.session(**options)._start()))

    def from_snapshot(self, snapshot_id: str) -> Session:
        """A new session from one of this client's snapshots (AsyncClient.from_snapshot), blocking."""
        return Session(self, self._call(self._client.from_snapshot(snapshot_id)._start()))

    def from_snapshot_many(self, snapshot_id: str, count: int) -> list[Session]:
        """`count` new sessions from one of this client's snapshots, made at once."""
        return [Session(self, s) for s in self._call(self._client.from_snapshot(snapshot_id, count)._start())]

    @property
    def requests_sent(self) -> int:
        return self._client.requests_sent

    def close(self) -> None:
        """Close the client and stop its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Forkable:
    """What a blocking session and snapshot share: their id, forks (one, or `count` made at once), and
    their end (also at the end of a ``with`` block)."""

    def __init__(self, client: Client, inner: AsyncSession | AsyncSnapshot) -> None:
        self._client = client
        self._inner = inner

    @property
    def id(self) -> str:
        """Its id (a session's: a new one after a replay)."""
        return self._inner.id

    def fork(self) -> Session:
        """A new session from its current state: ``with s.fork() as f:`` closes it after the block."""
        return Session(self._client, self._client._call(self._inner.fork()._start()))

    def forks(self, count: int) -> list[Session]:
        """`count` new sessions from its current state, made at once."""
        return [Session(self._client, f) for f in self._client._call(self._inner.fork(count)._start())]

    def close(self) -> None:
        self._client._call(self._inner.close())

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session(_Forkable):
    """AsyncSession, blocking."""

    def __init__(self, client: Client, inner: AsyncSession) -> None:
        super().__init__(client, inner)
        self._session = inner

    @property
    def cells(self) -> int:
        return self._session.cells

    def run(self, code: str, **options: Any) -> ExecResult:
        return self._client._call(self._session.run(code, **options))

    def snapshot(self, ttl_s: float | None = None) -> Snapshot:
        """AsyncSession.snapshot, blocking: ``with s.snapshot() as snap:`` deletes it after the block."""
        return Snapshot(self._client, self._client._call(self._session.snapshot(ttl_s)))

    def __enter__(self) -> Session:
        return self


class Snapshot(_Forkable):
    """AsyncSnapshot, blocking."""

    def __enter__(self) -> Snapshot:
        return self
