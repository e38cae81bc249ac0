"""The interface every queue backend offers the gateway: calls (`CallQueue`) and, where its workers
run them, live sessions (`SessionService`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from codeenv.models import ExecRequest, ExecResult, HostFunctions, Limits, SessionInfo

#: The gauges of a queue that has no figures yet (see CallQueue.stats).
NO_STATS: dict[str, float] = {"slots": 0, "free_slots": 0, "slot_restarts": 0, "calls_run": 0, "waiting": 0,
                              "oldest_wait_s": 0, "workers": 0, "sessions": 0}

#: Called with (index in the submitted batch, result) as each call ends.
OnResult = Callable[[int, ExecResult], None]


def notify_each(futures: Sequence[asyncio.Future[ExecResult]], on_result: OnResult | None) -> None:
    """Call `on_result` as each future ends with a result."""
    if on_result is None:
        return
    callback = on_result

    def ended(index: int, future: asyncio.Future[ExecResult]) -> None:
        if not future.cancelled() and future.exception() is None:
            callback(index, future.result())

    for index, future in enumerate(futures):
        future.add_done_callback(functools.partial(ended, index))


async def until_done_or_gone[T](batch: asyncio.Future[T], gone: asyncio.Event | None,
                                on_gone: Callable[[], None]) -> T:
    """The batch's outcome, unless the caller goes away first (`gone` is set): then `on_gone` cancels
    what has not started, the rest runs on unread, and CancelledError is raised."""
    if gone is None:
        return await asyncio.shield(batch)
    watcher: asyncio.Future[Any] = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait([batch, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not batch.done():
            on_gone()
            batch.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads it any more
            raise asyncio.CancelledError("the caller disconnected")
        return batch.result()
    finally:
        watcher.cancel()


class SessionService(Protocol):
    """The live sessions of a queue's workers, for the gateway. `owner` names whose sessions (the hash
    of the caller's session key): another owner's session is answered as one that never existed.

    Raises SessionError (its `kind` says why: not_found, ended, full, unsupported, conflict), and
    InvalidRequest for a bad profile or limits. A session's cells are calls (ExecRequest.session).
    """

    async def create(self, profile: str | None, limits: Limits | None, idle_ttl_s: float | None,
                     owner: bytes, session_id: str | None = None, host: HostFunctions | None = None) -> SessionInfo:
        """A new session (and family) of `owner`; `session_id`: an id of the caller's choosing, for
        `owner` only (SessionError conflict while `owner` has a live session of that id); `host`: its
        host functions (InvalidRequest for a URL its worker may not call)."""
        ...

    async def lookup(self, session_id: str, owner: bytes) -> SessionInfo:
        """The live session `session_id` of `owner`."""
        ...

    async def fork(self, session_id: str, owner: bytes, count: int = 1, snapshot: bool = False) -> list[SessionInfo]:
        """`count` new sessions from this one's state (after its running cell, if any), also `owner`'s;
        with `snapshot`, `session_id` names a snapshot of `owner`'s."""
        ...

    async def snapshot(self, session_id: str, owner: bytes, ttl_s: float | None) -> SessionInfo:
        """A snapshot of the session's state (after its running cell, if any), forkable until its TTL
        ran out (`ttl_s`, or the server's default), after the session ended too."""
        ...

    async def delete(self, session_id: str, owner: bytes, snapshot: bool = False) -> None:
        """End a session (a snapshot, with `snapshot`): its processes and files are gone when this returns."""
        ...

    async def describe(self, owner: bytes) -> list[SessionInfo]:
        """The live sessions and snapshots of `owner`, and no one else's."""
        ...


def declared_profiles(image: str) -> list[str]:
    """The profiles of the image a gateway's settings name, as the package declares it (none when it is
    declared elsewhere, e.g. by path on the workers' hosts): for the gateway's OpenAPI document."""
    from codeenv.sandbox.image import find_spec

    try:
        spec, _ = find_spec(image)
    except Exception:  # an image declared by path, or not found here: the document names none
        return []
    return [p.name for p in spec.profiles]


class CallQueue(Protocol):
    """Takes batches of calls and answers each with a result, in order.

    A queue may also offer ``worker_figures() -> dict[str, dict[str, float]]``: per live worker (by
    name) its capacity, safety and session figures (``SlotPool.figures``) and heartbeat_age_s
    (/metrics labels them by worker; the live page shows them).
    """

    #: The sessions its workers run, or None where it routes none (the API answers 501).
    sessions: SessionService | None

    async def start(self) -> None: ...
    async def close(self) -> None: ...

    async def submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None = None,
                     accepted_at: float | None = None, on_result: OnResult | None = None) -> list[ExecResult]:
        """One result per request, in request order; never raises for a single bad call.

        `accepted_at` (time.monotonic() when the gateway took the calls; default: now) is where
        a call's queue wait, and its deadline, start. `on_result(index, result)` is called as each
        call ends, in the order they end (the streaming endpoint's feed).

        When `gone` is set (the caller disconnected), calls without an id that have not started are
        cancelled and never run; calls with an id go on, so a reconnecting caller can attach.
        """
        ...

    def ready(self) -> bool:
        """Whether calls can be run now (started, with at least one healthy slot)."""
        ...

    def drain(self, until: float) -> None:
        """The service is stopping: start no more calls (those not started are answered `overloaded`,
        started: false) and answer the running ones by `until` (time.monotonic()), `killed` if they
        are still running then."""
        ...

    def force(self) -> None:
        """Stop now: what still runs is stopped (and answered) at once."""
        ...

    async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
        """Whether a call with this client id is running or remembered, and its result once it ended.

        Raises QueueUnavailable when the queue cannot be asked right now.
        """
        ...

    def stats(self) -> dict[str, float]:
        """Gauges for /metrics: slots, free_slots, slot_restarts, calls_run, waiting (calls not yet
        started), oldest_wait_s (how long the oldest of them has waited), workers (live workers)."""
        ...
