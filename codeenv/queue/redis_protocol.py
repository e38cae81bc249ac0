"""The Redis at-most-once contract: the keys, the marker values, the scripts and the job encoding
that gateways (`codeenv.queue.redis`) and workers (`codeenv.worker.redis`) share.

The keys, all under one prefix (default ``codeenv``):

========================  =====================================================================
``P:jobs``                the stream of jobs; workers read it through the consumer group ``workers``
``P:started:JOB``         the arbiter of at-most-once: set (NX) to the worker's name just before a
                          slot runs the job, or to ``cancelled`` by whoever cancels it first; set to
                          ``done`` with the result
``P:call:ID``             a client id -> ``fingerprint job entry`` while the call is remembered
``P:result:ID``           the result of a call with a client id, kept ``results_ttl_s``
``P:reply:GATEWAY``       results for one gateway process, read in bulk (BLMPOP)
``P:alive:WORKER``        a worker's heartbeat; it expires ``worker_dead_after_s`` after the last
``P:workers``             worker -> its last reported stats (slots, free slots, restarts, calls)
``P:restored:WORKER``     the run id of the Redis server a worker restored its state into, after
                          that server came back without its data (see `codeenv.worker.redis`)
``P:inbox:TAG``           the requests for one worker's sessions (create, fork, delete, their
                          cells: `codeenv.queue.remote_sessions`), read by that worker alone
                          (BLMPOP); TAG is the last part of the worker's name
``P:named:OWNER:ID``      the tag of the worker that holds the session its owner (the hash of its
                          session key, hex) named ID (an id the client chose), for the longest a
                          session may live
``P:jobs:no-id``          never written: stands for "no client id" among a script's keys
========================  =====================================================================

The contract: a job runs only after a worker set its ``started`` marker (SET NX) with a slot already
held; whoever sets the marker first owns the job. A gateway cancels a job only by setting the marker
to `Marker.cancelled` first. So a job claimed twice runs once, and a cancelled job never runs.
Setting the marker also tells the job's gateway, in the same script: a line ``JOB`` newline
``@WORKER`` in its reply list (ahead of the result's ``JOB`` newline ``RESULT``), so that a gateway
knows which worker started each of its calls even after Redis loses its data.

Every script takes the names of the keys it touches as KEYS (built here, by `Keys`) and the marker
values as ARGV: no script builds a key name or spells a marker of its own. Needs a single Redis (or
a Sentinel-managed one) >= 7.0.

Sessions are not jobs: a session lives in the worker that created it, so requests about it go to
that worker's inbox, never to the stream, and its answer comes back in the gateway's reply list as
``~N`` newline ``ANSWER`` (N: the gateway's request number). A session id seen by clients is the
worker's tag, a dot, and the id the worker's pool made, or an id the client chose (found through
``P:named``). A worker that dies takes its sessions with
it: a gateway waiting on one answers `session_lost` once the worker's heartbeat expires.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from codeenv.settings import QueueSettings

GROUP = "workers"
#: How long the marker of a finished job outlives it (a late cancel must still see it).
DONE_TTL_S = 60
#: How long a gateway's reply list outlives its last result (it is read continuously while alive).
REPLY_TTL_S = 300


class Marker(StrEnum):
    """Values of a job's ``started`` key other than the name of the worker that started it."""

    cancelled = "cancelled"  # nobody may run it (a gateway cancelled it, or a worker gave up on it)
    done = "done"  # its result is written


class Keys:
    """Names of the keys under one prefix (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.jobs = f"{prefix}:jobs"
        #: Stands for "no key" in the scripts' KEYS (a call without a client id): a name under the
        #: prefix that is never written, so that an ACL user limited to the prefix may pass it.
        self.none = f"{self.jobs}:no-id"
        self.workers = f"{prefix}:workers"

    def started(self, job: str) -> str:
        return f"{self.prefix}:started:{job}"

    def call(self, call_id: str) -> str:
        return f"{self.prefix}:call:{call_id}"

    def result(self, call_id: str) -> str:
        return f"{self.prefix}:result:{call_id}"

    def reply(self, gateway: str) -> str:
        return f"{self.prefix}:reply:{gateway}"

    def alive(self, worker: str) -> str:
        return f"{self.prefix}:alive:{worker}"

    def restored(self, worker: str) -> str:
        return f"{self.prefix}:restored:{worker}"

    def inbox(self, tag: str) -> str:
        return f"{self.prefix}:inbox:{tag}"

    def named(self, owner: str, session_id: str) -> str:
        return f"{self.prefix}:named:{owner}:{session_id}"


# --- the scripts ---------------------------------------------------------------------------------
# A key a call does not have (no client id) is passed as "" and skipped.

# KEYS: the jobs stream, then the call key per call. ARGV: max_queued, call_ttl_s, then (job,
# fingerprint, payload) per call. Answers per call: the new entry id; "fingerprint job entry" of the
# call a client id already names (attach to it); or "" when the queue is full.
_SUBMIT = """
local NONE = KEYS[1] .. ':no-id'
local depth = redis.call('XLEN', KEYS[1])
local maxq = tonumber(ARGV[1])
local out = {}
for c = 1, #KEYS - 1 do
  local call_key = KEYS[c + 1]
  local job, fp, payload = ARGV[3 * c], ARGV[3 * c + 1], ARGV[3 * c + 2]
  local prev = false
  if call_key ~= NONE then prev = redis.call('GET', call_key) end
  if prev then
    out[#out + 1] = prev
  elseif depth >= maxq then
    out[#out + 1] = ''
  else
    local entry = redis.call('XADD', KEYS[1], '*', 'k', job, 'job', payload)
    depth = depth + 1
    if call_key ~= NONE then redis.call('SET', call_key, fp .. ' ' .. job .. ' ' .. entry, 'EX', ARGV[2]) end
    out[#out + 1] = entry
  end
end
return out
"""

# KEYS: the jobs stream, then (started key, call key) per call. ARGV: group, marker_ttl_s, the
# cancelled marker, then the entry per call. A call is cancelled only if nobody marked it started:
# 1 per cancelled call, else 0.
_CANCEL = """
local NONE = KEYS[1] .. ':no-id'
local out = {}
for c = 1, (#KEYS - 1) / 2 do
  local entry = ARGV[3 + c]
  if redis.call('SET', KEYS[2 * c], ARGV[3], 'NX', 'EX', ARGV[2]) then
    redis.pcall('XACK', KEYS[1], ARGV[1], entry)
    redis.call('XDEL', KEYS[1], entry)
    if KEYS[2 * c + 1] ~= NONE then redis.call('DEL', KEYS[2 * c + 1]) end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: the jobs stream. ARGV: group, consumer, count, marker_ttl_s, the started keys' prefix.
# Claims up to `count` new entries and marks each started by this consumer, in one round trip: the
# worker claims only as many as it has free slots, so each goes to a slot at once. Answers (entry,
# payload, 1 if marked else 0) per entry; 0: someone else owns it or it was cancelled. The one
# script that names keys it is not given: which jobs it claims is known only inside it.
_CLAIM = """
local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
local out = {}
if not got then return out end
for _, e in ipairs(got[1][2]) do
  local fields = e[2]
  local marked = redis.call('SET', ARGV[5] .. fields[2], ARGV[2], 'NX', 'EX', ARGV[4])
  if marked then  -- tell the job's gateway who started it (its reply key leads the payload)
    local reply = string.match(fields[4], '^{"job":"[^"]*","reply":"([^"]*)"')
    if reply then redis.call('LPUSH', reply, fields[2] .. '\\n@' .. ARGV[2]) end
  end
  out[#out + 1] = e[1]
  out[#out + 1] = fields[4]
  out[#out + 1] = marked and 1 or 0
end
return out
"""

# KEYS: the job's started key, its gateway's reply list. ARGV: the worker, marker_ttl_s, the job.
# Marks the job started by the worker unless someone else had (1, else 0), and tells the gateway.
_MARK = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  redis.call('LPUSH', KEYS[2], ARGV[3] .. '\\n@' .. ARGV[1])
  return 1
end
return 0
"""

# KEYS: the jobs stream, then the started key per job. ARGV: group, consumer, then (entry, job,
# payload) per job that a stopping worker claimed and never ran. Each goes back to the stream as a
# new entry, unless someone else marked it meanwhile (a gateway cancelled it): the marker decides.
_HAND_BACK = """
local n = 0
for c = 1, #KEYS - 1 do
  local marker = KEYS[c + 1]
  local entry, job, payload = ARGV[3 * c], ARGV[3 * c + 1], ARGV[3 * c + 2]
  local owner = redis.call('GET', marker)
  if not owner or owner == ARGV[2] then
    redis.call('DEL', marker)
    redis.call('XADD', KEYS[1], '*', 'k', job, 'job', payload)
    n = n + 1
  end
  redis.pcall('XACK', KEYS[1], ARGV[1], entry)
  redis.call('XDEL', KEYS[1], entry)
end
return n
"""

# KEYS: the jobs stream, the gateway's reply list, the job's started key, then the call and result
# keys (Keys.none without a client id). ARGV: group, entry, job, result JSON, 1 if the call started else
# 0, results_ttl_s, reply_ttl_s, the done marker, done_ttl_s. Writes the result (and keeps it under
# the client id), acks and deletes the entry, and marks the job done, atomically.
_FINISH = """
local NONE = KEYS[1] .. ':no-id'
redis.call('LPUSH', KEYS[2], ARGV[3] .. '\\n' .. ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[7])
if KEYS[4] ~= NONE then
  redis.call('SET', KEYS[5], ARGV[4], 'EX', ARGV[6])
  if ARGV[5] == '0' then
    redis.call('DEL', KEYS[4])
  else
    redis.call('EXPIRE', KEYS[4], ARGV[6])  -- the id outlives its result
  end
end
redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[8], 'EX', ARGV[9])
return 1
"""


@dataclass(frozen=True, slots=True)
class NewCall:
    """A call a gateway writes to the stream."""

    job: str
    call_id: str | None
    fingerprint: str
    payload: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """An entry a worker claimed: its payload, and whether the claim marked it started."""

    entry: str
    payload: str
    marked: bool


class Scripts:
    """The contract's scripts, with typed arguments, on one Redis client."""

    def __init__(self, r: Redis, keys: Keys) -> None:
        self.keys = keys
        self._submit = r.register_script(_SUBMIT)
        self._cancel = r.register_script(_CANCEL)
        self._claim = r.register_script(_CLAIM)
        self._hand_back = r.register_script(_HAND_BACK)
        self._finish = r.register_script(_FINISH)
        self._mark = r.register_script(_MARK)

    async def submit(self, calls: list[NewCall], max_queued: int, call_ttl_s: int) -> list[str]:
        """Per call: its new entry id, "fingerprint job entry" of the call its id names, or "" (full)."""
        keys = [self.keys.jobs, *(self.keys.call(c.call_id) if c.call_id else self.keys.none for c in calls)]
        args: list[str | int] = [max_queued, call_ttl_s]
        for c in calls:
            args += [c.job, c.fingerprint, c.payload]
        return list(await self._submit(keys=keys, args=args))

    async def cancel(self, calls: list[tuple[str, str, str | None]], ttl_s: int) -> list[bool]:
        """Cancel (job, entry, client id) calls nobody started; per call, whether it was cancelled."""
        keys = [self.keys.jobs]
        for job, _, call_id in calls:
            keys += [self.keys.started(job), self.keys.call(call_id) if call_id else self.keys.none]
        args: list[str | int] = [GROUP, ttl_s, Marker.cancelled.value, *(entry for _, entry, _ in calls)]
        return [bool(done) for done in await self._cancel(keys=keys, args=args)]

    async def claim(self, consumer: str, count: int, marker_ttl_s: int) -> list[Claimed]:
        """Claim up to `count` new jobs, each marked started by `consumer` unless someone else had."""
        flat = await self._claim(keys=[self.keys.jobs],
                                 args=[GROUP, consumer, count, marker_ttl_s, self.keys.started("")])
        return [Claimed(flat[i], flat[i + 1], bool(flat[i + 2])) for i in range(0, len(flat), 3)]

    async def hand_back(self, consumer: str, jobs: list[tuple[str, str, str]]) -> int:
        """Put (entry, job, payload) jobs `consumer` claimed and never ran back in the stream."""
        keys = [self.keys.jobs, *(self.keys.started(job) for _, job, _ in jobs)]
        args: list[str] = [GROUP, consumer]
        for entry, job, payload in jobs:
            args += [entry, job, payload]
        return int(await self._hand_back(keys=keys, args=args))

    async def mark(self, job: str, reply: str, worker: str, marker_ttl_s: int) -> bool:
        """Mark a job started by `worker` unless someone else had; tell its gateway."""
        return bool(await self._mark(keys=[self.keys.started(job), reply], args=[worker, marker_ttl_s, job]))

    async def finish(self, entry: str, job: str, reply: str, call_id: str | None, result_json: str,
                     started: bool, results_ttl_s: int) -> None:
        """Write a job's result to its gateway (and under its client id), ack it, mark it done."""
        keys = [self.keys.jobs, reply, self.keys.started(job),
                self.keys.call(call_id) if call_id else self.keys.none,
                self.keys.result(call_id) if call_id else self.keys.none]
        await self._finish(keys=keys, args=[GROUP, entry, job, result_json, int(started), results_ttl_s,
                                            REPLY_TTL_S, Marker.done.value, DONE_TTL_S])


# --- connections, jobs, stats --------------------------------------------------------------------


def connect(settings: QueueSettings) -> Redis:
    """A client for the queue's Redis. No automatic retries: submit, cancel and claim must not be
    repeated blindly; the callers decide (a job key makes a repeated write harmless)."""
    assert settings.redis_url is not None
    return Redis.from_url(settings.redis_url, decode_responses=True, protocol=2,
                          socket_connect_timeout=5, socket_keepalive=True, health_check_interval=30)


def redacted(url: str | None) -> str:
    """The URL without its password, for logs."""
    if url is None or "@" not in url:
        return str(url)
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


async def ensure_group(r: Redis, keys: Keys) -> None:
    """Create the consumer group (and the stream) unless they exist; from entry 0, so that jobs
    added before the group (e.g. right after a Redis restart) are read too."""
    try:
        await r.xgroup_create(keys.jobs, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def encode_job(job: str, reply: str, call_id: str | None, request_json: str, accepted: float | None = None) -> str:
    """A stream entry: request JSON is embedded as encoded once, never re-encoded. `t` is when
    the gateway took the call (wall clock: workers on other hosts compare it with theirs)."""
    t = time.time() if accepted is None else accepted
    return (f'{{"job":{json.dumps(job)},"reply":{json.dumps(reply)},"t":{t:.6f},'
            f'"cid":{json.dumps(call_id)},"req":{request_json}}}')


@dataclass(frozen=True, slots=True)
class Job:
    """A stream entry's payload, as a worker reads it (see `encode_job`)."""

    key: str
    reply: str
    call_id: str | None
    enqueued: float
    request_json: Any

    @classmethod
    def decode(cls, payload: str) -> Job:
        """Raises ValueError, KeyError or TypeError for a malformed payload."""
        data = json.loads(payload)
        return cls(data["job"], data["reply"], data.get("cid"), float(data["t"]), data["req"])


def worker_stats(slots: int, free: int, restarts: int, calls: int, tag: str = "", sessions: int = 0,
                 session_room: int = 0, **figures: float) -> str:
    """A worker's stats as it reports them in its heartbeat and the workers hash: `tag` names its
    inbox; `session_room` is how many more sessions it takes now (0 while it drains); `figures` are
    the rest of its figures (`SlotPool.figures`: safety counters, memory, session counters)."""
    return json.dumps({"slots": slots, "free": free, "restarts": restarts, "calls": calls, "tag": tag,
                       "sessions": sessions, "session_room": session_room, **figures,
                       "host": socket.gethostname(), "pid": os.getpid()})
