"""The embedded queue: calls go straight to an in-process slot pool (no Redis needed).

Usage::

    queue = EmbeddedQueue(SlotPool(settings), max_queued=100_000)
    await queue.start()
    results = await queue.submit([ExecRequest(code="print(1)")])
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from codeenv.errors import InvalidRequest, PoolClosed, SessionError, SessionErrorKind, id_taken
from codeenv.models import ExecRequest, ExecResult, HostFunctions, Limits, Refusal, SessionInfo, Status
from codeenv.queue.base import OnResult, SessionService, notify_each, until_done_or_gone
from codeenv.sandbox.outside.family import SESSION, SNAPSHOT
from codeenv.sandbox.pool import SlotPool
from codeenv.sandbox.sessions import SessionManager
from codeenv.settings import GatewaySettings

logger = logging.getLogger(__name__)

#: Why a call that had not started when the service began to stop is answered `overloaded`.
STOPPING = "the service is stopping: the call was not started; send it again (to another server)"


class PoolSessions:
    """The sessions of an in-process pool (its SessionManager), as the gateway's SessionService."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool

    def _manager(self) -> SessionManager:
        manager = self.pool.sessions
        if manager is None:  # made when the pool starts
            raise SessionError("the worker's pool has not started", SessionErrorKind.unsupported)
        return manager

    async def create(self, profile: str | None, limits: Limits | None, idle_ttl_s: float | None,
                     owner: bytes, session_id: str | None = None, host: HostFunctions | None = None) -> SessionInfo:
        manager = self._manager()
        session = await manager.create(profile, limits, idle_ttl_s, owner, session_id, host)
        return SessionInfo(**session.describe(manager.worker))

    async def lookup(self, session_id: str, owner: bytes) -> SessionInfo:
        manager = self._manager()
        return SessionInfo(**manager.lookup(session_id, owner).describe(manager.worker))

    async def fork(self, session_id: str, owner: bytes, count: int = 1, snapshot: bool = False) -> list[SessionInfo]:
        manager = self._manager()
        forks = await manager.forks(session_id, owner, count, SNAPSHOT if snapshot else SESSION)
        return [SessionInfo(**fork.describe(manager.worker)) for fork in forks]

    async def snapshot(self, session_id: str, owner: bytes, ttl_s: float | None) -> SessionInfo:
        manager = self._manager()
        return SessionInfo(**(await manager.snapshot(session_id, owner, ttl_s)).describe(manager.worker))

    async def delete(self, session_id: str, owner: bytes, snapshot: bool = False) -> None:
        await self._manager().delete(session_id, owner, SNAPSHOT if snapshot else SESSION)

    async def describe(self, owner: bytes) -> list[SessionInfo]:
        return [SessionInfo(**d) for d in self._manager().describe(owner)]


class EmbeddedQueue:
    """An in-process queue in front of a SlotPool, bounded by `max_queued` waiting calls.

    Calls that carry a client id are remembered for `results_ttl_s` after they end (within a count
    and a byte budget): the same id sent again (a retry after a lost connection) attaches to the
    same call instead of running it twice, and `result(id)` answers it.
    """

    def __init__(self, pool: SlotPool, max_queued: int, results_ttl_s: float = 600.0,
                 max_remembered: int = 100_000, max_remembered_bytes: int = 256 << 20,
                 grace_s: float = 30.0) -> None:
        self.pool = pool
        self.sessions: SessionService | None = PoolSessions(pool)
        self.max_queued = max_queued
        self.in_flight = 0
        self.results_ttl_s = results_ttl_s
        self.max_remembered = max_remembered
        self.max_remembered_bytes = max_remembered_bytes
        self.grace_s = grace_s
        # id -> (fingerprint, future) while the call runs; then id -> (fingerprint, result, ended,
        # size) in the order calls ended, so the oldest are forgotten first.
        self._running: dict[str, tuple[str, asyncio.Future[ExecResult]]] = {}
        self._done: OrderedDict[str, tuple[str, ExecResult, float, int]] = OrderedDict()
        self._done_bytes = 0
        self._tasks: set[asyncio.Future[ExecResult]] = set()
        self._waiting_since: dict[object, float] = {}  # calls not yet dispatched, oldest first
        self._calls: dict[object, asyncio.Task[Any]] = {}  # every call's task, for a drain to answer it
        self._forced = asyncio.Event()
        self._draining = False
        self._stopping_running = False

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        """Let running calls finish (up to `grace_s`, or until `force()`), then stop the pool."""
        if self._tasks and self.grace_s > 0 and not self._forced.is_set():
            finished: asyncio.Future[Any] = asyncio.gather(*self._tasks, return_exceptions=True)
            forced: asyncio.Future[Any] = asyncio.ensure_future(self._forced.wait())
            await asyncio.wait([finished, forced], timeout=self.grace_s, return_when=asyncio.FIRST_COMPLETED)
            forced.cancel()
        await self.pool.close()

    def force(self) -> None:
        """Cut a graceful close short: the calls still running are killed with the pool."""
        self._forced.set()
        if self._draining:
            self._stop_running()

    def drain(self, until: float) -> None:
        """Start no more calls: those not started are answered `overloaded` (started: false) now, those
        running by `until` (time.monotonic()) at the latest, `killed` if they have not ended by then;
        new ones are refused. Then close() has nothing left to wait for."""
        if self._draining:
            return
        self._draining = True
        for token in list(self._waiting_since):
            self._calls[token].cancel()
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + max(0.0, until - time.monotonic()), self._stop_running)

    async def drained(self) -> None:
        """Until every call is answered (after drain(): by its `until`)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _stop_running(self) -> None:
        self._stopping_running = True
        for token, task in list(self._calls.items()):
            if token not in self._waiting_since:
                task.cancel()

    def stats(self) -> dict[str, float]:
        slots = len(self.pool.slots)
        free = self.pool.free_slots
        oldest = next(iter(self._waiting_since.values()), None)
        return {"slots": slots, "free_slots": free, "slot_restarts": self.pool.restarts,
                "waiting": len(self._waiting_since), "calls_run": self.pool.calls_started,
                "oldest_wait_s": 0.0 if oldest is None else time.monotonic() - oldest, "workers": 1,
                "sessions": len(self.pool.sessions.sessions) if self.pool.sessions is not None else 0}

    def worker_figures(self) -> dict[str, dict[str, float]]:
        return {self.pool.worker: {**self.pool.figures(taking=not self._draining), "heartbeat_age_s": 0.0}}

    def ready(self) -> bool:
        return not self._draining and self.pool.healthy

    async def submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None = None,
                     accepted_at: float | None = None, on_result: OnResult | None = None, *,
                     before_start: Callable[[int], Awaitable[None]] | None = None) -> list[ExecResult]:
        """As CallQueue.submit; `before_start(index)` is awaited once a call holds its slot, before it
        starts (the host's pool process tells the gateway there, so that a call is provably
        unstarted until then)."""
        accepted = time.monotonic() if accepted_at is None else accepted_at
        self._forget_expired()
        room = 0 if self._draining else max(0, self.max_queued + len(self.pool.slots) - self.in_flight)
        work: list[Awaitable[ExecResult]] = []
        cancellable: list[tuple[int, list[bool]]] = []  # (index in work, set once dispatched)
        for index, request in enumerate(requests):
            if request.id is not None and (request.id in self._running or request.id in self._done):
                work.append(self._attach(request))
            elif room > 0:
                room -= 1
                self.in_flight += 1  # counted now, so concurrent submits see it
                future: asyncio.Future[ExecResult] | None = None
                if request.id is not None:
                    # Registered now, not when the coroutine first runs: a resubmission arriving in
                    # the same tick must find it.
                    future = asyncio.get_running_loop().create_future()
                    future.add_done_callback(lambda f: f.cancelled() or f.exception())
                    self._running[request.id] = (fingerprint(request), future)
                dispatched: list[bool] = []
                hook = functools.partial(before_start, index) if before_start is not None else None
                work.append(self._tracked(request, future, dispatched, accepted, hook))
                if request.id is None:
                    cancellable.append((len(work) - 1, dispatched))
            else:
                work.append(self._overloaded(request))
        # The calls run as tasks of their own, so a caller that goes away (a dropped connection)
        # cannot leave a registered call unfinished or the in-flight count wrong.
        tasks = [asyncio.ensure_future(w) for w in work]
        for task in tasks:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        notify_each(tasks, on_result)
        batch: asyncio.Future[list[ExecResult]] = asyncio.gather(*tasks)

        def cancel_unstarted() -> None:
            # Started calls (and calls with an id, which a reconnecting caller may attach to) run on.
            for index, dispatched in cancellable:
                if not dispatched:
                    tasks[index].cancel()

        results: list[ExecResult] = await until_done_or_gone(batch, gone if cancellable else None, cancel_unstarted)
        return results

    async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
        done = self._done.get(call_id)
        if done is not None:
            return True, done[1]
        return call_id in self._running, None

    async def _overloaded(self, request: ExecRequest) -> ExecResult:
        if self._draining:
            return _stopping(request)
        return ExecResult(id=request.id, status=Status.overloaded, started=False,
                          message=f"more than {self.max_queued} calls are waiting; retry later")

    async def _tracked(self, request: ExecRequest, future: asyncio.Future[ExecResult] | None,
                       dispatched: list[bool], accepted: float,
                       before_start: Callable[[], Awaitable[None]] | None = None) -> ExecResult:
        token = object()
        self._waiting_since[token] = accepted
        task = asyncio.current_task()
        assert task is not None  # submit runs every call as a task of its own
        self._calls[token] = task

        def on_dispatch() -> None:
            dispatched.append(True)
            self._waiting_since.pop(token, None)

        try:
            try:
                result = await self._one(request, on_dispatch, accepted, before_start)
            except asyncio.CancelledError:
                if not self._draining:  # the caller went away (or a plain cancel): as before
                    raise
                if not dispatched:
                    result = _stopping(request)
                elif self._stopping_running:
                    result = ExecResult(id=request.id, status=Status.killed, started=True,
                                        message="the service stopped before the call ended (its grace period "
                                                "was over)")
                else:
                    raise
            if request.id is not None and future is not None:
                fingerprint, _ = self._running.pop(request.id)
                future.set_result(result)
                if result.started:  # a call that never ran may be sent again under its id
                    self._remember(request.id, fingerprint, result)
            return result
        except BaseException as exc:
            if request.id is not None and future is not None:
                self._running.pop(request.id, None)
                if not future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        future.cancel()
                    else:
                        future.set_exception(exc)
            raise
        finally:
            self.in_flight -= 1
            self._waiting_since.pop(token, None)
            self._calls.pop(token, None)

    async def _attach(self, request: ExecRequest) -> ExecResult:
        assert request.id is not None
        running = self._running.get(request.id)
        done = self._done.get(request.id)
        known = running[0] if running is not None else done[0] if done is not None else ""
        if known != fingerprint(request):
            return ExecResult(id=request.id, status=Status.rejected, refusal=Refusal.id_taken, started=False,
                              message=id_taken(request.id))
        if done is not None:
            return done[1]
        assert running is not None
        return await asyncio.shield(running[1])

    def _remember(self, call_id: str, fingerprint: str, result: ExecResult) -> None:
        size = len(result.stdout) + len(result.stderr) + 512
        self._done[call_id] = (fingerprint, result, time.monotonic(), size)
        self._done_bytes += size
        self._forget_expired()

    def _forget_expired(self) -> None:
        """Drop the oldest ended calls past their time, or past the count or byte budget (O(1) each)."""
        deadline = time.monotonic() - self.results_ttl_s
        while self._done:
            call_id, (_, _, ended, size) = next(iter(self._done.items()))
            over = len(self._done) > self.max_remembered or self._done_bytes > self.max_remembered_bytes
            if not over and ended >= deadline:
                break
            del self._done[call_id]
            self._done_bytes -= size

    async def _one(self, request: ExecRequest, on_dispatch: Callable[[], None], accepted: float,
                   before_start: Callable[[], Awaitable[None]] | None = None) -> ExecResult:
        try:
            return await self.pool.run(request, on_dispatch=on_dispatch, accepted_at=accepted,
                                       before_start=before_start)
        except InvalidRequest as exc:
            return ExecResult(id=request.id, status=Status.rejected, refusal=Refusal(exc.refusal), started=False,
                              message=str(exc))
        except PoolClosed as exc:
            return ExecResult(id=request.id, status=Status.overloaded, started=False, message=str(exc))
        except Exception as exc:  # our fault: this call says so, the rest of the batch is unaffected
            logger.exception("call %s failed inside the service", request.id)
            return ExecResult(id=request.id, status=Status.internal_error, started=True,
                              message=f"the service failed on this call: {exc!r}")


def _stopping(request: ExecRequest) -> ExecResult:
    return ExecResult(id=request.id, status=Status.overloaded, started=False, message=STOPPING)


def from_settings(settings: GatewaySettings) -> EmbeddedQueue:
    """The embedded queue of `codeenv serve`: a slot pool in this process."""
    return EmbeddedQueue(SlotPool(settings), settings.max_queued, results_ttl_s=settings.results_ttl_s,
                         grace_s=settings.shutdown_grace_s)


def fingerprint(request: ExecRequest) -> str:
    """What makes two submissions the same call."""
    # Not the deadline: a client re-sending a call after a lost connection sends what is left of it;
    # not the step label, which is no part of the program.
    canonical = json.dumps(request.model_dump(exclude={"id", "deadline_s", "step"}), sort_keys=True,
                           ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
