"""A worker of the Redis Streams queue: claims jobs for its free slots and writes their results.

Usage::

    worker = StreamWorker(QueueSettings(redis_url="redis://127.0.0.1:6379/0"))
    await worker.start()
    await worker.stopped()            # until worker.stop() (codeenv worker: on SIGTERM)

At most once: a job runs only after this worker set its ``started`` marker (SET NX) with a slot
already held; whoever sets the marker first owns the job, so a job claimed twice (a reclaim racing
a slow worker, a duplicated write) runs once, and a gateway cancels a job only if nobody marked it.
A worker whose heartbeat stops is dead: any live worker takes over its pending jobs, runs those it
never marked, and answers those it marked with ``started: true``: they are never run again.

Sessions live in the worker that created them: it reads their requests (create, fork, delete,
cells) from its own inbox, not the stream (`codeenv.queue.remote_sessions`). A stopping worker
takes no new session and serves its live ones up to `session_drain_s`, then ends them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from redis.exceptions import RedisError, ResponseError

from codeenv.errors import InvalidRequest, PoolClosed, QueueUnavailable
from codeenv.models import ExecRequest, ExecResult, Refusal, Status
from codeenv.queue import remote_sessions
from codeenv.queue.embedded import PoolSessions
from codeenv.queue.redis_protocol import (
    GROUP,
    REPLY_TTL_S,
    Job,
    Keys,
    Marker,
    Scripts,
    connect,
    ensure_group,
    redacted,
    worker_stats,
)
from codeenv.sandbox.pool import SlotPool
from codeenv.settings import QueueSettings

logger = logging.getLogger(__name__)

#: How long a result write is retried while Redis is unreachable before the result is given up.
PUBLISH_RETRY_S = 120.0
#: Read by the claim loop's XREADGROUP: how long one blocking read waits for new jobs.
CLAIM_BLOCK_MS = 1000
#: Results written in the last this many seconds are written again after Redis restarts empty.
RECENT_RESULTS_S = 5.0
RECENT_RESULTS_MAX = 20_000
#: How long a worker's `restored` key is kept.
RESTORED_TTL_S = 3600


class _NotOurs(Exception):
    """The job belongs to someone else (another worker marked it, or it was cancelled): drop it."""


class _Job:
    """A job this worker claimed and has not answered yet."""

    __slots__ = ("entry", "payload_text", "key", "reply", "call_id", "enqueued", "request_json", "marked",
                 "in_pool", "dispatched", "task")

    def __init__(self, entry: str, payload_text: str, marked: bool) -> None:
        job = Job.decode(payload_text)
        self.entry = entry
        self.payload_text = payload_text
        self.key = job.key
        self.reply = job.reply
        self.call_id = job.call_id
        self.enqueued = job.enqueued
        self.request_json = job.request_json
        self.marked = marked  # started marker set by the claim itself
        self.in_pool = False  # waiting in the pool for a slot (only such a job may be handed back)
        self.dispatched = False
        self.task: asyncio.Task[None] | None = None


class StreamWorker:
    """One worker process: a slot pool fed from the jobs stream through the consumer group."""

    def __init__(self, settings: QueueSettings, pool: SlotPool | None = None) -> None:
        if settings.redis_url is None:
            raise ValueError("a worker needs settings.redis_url")
        self.settings = settings
        self.pool = pool if pool is not None else SlotPool(settings)
        self._own_pool = pool is None
        self.keys = Keys(settings.redis_prefix)
        #: Names this worker's inbox, and begins the ids of its sessions (unique per start: a
        #: restarted worker's old ids name no live worker).
        self.tag = uuid.uuid4().hex[:12]
        self.name = f"{socket.gethostname()}:{os.getpid()}:{self.tag}"
        self._r = connect(settings)
        self._blocking = connect(settings)  # XREADGROUP BLOCK holds its connection
        self._inbox = connect(settings)  # so does the inbox's BLMPOP
        self._sessions = PoolSessions(self.pool)
        self._session_tasks: set[asyncio.Task[None]] = set()
        self._held: dict[str, _Job] = {}  # entry id -> job claimed and not yet answered
        self._active = 0  # jobs claimed and not yet out of the pool (what claims count against)
        self._scripts = Scripts(self._r, self.keys)
        self._ran: set[str] = set()  # job keys marked started by us whose result is not yet written
        self._publishing: set[asyncio.Task[None]] = set()  # result writes: never cancelled, awaited by stop()
        self._room = asyncio.Event()
        self._rescan = False  # read our own pending entries again (after a lost connection)
        self._stopping = False
        self._cutting = False  # stopping, past the grace period: running calls are stopped and answered
        self._stopped = asyncio.Event()
        self._force = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._run_id: str | None = None  # the Redis server's run id: a new one means it restarted
        #: Results written lately, as (when, entry, job, reply, call id, result JSON, started): a
        #: restarted Redis may have lost them before their gateway read them.
        self._recent: collections.deque[tuple[float, str, str, str, str | None, str, bool]] = collections.deque(
            maxlen=RECENT_RESULTS_MAX)
        self.marker_ttl_s = int(settings.caps.wall_s + settings.kill_grace_s + settings.cleanup_timeout_s + 60)

    @property
    def capacity(self) -> int:
        return len(self.pool.slots)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._own_pool:
            await self.pool.start()
        try:
            await ensure_group(self._r, self.keys)
            self._run_id = (await self._r.info("server"))["run_id"]
            await self._beat()
        except RedisError as exc:
            if self._own_pool:
                await self.pool.close()
            raise QueueUnavailable(f"cannot reach Redis at {redacted(self.settings.redis_url)}: {exc}") from exc
        if self.pool.sessions is not None:  # the ids gateways give this worker's sessions begin with its tag
            self.pool.sessions.id_prefix = f"{self.tag}."
        self._loops = [asyncio.create_task(self._claim_loop(), name="codeenv-claim"),
                       asyncio.create_task(self._heartbeat_loop(), name="codeenv-heartbeat"),
                       asyncio.create_task(self._reclaim_loop(), name="codeenv-reclaim"),
                       asyncio.create_task(self._inbox_loop(), name="codeenv-inbox")]
        logger.info("worker %s: %d slots, claiming from %s", self.name, self.capacity,
                    redacted(self.settings.redis_url))

    async def stopped(self) -> None:
        await self._stopped.wait()

    def force(self) -> None:
        """Cut a graceful stop short: calls still running are killed (and answered by a reclaimer)."""
        self._force.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop claiming; hand jobs that have not started back at once; give started ones `grace_s`."""
        if self._stopping:
            return
        self._stopping = True
        if self.pool.sessions is not None:
            self.pool.sessions.id_prefix = ""
        with contextlib.suppress(RedisError):  # its room for sessions is 0 now: gateways send them elsewhere
            await self._beat()
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        claim = self._loops[0] if self._loops else None
        if claim is not None:
            # Not cancelled mid-claim (a claim script that ran but whose jobs were never taken
            # would leave them marked as ours): the loop sees _stopping between claims.
            self._room.set()
            try:
                await asyncio.wait_for(asyncio.shield(claim), CLAIM_BLOCK_MS / 1000 + 5)
            except (TimeoutError, Exception):
                claim.cancel()
                await asyncio.gather(claim, return_exceptions=True)
        await self._hand_back([j for j in self._held.values() if j.in_pool and not j.dispatched])
        running: list[asyncio.Future[Any]] = [j.task for j in self._held.values() if j.task is not None]
        if running and grace > 0 and not self._force.is_set():
            forced: asyncio.Future[Any] = asyncio.ensure_future(self._force.wait())
            finished: asyncio.Future[Any] = asyncio.gather(*running, return_exceptions=True)
            await asyncio.wait([finished, forced], timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            forced.cancel()
        await self._drain_sessions()
        # What still runs is stopped and answered `killed` (its result written), not left to a reclaimer.
        self._cutting = True
        cut = [j.task for j in self._held.values() if j.task is not None and j.in_pool and not j.task.done()]
        for task in cut:
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)  # each awaits the write of its result
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._own_pool:
            await self.pool.close()  # kills what still runs; those calls are answered by a reclaimer
        if self._session_tasks:  # cells the pool's close ended: their answers (session_lost) go out
            await asyncio.wait(self._session_tasks, timeout=5)
            for task in self._session_tasks:
                task.cancel()
        for job in list(self._held.values()):
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(j.task for j in self._held.values() if j.task is not None), return_exceptions=True)
        if self._publishing:  # results being written go out before the connection closes
            logger.info("writing %d results before stopping", len(self._publishing))
            await asyncio.gather(*self._publishing, return_exceptions=True)
        try:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.delete(self.keys.alive(self.name))
                pipe.hdel(self.keys.workers, self.name)
                await pipe.execute()
        except RedisError:
            pass
        await self._r.aclose()
        await self._blocking.aclose()
        await self._inbox.aclose()
        logger.info("worker %s stopped", self.name)
        self._stopped.set()

    async def _drain_sessions(self) -> None:
        """Serve the live sessions' requests (no new session) until they end, up to `session_drain_s`
        (or a forced stop); then the pool ends what is left, and their next requests are answered
        `session_lost` (this worker's heartbeat is gone)."""
        manager = self.pool.sessions
        if manager is None or not manager.sessions:
            return
        logger.info("serving %d live sessions for up to %gs before stopping", len(manager.sessions),
                    self.settings.session_drain_s)
        deadline = time.monotonic() + self.settings.session_drain_s
        while manager.sessions and time.monotonic() < deadline and not self._force.is_set():  # noqa: ASYNC110
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))  # (sessions end in many places)

    async def _hand_back(self, jobs: list[_Job]) -> None:
        """Put claimed jobs that never reached a slot back in the stream, for other workers."""
        if not jobs:
            return
        for job in jobs:
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)
        try:
            handed = await self._scripts.hand_back(self.name, [(j.entry, j.key, j.payload_text) for j in jobs])
            logger.info("handed %d unstarted jobs back", handed, extra={"event": "hand_back", "jobs": handed})
        except RedisError as exc:
            logger.warning("could not hand %d jobs back (%s); other workers will reclaim them", len(jobs), exc)
        for job in jobs:
            self._held.pop(job.entry, None)

    # --- claiming -------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        delay = 0.1
        while not self._stopping:
            room = self.capacity - self._active
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            got: Any
            try:
                if self._rescan:
                    # Our own pending entries: jobs we claimed but could not mark or answer.
                    got = await self._r.xreadgroup(GROUP, self.name, {self.keys.jobs: "0"},
                                                   count=room + len(self._held))
                    entries = [(e, f, False) for e, f in (got[0][1] if got else []) if e not in self._held]
                    self._rescan = len(entries) > room
                    entries = entries[:room]
                else:
                    # Claim and mark in one round trip; when nothing waits, block for the next job.
                    claimed = await self._scripts.claim(self.name, room, self.marker_ttl_s)
                    if claimed:
                        entries = [(c.entry, {"job": c.payload}, c.marked) for c in claimed]
                    else:
                        got = await self._blocking.xreadgroup(GROUP, self.name, {self.keys.jobs: ">"},
                                                              count=room, block=CLAIM_BLOCK_MS)
                        entries = [(e, f, False) for e, f in (got[0][1] if got else [])]
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    logger.error("claim refused: %s; retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
                    continue
                logger.warning("the consumer group is gone (Redis restarted?); creating it again")
                try:
                    await self._restore_if_restarted()
                    await ensure_group(self._r, self.keys)
                except RedisError:
                    await asyncio.sleep(delay)
                continue
            except RedisError as exc:
                logger.warning("claim failed: %s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                self._rescan = True
                continue
            delay = 0.1
            for entry, fields, marked in entries:
                self._take(entry, fields, marked)

    def _take(self, entry: str, fields: dict[str, str] | None, marked: bool, delivered: int = 1,
              dead_owner: str | None = None) -> None:
        if not fields or "job" not in fields:  # deleted while pending (cancelled): nothing to run
            self._spawn_ack(entry)
            return
        try:
            job = _Job(entry, fields["job"], marked)
        except (ValueError, KeyError, TypeError) as exc:
            logger.error("dropping malformed job %s: %s", entry, exc)
            self._spawn_ack(entry)
            return
        self._held[entry] = job
        self._active += 1
        job.task = asyncio.create_task(self._handle(job, delivered, dead_owner))

    def _spawn_ack(self, entry: str) -> None:
        async def ack() -> None:
            try:
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.xack(self.keys.jobs, GROUP, entry)
                    pipe.xdel(self.keys.jobs, entry)
                    await pipe.execute()
            except RedisError:
                self._rescan = True
        task = asyncio.create_task(ack())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    # --- running one job ------------------------------------------------------------------------

    async def _handle(self, job: _Job, delivered: int, dead_owner: str | None) -> None:
        try:
            try:
                result = await self._run(job, delivered, dead_owner)
            finally:
                self._active -= 1  # the slot is free again: claim the next job while this one is written
                self._room.set()
            if result is not None:
                # Shielded: a stopping worker cancels the job's task, never the write of its result.
                write = asyncio.create_task(self._publish(job, result), name=f"codeenv-publish-{job.key}")
                self._publishing.add(write)
                write.add_done_callback(self._publishing.discard)
                await asyncio.shield(write)
        except _NotOurs:
            self._spawn_ack(job.entry)
        except asyncio.CancelledError:
            raise
        except RedisError as exc:
            # Not marked (or not known to be): the entry stays ours and is read again once Redis answers.
            logger.warning("job %s postponed: %s", job.key, exc)
            self._rescan = True
        except Exception:
            logger.exception("job %s failed in the worker", job.key)
        finally:
            if job.key not in self._ran:
                self._held.pop(job.entry, None)

    async def _run(self, job: _Job, delivered: int, dead_owner: str | None) -> ExecResult | None:
        started_key = self.keys.started(job.key)
        if dead_owner is not None:
            owner: Any = await self._r.get(started_key)
            if owner in (Marker.cancelled, Marker.done):
                raise _NotOurs
            if owner is not None:
                return ExecResult(id=job.call_id, status=Status.internal_error, started=True,
                                  message=f"the worker running the call ({owner}) died; it is not run again")
            if delivered >= 2:
                if not await self._r.set(started_key, Marker.cancelled, nx=True, ex=self.marker_ttl_s):
                    raise _NotOurs
                return ExecResult(id=job.call_id, status=Status.internal_error, started=False,
                                  message=f"{delivered} workers died holding the call before it started; "
                                          "it is not tried again")
        try:
            request = ExecRequest.model_validate(job.request_json)
        except ValueError as exc:
            return ExecResult(id=job.call_id, status=Status.rejected, refusal=Refusal.invalid, message=str(exc))
        waited = max(0.0, time.time() - job.enqueued)
        if request.deadline_s is not None:
            remaining = request.deadline_s - waited
            if remaining <= 0:
                if not await self._may_answer_unrun(job, started_key):
                    raise _NotOurs
                return ExecResult(id=request.id, status=Status.overloaded, started=False,
                                  message=f"the call waited {waited:.3g}s in the queue, past its deadline of "
                                          f"{request.deadline_s:g}s; not run")
            request = request.model_copy(update={"deadline_s": remaining})

        def on_dispatch() -> None:
            job.dispatched = True

        async def mark() -> None:
            # Called again if a zygote died before the call started (it then runs on another slot).
            if job.marked:
                pass
            elif not await self._scripts.mark(job.key, job.reply, self.name, self.marker_ttl_s):
                owner = await self._r.get(started_key)
                if owner != self.name or job.key in self._ran:
                    raise _NotOurs
                # Our own mark, whose reply was lost: the call never ran.
            job.marked = True
            self._ran.add(job.key)
            logger.debug("start", extra={"event": "start", "job": job.key, "id": job.call_id})

        job.in_pool = True
        try:
            result = await self.pool.run(request, on_dispatch=on_dispatch, before_start=mark)
        except asyncio.CancelledError:
            if not (self._cutting and job.marked):
                raise
            return ExecResult(id=request.id, status=Status.killed, started=True,
                              message="the worker stopped before the call ended (its grace period was over)")
        except InvalidRequest as exc:  # admitted here too: the caps of the worker that runs it decide
            return ExecResult(id=request.id, status=Status.rejected, refusal=Refusal(exc.refusal), message=str(exc))
        except PoolClosed:
            return None  # stopping: a reclaimer answers it (or it was handed back)
        finally:
            job.in_pool = False
        result.queue_s = round(result.queue_s + waited, 6)
        return result

    async def _may_answer_unrun(self, job: _Job, started_key: str) -> bool:
        """Whether this worker may answer a job it never ran as not run: the job's marker is ours
        (set by the claim, the call never started) or we just set it to "cancelled"."""
        if job.marked and job.key not in self._ran:
            return True
        if await self._r.set(started_key, Marker.cancelled, nx=True, ex=self.marker_ttl_s):
            return True
        owner = await self._r.get(started_key)
        return bool(owner == self.name and job.key not in self._ran)

    async def _publish(self, job: _Job, result: ExecResult) -> None:
        """Write the result, ack and delete the entry, atomically (one script); retried while Redis is away."""
        encoded = result.model_dump_json()
        deadline = time.monotonic() + PUBLISH_RETRY_S
        delay = 0.1
        while True:
            try:
                await self._scripts.finish(job.entry, job.key, job.reply, job.call_id, encoded, result.started,
                                           int(self.settings.results_ttl_s))
                now = time.monotonic()
                self._recent.append((now, job.entry, job.key, job.reply, job.call_id, encoded, result.started))
                while self._recent and self._recent[0][0] < now - RECENT_RESULTS_S:
                    self._recent.popleft()
                break
            except RedisError as exc:
                if time.monotonic() > deadline:
                    logger.error("gave up writing the result of job %s: %s", job.key, exc)
                    return  # stays in _ran: never run again here
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        self._ran.discard(job.key)

    # --- sessions -------------------------------------------------------------------------------

    async def _inbox_loop(self) -> None:
        """Read this worker's inbox: each request is answered by a task of its own."""
        key = self.keys.inbox(self.tag)
        delay = 0.1
        while True:
            try:
                got: Any = await self._inbox.blmpop(1, 1, key, direction="RIGHT", count=100)
            except RedisError as exc:
                logger.warning("reading the sessions' inbox failed: %s; retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
                continue
            delay = 0.1
            for text in got[1] if got else ():
                task = asyncio.create_task(self._answer(text))
                self._session_tasks.add(task)
                task.add_done_callback(self._session_tasks.discard)

    async def _answer(self, text: str) -> None:
        try:
            message = json.loads(text)
            n, reply = int(message["n"]), str(message["reply"])
        except (ValueError, KeyError, TypeError) as exc:
            logger.error("dropping a malformed session request: %s", exc)
            return
        try:
            answer = await self._serve(message)
        except Exception as exc:  # our fault: this request says so
            logger.exception("a session request failed in the worker")
            answer = {"error": "failed", "message": f"the worker failed on the request: {exc!r}"}
        body = f"~{n}\n{json.dumps(answer)}"
        deadline = time.monotonic() + PUBLISH_RETRY_S
        delay = 0.1
        while True:
            try:
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.lpush(reply, body)
                    pipe.expire(reply, REPLY_TTL_S)
                    await pipe.execute()
                return
            except RedisError as exc:
                if time.monotonic() > deadline:
                    logger.error("gave up answering a session request: %s", exc)
                    return
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _serve(self, message: dict[str, Any]) -> remote_sessions.Answer:
        if message.get("op") in ("create", "fork", "snapshot") and self._stopping:
            return {"error": "full", "message": "this worker is stopping: it takes no new session (a new one goes "
                                                "to another worker; a fork of one of its sessions cannot)"}
        if message.get("op") != "cell":
            return await remote_sessions.serve(self._sessions, message)
        request = ExecRequest.model_validate(message["request"])
        request._owner = bytes.fromhex(message.get("owner") or "")
        waited = max(0.0, time.time() - float(message.get("t", time.time())))
        try:
            result = await self.pool.run(request)
        except InvalidRequest as exc:
            result = ExecResult(id=request.id, status=Status.rejected, refusal=Refusal(exc.refusal), message=str(exc))
        except PoolClosed:
            result = ExecResult(id=request.id, status=Status.session_lost, started=False, session=request.session,
                                message="the session has ended: its worker stopped")
        result.queue_s = round(result.queue_s + waited, 6)
        return {"result": result.model_dump(mode="json", exclude_none=True)}

    def _figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = self.pool.figures(taking=not self._stopping)
        for key in ("slots", "free_slots", "slot_restarts", "calls_run"):  # sent under their own names
            del figures[key]
        return {"tag": self.tag, **figures}

    # --- liveness and reclaiming ----------------------------------------------------------------

    async def _restore_if_restarted(self) -> None:
        """If Redis came back as a new server (its data gone), put back what this worker knows: the
        started marker of every job it holds (so no gateway takes one of them for never started, and
        no other worker runs it), the results it wrote lately (they may not have been read), and
        then its `restored` key, which gateways wait for before they answer lost calls."""
        run_id = (await self._r.info("server"))["run_id"]
        if run_id == self._run_id:
            return
        await ensure_group(self._r, self.keys)
        jobs = list(self._held.values())
        async with self._r.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.set(self.keys.started(job.key), self.name, ex=self.marker_ttl_s)
                job.marked = True
            await pipe.execute()
        for _, entry, key, reply, call_id, encoded, started in list(self._recent):
            await self._scripts.finish(entry, key, reply, call_id, encoded, started, int(self.settings.results_ttl_s))
        await self._r.set(self.keys.restored(self.name), run_id, ex=RESTORED_TTL_S)
        self._run_id = run_id
        logger.warning("Redis restarted without its data: restored %d jobs' markers and %d recent results",
                       len(jobs), len(self._recent),
                       extra={"event": "redis_restored", "jobs": len(jobs), "results": len(self._recent)})

    async def _beat(self) -> None:
        await self._restore_if_restarted()
        pool = self.pool
        stats = worker_stats(len(pool.slots), pool.free_slots, pool.restarts, pool.calls_started,
                             **self._figures())
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.alive(self.name), stats, px=int(self.settings.worker_dead_after_s * 1000))
            pipe.hset(self.keys.workers, self.name, stats)
            for job in list(self._held.values()):
                if job.marked:  # it must outlive the job however long it is held
                    pipe.expire(self.keys.started(job.key), self.marker_ttl_s, xx=True)
            await pipe.execute()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._beat()
            except RedisError as exc:
                logger.warning("heartbeat failed: %s", exc)

    async def _reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                await self._reclaim()
            except RedisError as exc:
                logger.debug("reclaim skipped: %s", exc)

    async def _reclaim(self) -> None:
        """Take over the pending jobs of workers whose heartbeat expired."""
        try:
            consumers = await self._r.xinfo_consumers(self.keys.jobs, GROUP)
        except ResponseError:
            return  # no group yet (Redis restarted): the claim loop recreates it
        dead_after_ms = int(self.settings.worker_dead_after_s * 1000)
        for consumer in consumers:
            name = consumer["name"]
            if name == self.name or await self._r.exists(self.keys.alive(name)):
                continue
            if consumer["pending"] == 0:
                if consumer["idle"] > dead_after_ms:
                    await self._r.xgroup_delconsumer(self.keys.jobs, GROUP, name)
                    await self._r.hdel(self.keys.workers, name)
                continue
            pending: Any = await self._r.xpending_range(self.keys.jobs, GROUP, "-", "+", 1000, consumername=name)
            delivered = {p["message_id"]: p["times_delivered"] for p in pending}
            # The idle floor keeps two reclaimers from taking the same entry: a claim resets it.
            claimed: Any = await self._r.xclaim(self.keys.jobs, GROUP, self.name,
                                           min_idle_time=int(self.settings.heartbeat_s * 1000),
                                           message_ids=list(delivered))
            if claimed:
                logger.warning("took over %d jobs of dead worker %s", len(claimed), name,
                               extra={"event": "reclaim", "jobs": len(claimed), "dead": name})
            for entry, fields in claimed:
                self._take(entry, fields, False, delivered.get(entry, 1), dead_owner=name)
