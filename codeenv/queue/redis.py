"""The Redis Streams queue, gateway side: calls go to a stream that `codeenv worker` processes drain.

Usage::

    queue = RedisQueue(GatewaySettings(redis_url="redis://127.0.0.1:6379/0"))
    await queue.start()
    results = await queue.submit([ExecRequest(code="print(1)")])

The keys, the marker values and the scripts are the at-most-once contract that gateways and
workers share: `codeenv.queue.redis_protocol`. Everything a call leaves behind expires: a finished
job's marker after ``DONE_TTL_S``, results of calls with an id after ``results_ttl_s``, a gateway's
reply list when it stops reading it, so Redis memory returns to its baseline after a burst.

Sessions: a new one goes to the live worker with the largest share of its budget free; every later request
about it (its cells too) goes to that worker's inbox, whichever gateway receives it. A session id
is the worker's tag, a dot, and the id the worker made. While a gateway waits on a worker for a
session, it watches the worker's heartbeat: a worker that died (or stopped) answers its sessions
`session_lost` (410) within `worker_dead_after_s` and a heartbeat.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import re
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from codeenv.errors import QueueUnavailable, SandboxError, SessionError, SessionErrorKind, id_taken, session_not_found
from codeenv.models import SERVICE_ID_START, ExecRequest, ExecResult, Refusal, Status
from codeenv.queue import remote_sessions
from codeenv.queue.base import NO_STATS, OnResult, SessionService, notify_each, until_done_or_gone
from codeenv.queue.embedded import STOPPING, fingerprint
from codeenv.queue.redis_protocol import (
    DONE_TTL_S,
    GROUP,
    REPLY_TTL_S,
    Keys,
    NewCall,
    Scripts,
    connect,
    encode_job,
    ensure_group,
    redacted,
)
from codeenv.settings import GatewaySettings

logger = logging.getLogger(__name__)

#: Calls per submit script run, so one huge burst does not hold Redis for long.
SUBMIT_CHUNK = 1000
#: How often calls attached to another gateway's job look for its result.
ATTACH_POLL_S = 0.05
#: How often the gateway refreshes the gauges and readiness it reads from Redis.
SNAPSHOT_EVERY_S = 1.0
#: A session id as clients see it: its worker's tag, a dot, the worker's own id.
ROUTED_ID = re.compile(r"([0-9a-f]{12})\.(.{1,180})", re.ASCII | re.DOTALL)
#: How often a gateway waiting on a worker for a session looks at the worker's heartbeat (at most).
WORKER_CHECK_S = 0.5


class _WorkerGone(Exception):
    """The worker that holds a session stopped or died while a request about it waited; `taken`: it
    had read the request (a cell may have run)."""

    def __init__(self, taken: bool) -> None:
        super().__init__("its worker is gone (it stopped or died)")
        self.taken = taken


def from_settings(settings: GatewaySettings) -> RedisQueue:
    """A gateway's queue with `redis_url` set: jobs through Redis Streams to workers."""
    return RedisQueue(settings)


class _Call:
    """One call this gateway wrote to the stream and has not answered yet."""

    __slots__ = ("key", "request", "fingerprint", "future", "entry", "timer", "accepted", "started_by")

    def __init__(self, request: ExecRequest, future: asyncio.Future[ExecResult], accepted: float) -> None:
        self.accepted = accepted  # time.monotonic() when the gateway took the call
        self.key = uuid.uuid4().hex
        self.request = request
        self.fingerprint = fingerprint(request) if request.id is not None else ""
        self.future = future
        self.entry = ""
        self.timer: asyncio.TimerHandle | None = None
        self.started_by: str | None = None  # the worker that marked it started, as it told us

    def answer(self, result: ExecResult) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.future.done():
            self.future.set_result(result)


class RedisQueue:
    """The gateway's side of the Redis Streams queue.

    Calls submitted in the same event-loop tick (concurrent single calls and batches alike) go to
    Redis in one script run; results come back in bulk from this process's own reply list.
    """

    def __init__(self, settings: GatewaySettings) -> None:
        if settings.redis_url is None:
            raise ValueError("RedisQueue needs settings.redis_url")
        self.settings = settings
        self.keys = Keys(settings.redis_prefix)
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.reply = self.keys.reply(self.name)
        self._r = connect(settings)
        self._reader = connect(settings)  # BLMPOP holds its connection
        self._scripts = Scripts(self._r, self.keys)
        self._pending: list[_Call] = []
        self._to_cancel: list[_Call] = []
        self._waiting: dict[str, _Call] = {}  # job key -> call, for calls in the stream
        self._attached: dict[str, list[asyncio.Future[ExecResult]]] = {}  # client id -> waiters
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[None]] = []
        self._run_id: str | None = None
        self._down: str | None = None  # why Redis is unreachable, while it is
        self._snapshot: dict[str, float] = dict(NO_STATS)
        self._workers_seen: set[str] = set()  # the live workers at the last snapshot
        self._tags: dict[str, tuple[str, dict[str, Any]]] = {}  # tag -> (name, stats) of the live workers
        self._refreshed = 0.0  # time.monotonic() of the last snapshot
        self._draining = False
        self._asks = itertools.count(1)
        self._answers: dict[int, asyncio.Future[remote_sessions.Answer]] = {}  # session requests out
        self._cells: set[asyncio.Task[None]] = set()  # sessions' cells out
        #: The sessions of every worker, each reached through its worker's inbox.
        self.sessions: SessionService | None = remote_sessions.RemoteSessions(self._ask_session, self._ask_all)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            self._run_id = (await self._r.info("server"))["run_id"]
            await ensure_group(self._r, self.keys)
        except RedisError as exc:
            raise QueueUnavailable(f"cannot reach Redis at {redacted(self.settings.redis_url)}: {exc}") from exc
        await self._refresh_snapshot()
        self._loops = [asyncio.create_task(self._read_replies(), name="codeenv-replies"),
                       asyncio.create_task(self._watch(), name="codeenv-snapshot")]
        logger.info("gateway %s queues through Redis at %s", self.name, redacted(self.settings.redis_url))

    async def close(self) -> None:
        if self._waiting and self.settings.shutdown_grace_s > 0:
            futures = [c.future for c in self._waiting.values()]
            await asyncio.wait(futures, timeout=self.settings.shutdown_grace_s)
        for task in self._loops + list(self._tasks) + list(self._cells):
            task.cancel()
        await asyncio.gather(*self._loops, *self._tasks, *self._cells, return_exceptions=True)
        for call in list(self._waiting.values()) + self._pending:
            call.answer(self._lost(call.request, "the gateway stopped before the call's result came back"))
        for answer in self._answers.values():
            if not answer.done():
                answer.set_exception(_WorkerGone(True))
        for call_id, futures in self._attached.items():
            for future in futures:
                if not future.done():
                    future.set_result(ExecResult(id=call_id, status=Status.internal_error, started=True,
                                                 message="the gateway stopped before the call's result came back"))
        try:
            await self._r.delete(self.reply)
        except RedisError:
            pass
        await self._r.aclose()
        await self._reader.aclose()

    def ready(self) -> bool:
        return (not self._draining and self._down is None and self._snapshot["workers"] > 0
                and self._snapshot["slots"] > 0)

    def drain(self, until: float) -> None:
        """This gateway is stopping: calls no worker has started are taken back from the stream and
        answered `overloaded` (started: false); results of running ones are awaited until `until`."""
        if self._draining:
            return
        self._draining = True
        self._cancel_soon([c for c in self._waiting.values() if not c.future.done()])
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() + max(0.0, until - time.monotonic()), self.force)

    def force(self) -> None:
        """Stop waiting: each call still out is answered as lost (it may still run on its worker)."""
        for call in list(self._waiting.values()):
            call.answer(self._lost(call.request, "the gateway stopped before the call's result came back"))
        self._waiting.clear()
        for cell in self._cells:
            cell.cancel()

    def stats(self) -> dict[str, float]:
        return self._snapshot

    def worker_figures(self) -> dict[str, dict[str, float]]:
        return {name: {RENAMED.get(k, k): v for k, v in stats.items() if isinstance(v, int | float) and k != "pid"}
                for name, stats in self._tags.values()}

    # --- calls ----------------------------------------------------------------------------------

    async def submit(self, requests: Sequence[ExecRequest], gone: asyncio.Event | None = None,
                     accepted_at: float | None = None, on_result: OnResult | None = None) -> list[ExecResult]:
        loop = asyncio.get_running_loop()
        accepted = time.monotonic() if accepted_at is None else accepted_at
        futures: list[asyncio.Future[ExecResult]] = []
        mine: list[_Call] = []
        for request in requests:
            future: asyncio.Future[ExecResult] = loop.create_future()
            futures.append(future)
            if self._down is not None or self._draining:
                why = STOPPING if self._draining else f"the queue is unreachable ({self._down}); retry later"
                future.set_result(ExecResult(id=request.id, status=Status.overloaded, started=False, message=why))
                continue
            if request.session is not None:  # to its session's worker, not the stream
                cell = asyncio.ensure_future(self._cell(request, future, accepted))
                self._cells.add(cell)
                cell.add_done_callback(self._cells.discard)
                continue
            call = _Call(request, future, accepted)
            mine.append(call)
            if not self._pending:
                loop.call_soon(self._spawn, self._flush())
            self._pending.append(call)
        notify_each(futures, on_result)
        batch = asyncio.gather(*futures)

        def cancel_unstarted() -> None:  # calls with an id run on: a reconnecting caller may attach
            doomed = [c for c in mine if c.request.id is None and not c.future.done()]
            if doomed:
                self._cancel_soon(doomed)

        results: list[ExecResult] = await until_done_or_gone(batch, gone, cancel_unstarted)
        return results

    async def lookup(self, call_id: str) -> tuple[bool, ExecResult | None]:
        try:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.get(self.keys.result(call_id))
                pipe.exists(self.keys.call(call_id))
                result, known = await pipe.execute()
        except RedisError as exc:
            raise QueueUnavailable(f"the queue is unreachable ({exc})") from exc
        if result is not None:
            return True, ExecResult.from_json(result)
        return bool(known), None

    # --- sessions -------------------------------------------------------------------------------

    async def _cell(self, request: ExecRequest, future: asyncio.Future[ExecResult], accepted: float) -> None:
        """A session's cell, run by its session's worker."""
        assert request.session is not None
        message = {"op": "cell", "owner": request._owner.hex(), "t": time.time() - (time.monotonic() - accepted)}
        try:
            tag, known_as = await self._route(request.session, request._owner.hex())
            local = request.model_copy(update={"session": known_as})
            answer = await self._ask(tag, {**message, "request": local.model_dump(mode="json")})
            remote_sessions.raise_error(answer)
            result = ExecResult.model_validate(answer["result"])
            result.session = request.session
        except _WorkerGone as exc:
            result = ExecResult(id=request.id, status=Status.session_lost, started=exc.taken, session=request.session,
                                message=f"the session has ended: {exc}")
        except SessionError as exc:
            lost = exc.kind is SessionErrorKind.ended
            result = ExecResult(id=request.id, status=Status.session_lost if lost else Status.rejected,
                                refusal=None if lost else Refusal.no_session, started=False,
                                session=request.session if lost else None, message=str(exc))
        except (RedisError, SandboxError, ValueError, KeyError) as exc:
            result = ExecResult(id=request.id, status=Status.overloaded, started=False,
                                message=f"the cell could not reach its session's worker ({exc}); retry later")
        except TimeoutError as exc:
            result = self._lost(request, str(exc))
        except asyncio.CancelledError:  # the gateway stops
            if not future.done():
                future.set_result(self._lost(request, "the gateway stopped before the cell's result came back"))
            raise
        if not future.done():
            future.set_result(result)

    def _bound_s(self) -> float:
        """The longest a worker may take over a session request (a cell, or a fork waiting for one)."""
        s = self.settings
        return s.caps.wall_s + s.kill_grace_s + s.control_timeout_s + s.cleanup_timeout_s + 60

    async def _worker(self, tag: str) -> str | None:
        """The name of the live worker with this tag, or None."""
        found = self._tags.get(tag)
        if found is None and time.monotonic() - self._refreshed > WORKER_CHECK_S:
            await self._refresh_snapshot()  # a worker newer than the last snapshot
            found = self._tags.get(tag)
        return None if found is None else found[0]

    async def _ask(self, tag: str, message: dict[str, Any]) -> remote_sessions.Answer:
        """Send `message` to the inbox of the worker `tag` and wait for its answer, watching its
        heartbeat meanwhile. _WorkerGone when it is not alive (or stops being alive)."""
        name = await self._worker(tag)
        if name is None:
            raise _WorkerGone(False)
        n = next(self._asks)
        future: asyncio.Future[remote_sessions.Answer] = asyncio.get_running_loop().create_future()
        self._answers[n] = future
        inbox = self.keys.inbox(tag)
        text = json.dumps({**message, "n": n, "reply": self.reply})
        try:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.lpush(inbox, text)
                pipe.expire(inbox, REPLY_TTL_S)
                await pipe.execute()
            deadline = time.monotonic() + self._bound_s()
            every = min(WORKER_CHECK_S, self.settings.heartbeat_s)
            while True:
                done, _ = await asyncio.wait([future], timeout=every)
                if done:
                    return future.result()
                try:
                    alive = bool(await self._r.exists(self.keys.alive(name)))
                    taken = alive or not await self._r.lrem(inbox, 1, text)
                except RedisError:  # Redis is away: the answer may still come, or the worker's death
                    alive = True
                if not alive:
                    if future.done():
                        return future.result()
                    raise _WorkerGone(taken)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"its worker did not answer within {self._bound_s():g}s")
        finally:
            self._answers.pop(n, None)

    def _routed(self, tag: str, answer: remote_sessions.Answer) -> remote_sessions.Answer:
        """The answer with its sessions' ids as clients see them: the ids the worker made begin with
        its tag; an id a client chose stays as it is."""
        ok = answer.get("ok")
        for info in ok if isinstance(ok, list) else [ok] if isinstance(ok, dict) else []:
            if SERVICE_ID_START.match(info["session_id"]):
                info["session_id"] = f"{tag}.{info['session_id']}"
        return answer

    async def _route(self, session_id: str, owner: str) -> tuple[str, str]:
        """The tag of the worker that holds `session_id` (for `owner`, hex), and the id that worker
        knows it by; SessionError not_found for an id of neither shape, or one no gateway named."""
        shape = ROUTED_ID.fullmatch(session_id)
        if shape is not None:
            return shape[1], shape[2]
        if SERVICE_ID_START.match(session_id):
            raise session_not_found(session_id)
        tag = await self._r.get(self.keys.named(owner, session_id))
        if tag is None:
            raise session_not_found(session_id)
        return str(tag), session_id

    async def _ask_session(self, message: dict[str, Any], session_id: str | None) -> remote_sessions.Answer:
        if self._down is not None:
            raise SandboxError(f"the queue is unreachable ({self._down}); retry later")
        try:
            if session_id is None:
                return await self._create(message)
            tag, known_as = await self._route(session_id, message["owner"])
            # A name's entry outlives its session's delete: its worker answers it 410 until it is reused.
            return self._routed(tag, await self._ask(tag, {**message, "id": known_as}))
        except _WorkerGone as exc:
            if session_id is None:
                raise SandboxError(f"the worker chosen for the session {exc}; retry") from None
            raise SessionError(f"session {session_id[:80]!r} has ended: {exc}", SessionErrorKind.ended) from None
        except RedisError as exc:
            raise SandboxError(f"the queue is unreachable ({exc}); retry later") from exc
        except TimeoutError as exc:
            raise SandboxError(str(exc)) from exc

    async def _create(self, message: dict[str, Any]) -> remote_sessions.Answer:
        """A new session, on the live worker with the largest share of its sessions budget free (then free slots); a
        worker that answers full (it filled up, or began to stop, since its last heartbeat) passes
        it to the next, and once every worker this gateway knew of did, to those it learns of now."""
        if not self._tags:
            await self._refresh_snapshot()
        tried: set[str] = set()
        answer: remote_sessions.Answer = {}
        named = message.get("session_id")
        if named is not None:  # a name the caller chose: its worker decides (409 while it is live there)
            key = self.keys.named(message["owner"], named)
            holder = await self._r.get(key)
            if holder is not None and await self._worker(str(holder)) is not None:
                tried.add(str(holder))
                answer = await self._ask(str(holder), message)
                if answer.get("error") != SessionErrorKind.full.value:
                    if "ok" in answer:
                        await self._r.set(key, str(holder), ex=self._named_ttl_s())
                    return self._routed(str(holder), answer)
        for fresh in (False, True):
            if fresh:
                await self._refresh_snapshot()
            ranked = sorted(self._tags.items(), key=lambda t: (_room_share(t[1][1]), t[1][1].get("free", 0),
                                                               random.random()), reverse=True)
            candidates = [tag for tag, (_, stats) in ranked if stats.get("session_room", 0) > 0 and tag not in tried]
            if not ranked:
                raise SandboxError("no worker is alive to hold the session; retry later")
            for tag in candidates:
                tried.add(tag)
                try:
                    answer = await self._ask(tag, message)
                except _WorkerGone:
                    continue
                if answer.get("error") != SessionErrorKind.full.value:
                    if "ok" in answer and tag in self._tags:  # counted now, before its next heartbeat
                        stats = self._tags[tag][1]
                        stats["session_room"], stats["sessions"] = stats["session_room"] - 1, stats["sessions"] + 1
                    if "ok" in answer and named is not None:
                        await self._r.set(self.keys.named(message["owner"], named), tag, ex=self._named_ttl_s())
                    return self._routed(tag, answer)
        if not answer:
            raise SessionError(f"each of the {len(self._tags)} live workers holds as many sessions as it may (or "
                               "is stopping); end some, or retry later", SessionErrorKind.full)
        return answer

    def _named_ttl_s(self) -> int:
        """How long a name a client chose routes to its worker: the longest a session may live."""
        return int(self.settings.session_max_lifetime_s) + 60

    async def _ask_all(self, message: dict[str, Any]) -> list[remote_sessions.Answer]:
        tags = list(self._tags)
        answers = await asyncio.gather(*(self._ask(t, message) for t in tags), return_exceptions=True)
        return [self._routed(t, a) for t, a in zip(tags, answers, strict=True) if isinstance(a, dict)]

    # --- writing calls --------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush(self) -> None:
        """Write every call submitted this tick, in one script run per SUBMIT_CHUNK calls."""
        batch, self._pending = self._pending, []
        for start in range(0, len(batch), SUBMIT_CHUNK):
            new: list[NewCall] = []
            chunk: list[_Call] = []
            for call in batch[start:start + SUBMIT_CHUNK]:
                try:
                    payload = encode_job(call.key, self.reply, call.request.id, call.request.model_dump_json(),
                                         time.time() - (time.monotonic() - call.accepted))
                except ValueError as exc:  # e.g. text that cannot be encoded: this call alone is refused
                    call.answer(ExecResult(id=None, status=Status.rejected, refusal=Refusal.invalid,
                                           message=f"cannot be queued: {exc}"))
                    continue
                # Registered before the write: a fast worker's result may be read before the
                # script's own reply.
                self._waiting[call.key] = call
                new.append(NewCall(call.key, call.request.id, call.fingerprint, payload))
                chunk.append(call)
            if not chunk:
                continue
            try:
                outcome = await self._scripts.submit(new, self.settings.max_queued, int(self.settings.results_ttl_s))
            except Exception as exc:
                if not isinstance(exc, RedisError):
                    logger.exception("queue write failed")
                for call in chunk:
                    self._waiting.pop(call.key, None)
                    if isinstance(exc, RedisError) and _never_sent(exc):
                        call.answer(ExecResult(id=call.request.id, status=Status.overloaded, started=False,
                                               message=f"the queue is unreachable ({exc}); retry later"))
                    else:  # the write may have happened: the call may run, so it says started
                        call.answer(self._lost(call.request, f"the queue failed while taking the call ({exc})"))
                continue
            for call, answer in zip(chunk, outcome, strict=True):
                if answer == "":
                    self._waiting.pop(call.key, None)
                    call.answer(ExecResult(id=call.request.id, status=Status.overloaded, started=False,
                                           message=f"more than {self.settings.max_queued} calls are queued; "
                                                   "retry later"))
                elif " " in answer:
                    self._waiting.pop(call.key, None)
                    self._attach(call, *answer.split(" "))
                else:
                    call.entry = answer
                    if call.request.deadline_s is not None and not call.future.done():
                        call.timer = asyncio.get_running_loop().call_later(
                            max(0.0, call.request.deadline_s - (time.monotonic() - call.accepted)),
                            self._cancel_soon, [call])

    def _attach(self, call: _Call, fp: str, job: str, _entry: str) -> None:
        """A resubmission of a call its client id already names: answer it with that call's result."""
        if fp != call.fingerprint:
            call.answer(ExecResult(id=call.request.id, status=Status.rejected, refusal=Refusal.id_taken,
                                   started=False, message=id_taken(call.request.id)))
            return
        original = self._waiting.get(job)
        if original is not None:  # written by this gateway: share its future
            original.future.add_done_callback(lambda f: call.answer(f.result()))
            return
        assert call.request.id is not None
        first = not self._attached
        self._attached.setdefault(call.request.id, []).append(call.future)
        if first:
            self._spawn(self._poll_attached())

    async def _poll_attached(self) -> None:
        """Calls attached to another gateway's job learn its result from the result key."""
        while self._attached:
            await asyncio.sleep(ATTACH_POLL_S)
            ids = list(self._attached)
            try:
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.mget([self.keys.result(i) for i in ids])
                    pipe.mget([self.keys.call(i) for i in ids])
                    results, calls = await pipe.execute()
            except RedisError:
                continue
            for call_id, result, call in zip(ids, results, calls, strict=True):
                if result is not None:
                    try:
                        answer = ExecResult.from_json(result)
                    except ValueError:
                        answer = ExecResult(id=call_id, status=Status.internal_error, started=True,
                                            message="the call's stored result could not be read")
                elif call is None:
                    answer = ExecResult(id=call_id, status=Status.overloaded, started=False,
                                        message="the call this id names was cancelled before it started; "
                                                "send it again")
                else:
                    continue
                for future in self._attached.pop(call_id):
                    if not future.done():
                        future.set_result(answer)

    def _cancel_soon(self, calls: list[_Call]) -> None:
        if not self._to_cancel:
            asyncio.get_running_loop().call_soon(self._spawn, self._cancel_pending())
        self._to_cancel += calls

    async def _cancel_pending(self) -> None:
        """Cancel calls (deadline passed, caller gone) that no worker has started; started ones run on."""
        calls, self._to_cancel = [c for c in self._to_cancel if not c.future.done() and c.entry], []
        if not calls:
            return
        try:
            cancelled = await self._scripts.cancel([(c.key, c.entry, c.request.id) for c in calls], DONE_TTL_S)
        except RedisError as exc:
            logger.warning("could not cancel %d calls (%s); trying again", len(calls), exc)
            asyncio.get_running_loop().call_later(0.5, self._cancel_soon, calls)
            return
        for call, done in zip(calls, cancelled, strict=True):
            if done:
                self._waiting.pop(call.key, None)
                deadline = call.request.deadline_s
                call.answer(ExecResult(
                    id=call.request.id, status=Status.overloaded, started=False,
                    message=STOPPING if self._draining else
                    f"no worker started the call within its deadline of {deadline:g}s; not run"
                    if deadline is not None else "cancelled before it started: the caller went away"))

    # --- reading results ------------------------------------------------------------------------

    async def _read_replies(self) -> None:
        while True:
            try:
                got: Any = await self._reader.blmpop(1, 1, self.reply, direction="RIGHT", count=1000)
            except RedisError as exc:
                try:
                    await self._reconnect(exc)
                except Exception:
                    logger.exception("reconnecting to Redis failed; trying again")
                continue
            except Exception:
                logger.exception("reading results failed; trying again")
                await asyncio.sleep(0.1)
                continue
            if got is None:
                continue
            for item in got[1]:
                job, _, body = item.partition("\n")
                if job.startswith("~"):  # a worker's answer to a session request
                    answered = self._answers.get(int(job[1:]))
                    if answered is not None and not answered.done():
                        try:
                            answered.set_result(json.loads(body))
                        except ValueError as exc:
                            answered.set_exception(SandboxError(f"unreadable answer from the worker: {exc}"))
                    continue
                if body.startswith("@"):  # a worker started the job
                    started = self._waiting.get(job)
                    if started is not None:
                        started.started_by = body[1:]
                    continue
                call = self._waiting.pop(job, None)
                if call is None:
                    continue  # answered already (cancelled, lost in a restart) or another gateway's
                try:
                    call.answer(ExecResult.from_json(body))
                except ValueError as exc:
                    logger.error("unreadable result for job %s: %s", job, exc)
                    call.answer(self._lost(call.request, "its result could not be read"))

    async def _reconnect(self, exc: BaseException) -> None:
        """Wait for Redis to answer again; after a restart, answer the calls it lost."""
        if self._down is None:
            logger.error("Redis unreachable: %s", exc, extra={"event": "redis_down"})
        self._down = str(exc) or type(exc).__name__
        delay = 0.1
        while True:
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
            try:
                run_id = (await self._r.info("server"))["run_id"]
                await ensure_group(self._r, self.keys)
            except RedisError:
                continue
            break
        restarted = run_id != self._run_id
        self._run_id = run_id
        logger.warning("Redis reachable again%s", " (it restarted)" if restarted else "",
                       extra={"event": "redis_up", "restarted": restarted})
        self._down = None  # new calls go to the new stream: they are never taken for lost ones
        if restarted:
            for attempt in range(20):
                try:
                    await self._answer_lost_calls()
                    break
                except RedisError:
                    await asyncio.sleep(min(2.0, 0.1 * 2**attempt))

    async def _answer_lost_calls(self) -> None:
        """After Redis came back without its data: once the workers that were alive have put back
        the markers of the jobs they hold and written their recent results again (or were given up
        for dead), a call with neither its job, a marker nor a result never started, unless a worker
        told this gateway it started it (a ``@WORKER`` line): the others are answered `overloaded`,
        `started: false`, so that their clients send them again; those a worker started (it died with
        Redis) may have run."""
        expected = set(self._workers_seen)
        settings = self.settings
        deadline = time.monotonic() + settings.worker_dead_after_s + 2 * settings.heartbeat_s
        restored: set[str] = set()
        while expected:
            names = sorted(expected)
            values = await self._r.mget([self.keys.restored(n) for n in names])
            restored = {n for n, v in zip(names, values, strict=True) if v == self._run_id}
            if restored == expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(min(0.1, settings.heartbeat_s / 2))
        missing = sorted(expected - restored)
        calls = [c for c in self._waiting.values() if c.entry]
        if not calls:
            return
        async with self._r.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.exists(self.keys.started(call.key))
                pipe.xrange(self.keys.jobs, call.entry, call.entry, count=1)
            found = await pipe.execute()
        lost = unrun = 0
        for i, call in enumerate(calls):
            if found[2 * i] or found[2 * i + 1] or call.key not in self._waiting:
                continue
            self._waiting.pop(call.key, None)
            if call.started_by is not None:  # its worker told us it started it, and has no marker now
                why = "did not come back" if call.started_by in missing else "holds it no more"
                call.answer(self._lost(call.request, f"Redis restarted and lost the call, and the worker that "
                                                     f"started it ({call.started_by}) {why}"))
                lost += 1
            else:
                call.answer(ExecResult(id=call.request.id, status=Status.overloaded, started=False,
                                       message="Redis restarted and lost the call before any worker started it; "
                                               "not run: send it again"))
                unrun += 1
        if lost or unrun:
            logger.error("Redis restarted: %d lost calls never started (answered overloaded), %d may have run",
                         unrun, lost, extra={"event": "calls_lost", "calls": lost, "unrun": unrun})

    @staticmethod
    def _lost(request: ExecRequest, why: str) -> ExecResult:
        return ExecResult(id=request.id, status=Status.internal_error, started=True,
                          message=f"{why}; it may have run, so it is not run again by the service")

    # --- gauges and readiness -------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_EVERY_S)
            try:
                await self._refresh_snapshot()
            except RedisError:
                pass

    async def _refresh_snapshot(self) -> None:
        async with self._r.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.workers)
            pipe.xinfo_groups(self.keys.jobs)
            pipe.xlen(self.keys.jobs)
            pipe.time()
            workers, groups, length, now = await pipe.execute()
        names = list(workers)
        group = next((g for g in groups if g["name"] == GROUP), None)
        async with self._r.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.pttl(self.keys.alive(name))  # -2: gone; its heartbeat's age from what is left
            if group is not None:
                pipe.xrange(self.keys.jobs, f"({group['last-delivered-id']}", "+", count=1)
            found = await pipe.execute()
        dead_after_ms = self.settings.worker_dead_after_s * 1000
        ages = {n: max(0.0, dead_after_ms - ttl) / 1000 if ttl >= 0 else 0.0
                for n, ttl in zip(names, found, strict=False) if ttl != -2}
        alive = list(ages)
        stats = {n: {**json.loads(workers[n]), "heartbeat_age_s": ages[n]} for n in alive}
        live = list(stats.values())
        self._workers_seen = set(alive)
        self._tags = {w["tag"]: (n, w) for n, w in stats.items() if w.get("tag")}
        self._refreshed = time.monotonic()
        oldest = 0.0
        if group is not None and found[len(names):] and found[-1]:
            entry_ms = int(found[-1][0][0].split("-")[0])
            oldest = max(0.0, now[0] + now[1] / 1e6 - entry_ms / 1000)
        self._snapshot = {
            "slots": sum(w["slots"] for w in live), "free_slots": sum(w["free"] for w in live),
            "slot_restarts": sum(w["restarts"] for w in live), "calls_run": sum(w["calls"] for w in live),
            # Entries not yet delivered to a worker ("lag" is unknown once entries are deleted).
            "waiting": max(0, length - group["pending"]) if group is not None else 0, "oldest_wait_s": oldest,
            "workers": len(live), "sessions": sum(w.get("sessions", 0) for w in live),
        }


#: A worker's figures that its heartbeat sends under short names (older gateways read those).
RENAMED = {"free": "free_slots", "restarts": "slot_restarts", "calls": "calls_run"}


def _never_sent(exc: BaseException) -> bool:
    """Whether a Redis error happened while connecting (so the command never reached Redis)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError | socket.gaierror):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _room_share(stats: dict[str, Any]) -> float:
    """The share of a worker's sessions budget still free: new sessions go where it is largest, so that
    they spread evenly over workers whose budgets differ a little (each is held to what its host allows
    when it starts), and in proportion over hosts of different sizes."""
    room, held = float(stats.get("session_room", 0)), float(stats.get("sessions", 0))
    return room / max(1.0, room + held)
