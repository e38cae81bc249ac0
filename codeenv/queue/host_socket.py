"""One slot pool per host behind several gateway processes, without Redis: a Unix socket.

`codeenv serve --processes N` runs the pool in one process (`HostSocketServer` around an
EmbeddedQueue) and N uvicorn processes whose gateways talk to it through `HostSocketQueue`.

Usage::

    server = HostSocketServer(EmbeddedQueue(SlotPool(settings), max_queued), path)   # pool process
    await server.start()
    queue = HostSocketQueue(path)                                                           # each gateway
    await queue.start()

Frames are a 4-byte big-endian length and UTF-8 text. Gateway -> pool: a JSON object with ``op``
(``submit`` with ``requests`` and, for a session's cells, ``owners``: the hash of each caller's
session key, hex; ``cancel``, ``lookup`` with ``id``; ``session`` with ``session``, a session request of
`codeenv.queue.remote_sessions`; ``drain`` with ``until``, a time.monotonic(), and ``force`` when
the service stops) and a request number ``n``.
Pool -> gateway: a JSON header line (``{"n": ...}`` answering a request, or ``{"stats": {...}}``)
followed by one result per line, each as the pool encoded it (results are never re-encoded);
``{"n": ..., "session": ANSWER}`` answering a session request; and
``{"n": ..., "started": i}`` when call ``i`` of batch ``n`` holds its slot, written to the socket
before the call starts. So if the pool process dies, a gateway knows which of its calls provably
never started (answered ``overloaded``, ``started: false``: the client re-sends them) and which may
have (``internal_error``, ``started: true``); it then reconnects to the restarted pool process. A
gateway that goes away cancels its calls that have not started, as a disconnecting client does.

Sessions live in the pool process, so every gateway process reaches every session. A pool process
that dies takes its sessions with it: a restarted one answers their ids `session_lost` (410).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeenv.errors import QueueUnavailable, SandboxError, SessionError, SessionErrorKind
from codeenv.models import ExecRequest, ExecResult, Status
from codeenv.queue import remote_sessions
from codeenv.queue.base import NO_STATS, OnResult, SessionService, until_done_or_gone
from codeenv.queue.embedded import STOPPING, EmbeddedQueue
from codeenv.settings import GatewaySettings

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
#: How long a gateway's start waits for the pool process before going on without it.
START_WAIT_S = 30.0
MAX_FRAME = 1 << 30
STATS_EVERY_S = 0.5


async def _read_frame(reader: asyncio.StreamReader) -> str:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes")
    return (await reader.readexactly(size)).decode()


def _frame(text: str) -> bytes:
    data = text.encode()
    return _LENGTH.pack(len(data)) + data


class HostSocketServer:
    """Serves an EmbeddedQueue (and its slot pool) to gateway processes on this host."""

    def __init__(self, queue: EmbeddedQueue, path: Path) -> None:
        self.queue = queue
        self.path = path
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        await self.queue.start()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)  # only this user (root) may submit code
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        logger.info("pool serving gateways on %s", self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._connections.values():
            writer.close()  # each connection's reader then ends, and cleans up after itself
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self.queue.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        writer.transport.set_write_buffer_limits(0)  # drain() returns once all is in the kernel
        gone: dict[int, asyncio.Event] = {}
        calls: set[asyncio.Task[None]] = set()

        async def started(n: int, index: int) -> None:
            # In the kernel's socket buffer before the call starts: it reaches the gateway even if
            # this process dies right after.
            writer.write(_frame(f'{{"n":{n},"started":{index}}}'))
            await writer.drain()

        async def submit(n: int, requests: list[ExecRequest], event: asyncio.Event, accepted: float | None) -> None:
            try:
                results = await self.queue.submit(requests, event, accepted,
                                                  before_start=functools.partial(started, n))
            except asyncio.CancelledError:
                return  # cancelled by the gateway: nobody waits for an answer
            finally:
                gone.pop(n, None)
            writer.write(_frame(json.dumps({"n": n}) + "\n" + "\n".join(r.encoded() for r in results)))

        async def session(n: int, message: dict[str, Any]) -> None:
            sessions = self.queue.sessions
            answer = {"error": "unsupported", "message": "the pool process runs no sessions"} if sessions is None \
                else await remote_sessions.serve(sessions, message)
            writer.write(_frame(json.dumps({"n": n, "session": answer})))

        async def push_stats() -> None:
            while True:
                writer.write(_frame(json.dumps({"stats": self.queue.stats(), "ready": self.queue.ready(),
                                                "workers": self.queue.worker_figures()})))
                await asyncio.sleep(STATS_EVERY_S)

        pusher = asyncio.create_task(push_stats())
        try:
            while True:
                message = json.loads(await _read_frame(reader))
                n = message["n"]
                if message["op"] == "submit":
                    event = gone[n] = asyncio.Event()
                    requests = [ExecRequest.model_validate(r) for r in message["requests"]]
                    for request, who in zip(requests, message.get("owners") or (), strict=False):
                        request._owner = bytes.fromhex(who)
                    call = asyncio.create_task(submit(n, requests, event, message.get("t")))
                    calls.add(call)
                    call.add_done_callback(calls.discard)
                elif message["op"] == "session":
                    call = asyncio.create_task(session(n, message["session"]))
                    calls.add(call)
                    call.add_done_callback(calls.discard)
                elif message["op"] == "cancel":
                    if n in gone:
                        gone[n].set()
                elif message["op"] == "drain":  # a gateway is stopping: so is the service
                    self.queue.drain(float(message["until"]))
                elif message["op"] == "force":
                    self.queue.force()
                elif message["op"] == "lookup":
                    known, result = await self.queue.lookup(message["id"])
                    writer.write(_frame(json.dumps({"n": n, "known": known}) + "\n"
                                        + (result.encoded() if result is not None else "")))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the gateway went away: its unstarted calls are cancelled below
        finally:
            pusher.cancel()
            for event in gone.values():
                event.set()
            await asyncio.gather(*calls, return_exceptions=True)
            writer.close()
            self._connections.pop(task, None)


def from_settings(settings: GatewaySettings) -> HostSocketQueue:
    """A gateway's queue under `serve --processes N`: the host's pool process, on its socket."""
    if settings.pool_socket is None:
        raise ValueError("the host-socket queue needs settings.pool_socket")
    return HostSocketQueue(settings.pool_socket)


@dataclass
class _Batch:
    """A batch sent to the pool process and not yet answered."""

    requests: Sequence[ExecRequest]
    future: asyncio.Future[list[str]]
    started: set[int] = field(default_factory=set)


class HostSocketQueue:
    """A gateway's side of HostSocketServer: the CallQueue interface over a Unix socket. If the pool
    process goes away, the calls it held are answered at once (see the module docstring) and the
    queue reconnects in the background; meanwhile it is not ready and new calls are overloaded."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: The pool process's sessions, asked over the socket.
        self.sessions: SessionService | None = remote_sessions.RemoteSessions(self._ask_session, self._ask_all)
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._next = 0
        self._waiting: dict[int, _Batch] = {}
        self._lookups: dict[int, asyncio.Future[list[str]]] = {}  # lookups and session requests
        self._stats: dict[str, float] = {}
        self._figures: dict[str, dict[str, float]] = {}
        self._ready = False
        self._lost = False
        self._closing = False
        self._draining = False
        self._reconnecting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect to the pool process, waiting up to START_WAIT_S for it (it may still be starting
        its jails): a gateway process answers no call before it can reach the pool. Past that, keep
        trying in the background (not ready, calls answered overloaded), so that a pool process
        that never comes up cannot hold the gateway's start-up, and its shutdown, forever."""
        try:
            async with asyncio.timeout(START_WAIT_S):
                await self._connect()
        except TimeoutError:
            self._lost = True
            self._reconnect_soon()

    async def _open(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        self._lost = False
        self._reader_task = asyncio.create_task(self._read(reader))

    async def _connect(self) -> None:
        delay = 0.05
        while True:
            try:
                await self._open()
                logger.info("connected to the pool process at %s", self.path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def close(self) -> None:
        self._closing = True
        for task in (self._reader_task, self._reconnecting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()

    def ready(self) -> bool:
        return self._ready and not self._lost and not self._draining

    def drain(self, until: float) -> None:
        """The pool process drains (every gateway of the host stops with the service): its calls not
        started are answered `overloaded`, its running ones by `until` (one clock per host)."""
        self._draining = True
        with contextlib.suppress(ConnectionError):
            self._send(f'"op":"drain","until":{until!r}', 0)

    def force(self) -> None:
        with contextlib.suppress(ConnectionError):
            self._send('"op":"force"', 0)

    def stats(self) -> dict[str, float]:
        return self._stats if self._stats and not self._lost else NO_STATS

    def worker_figures(self) -> dict[str, dict[str, float]]:
        return {} if self._lost else self._figures

    async def submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None = None,
                     accepted_at: float | None = None, on_result: OnResult | None = None) -> list[ExecResult]:
        results = await self._submit(requests, gone, accepted_at)
        if on_result is not None:  # the pool process answers a batch whole
            for index, result in enumerate(results):
                on_result(index, result)
        return results

    async def _submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None,
                      accepted_at: float | None) -> list[ExecResult]:
        accepted = time.monotonic() if accepted_at is None else accepted_at
        if self._draining:
            return [ExecResult(id=r.id, status=Status.overloaded, started=False, message=STOPPING) for r in requests]
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        batch = _Batch(requests, future)
        try:
            owners = "" if all(r.session is None for r in requests) else \
                ',"owners":' + json.dumps([r._owner.hex() for r in requests])
            n = self._send(f'"op":"submit","t":{accepted!r},"requests":['
                           + ",".join(r.model_dump_json() for r in requests) + "]" + owners)
        except ConnectionError as exc:
            return [ExecResult(id=r.id, status=Status.overloaded, started=False, message=f"{exc}; retry later")
                    for r in requests]
        self._waiting[n] = batch
        try:
            lines = await self._wait(n, future, gone)
        except ConnectionError as exc:
            return [ExecResult(id=r.id, status=Status.internal_error, started=True,
                               message=f"{exc} while the call was with it; it may have run, so it is not run again")
                    if i in batch.started else
                    ExecResult(id=r.id, status=Status.overloaded, started=False,
                               message=f"{exc} before the call started; it did not run: send it again")
                    for i, r in enumerate(requests)]
        return [ExecResult.from_json(line) for line in lines]

    async def _wait(self, n: int, future: asyncio.Future[list[str]], gone: asyncio.Event | None) -> list[str]:
        def cancel() -> None:
            self._waiting.pop(n, None)
            future.cancel()
            with contextlib.suppress(ConnectionError):
                self._send('"op":"cancel"', n)

        return await until_done_or_gone(future, gone, cancel)

    async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        try:
            n = self._send('"op":"lookup","id":' + json.dumps(call_id))
            self._lookups[n] = future
            header, *rest = await future
        except ConnectionError as exc:
            raise QueueUnavailable(str(exc)) from exc
        result = ExecResult.from_json(rest[0]) if rest and rest[0] else None
        return bool(json.loads(header)["known"]), result

    async def _ask_session(self, message: dict[str, Any], _session_id: str | None) -> remote_sessions.Answer:
        """A session request, answered by the pool process (one pool: every session is there)."""
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        try:
            n = self._send('"op":"session","session":' + json.dumps(message))
            self._lookups[n] = future
            header, _ = await future
        except ConnectionError as exc:
            if message["op"] == "create":
                raise SandboxError(f"{exc}; retry later") from exc
            raise SessionError(f"session {str(message.get('id'))[:80]!r} has ended: {exc}, and its sessions "
                               "with it", SessionErrorKind.ended) from exc
        answer: remote_sessions.Answer = json.loads(header)["session"]
        return answer

    async def _ask_all(self, message: dict[str, Any]) -> list[remote_sessions.Answer]:
        try:
            return [await self._ask_session(message, None)]
        except (SessionError, SandboxError):
            return []

    def _send(self, body: str, n: int | None = None) -> int:
        if self._writer is None or self._writer.is_closing() or self._lost:
            raise ConnectionError(f"the pool process at {self.path} is gone")
        if n is None:
            n = self._next = self._next + 1
        self._writer.write(_frame(f'{{"n":{n},{body}}}'))
        return n

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, _, rest = (await _read_frame(reader)).partition("\n")
                head = json.loads(header)
                if "stats" in head:
                    self._stats, self._ready, self._figures = head["stats"], head["ready"], head.get("workers", {})
                    continue
                if "started" in head:
                    batch = self._waiting.get(head["n"])
                    if batch is not None:
                        batch.started.add(int(head["started"]))
                    continue
                if "known" in head or "session" in head:
                    lookup = self._lookups.pop(head["n"], None)
                    if lookup is not None and not lookup.done():
                        lookup.set_result([header, rest])
                    continue
                answered = self._waiting.pop(head["n"], None)
                if answered is not None and not answered.future.done():
                    answered.future.set_result(rest.split("\n") if rest else [])
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            self._ready, self._lost = False, True
            if self._writer is not None:
                self._writer.close()
            logger.error("lost the pool process: %s; reconnecting", exc)
            for batch in self._waiting.values():
                if not batch.future.done():
                    batch.future.set_exception(ConnectionError("the pool process went away"))
            for lookup in self._lookups.values():
                if not lookup.done():
                    lookup.set_exception(ConnectionError("the pool process went away"))
            self._waiting.clear()
            self._lookups.clear()
            if not self._closing:
                asyncio.get_running_loop().call_soon(self._reconnect_soon)

    def _reconnect_soon(self) -> None:
        if self._closing:
            return
        self._reconnecting = asyncio.create_task(self._connect(), name="codeenv-pool-reconnect")
        self._reconnecting.add_done_callback(lambda t: t.cancelled() or t.exception())
