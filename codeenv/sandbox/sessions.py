"""Live sessions: interpreters that keep their state from cell to cell, roll back, and branch.

A session lives in a *family* (the session and its forks). Each family is a fork of its profile's
session zygote, in a session jail (`jail.session_jail_config`): PID 1 of its own pid, mount, network
and IPC namespaces, with its own host uid, its own work dir (a tmpfs only it can see) and its own
cgroup (pids, CPU; and one per session below it, memory), set up before any of its code runs (see
sandbox/inside/sessions.py; the family's socket is outside/families.py). So one family cannot see,
signal, trace, read, connect to or leave anything for another, nor for a call: calls run in other
jails, under other uids.
Within a family, each fork is in a Landlock domain of its own: it reaches no process but its own.

The worker owns every limit and lifetime: per-cell limits (the family's cgroup, its CPU clock read
here, the supervisor's wall clock with this worker's behind it), a per-session memory cap, a
per-family pids cap,
an idle TTL and a maximum lifetime, a maximum number of sessions, and eviction of the least
recently used idle family when available memory runs low. When a family ends, its supervisor is
killed (and with it, by the kernel, every process of its pid namespace), its cgroup removed and its
uid freed; its work dir was a mount of its own namespace, so nothing of it remains.

Session ids carry this worker's epoch and a MAC under a key kept in the state dir: an id that never
existed is told apart from one that ended (expired, evicted, or issued before the worker restarted).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import re
import secrets
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from codeenv.admission import admit, resolve_limits
from codeenv.errors import (
    InvalidRequest,
    SandboxError,
    SessionError,
    SessionErrorKind,
    session_lost,
    session_not_found,
)
from codeenv.models import ExecRequest, ExecResult, HostFunctions, Limits, LimitValues, Refusal, Status, printable
from codeenv.sandbox import session_forks
from codeenv.sandbox.budget import PID_MAX
from codeenv.sandbox.cgroups import CgroupTree, JailCgroup
from codeenv.sandbox.host_functions import CellCalls, HostSession, check_urls, host_client
from codeenv.sandbox.image import Image, Profile
from codeenv.sandbox.inside.protocol import REPORT_BYTES
from codeenv.sandbox.jail import family_filter_hex
from codeenv.sandbox.outside.call_io import CallFiles, Exited, Outcome, collect
from codeenv.sandbox.outside.families import CellRun, SessionJail
from codeenv.sandbox.outside.family import SESSION, Family, Session, pidfd_pid
from codeenv.sandbox.outside.process import host_pid, write_oom_score
from codeenv.sandbox.sizing import families_socket_memory_limit, meminfo_bytes, socket_memory_limit
from codeenv.sandbox.uids import in_user_namespace
from codeenv.sandbox.verdict import classify
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: How often idle sessions are checked against their TTL and lifetime.
REAP_EVERY_S = 1.0
#: Ended session ids remembered (beyond it, an id of this epoch that is not live still reads as ended).
ENDED_KEPT = 100_000
#: Cells whose results are kept per session for retried cell ids.
CELL_IDS_KEPT = 64
#: Processes a family's supervisor and idle sessions need on top of a cell's own.
FAMILY_PIDS = 4
#: Processes in a new session's group: its process, and a fork's while it is made (from its first
#: cell on: the tasks it holds and the cell's limit).
SESSION_PIDS = 2
#: The cgroup (below the worker's subtree) that holds every family's group: familyN, and below it
#: main (its supervisor) and sN (session N's process and its cells').
FAMILIES_GROUP = "families"
#: Cells that run at once, per slot (more wait their turn): what bounds the fds and CPU that running
#: cells take besides their families' idle share.
CELLS_PER_SLOT = 4


def cells_at_once(slots: int) -> int:
    """How many cells of all sessions may run at once on a worker with `slots` slots."""
    return max(8, CELLS_PER_SLOT * slots)
#: What `_new_id` makes: epoch and counter in hex, then the MAC (18 bytes, URL-safe base64). Anything
#: else (another alphabet, non-ASCII digits that int() would take, a longer number) never existed.
SESSION_ID = re.compile(r"([0-9a-f]{1,16})\.([0-9a-f]{1,16})\.([A-Za-z0-9_-]{24})", re.ASCII)


def _alias_key(owner: bytes, alias: str) -> str:
    """Where an ended session known by an id its owner chose is remembered (beside the ids made)."""
    return f"{owner.hex()}/{alias}"


def _mem_available() -> int:
    available = meminfo_bytes("MemAvailable")
    return 1 << 62 if available is None else available


class SessionManager:
    """The sessions of one worker: families in session jails, one jail per profile, started on demand."""

    def __init__(self, settings: SandboxSettings, image: Image, tree: CgroupTree, root_uid: int, family_uid: int,
                 nsjail: Path, runtime_dir: Path, zygote_dir: Path, worker: str,
                 finish: Callable[[ExecRequest, ExecResult, Profile], ExecResult], *,
                 sessions_max: int | None = None, cells_at_once: int = 16) -> None:
        """`sessions_max`: the most it holds (default: the setting; the pool passes what the host allows)."""
        self.settings = settings
        self.image = image
        self.tree = tree
        self.root_uid = root_uid
        self.family_uid = family_uid
        self.nsjail = nsjail
        self.runtime_dir = runtime_dir
        self.zygote_dir = zygote_dir
        self.worker = worker
        self._finish = finish
        self.jails: dict[str, SessionJail] = {}
        self._jail_lock = asyncio.Lock()
        self.sessions: dict[str, Session] = {}
        self.families: dict[int, Family] = {}
        self._fids = itertools.count(1)
        self.sessions_max = settings.sessions_max if sessions_max is None else sessions_max
        self.client_max = min(settings.session_client_max or self.sessions_max, self.sessions_max)
        self._cells = asyncio.Semaphore(cells_at_once)
        self._free_uids = collections.deque(range(self.sessions_max))
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.epoch = time.time_ns() // 1_000_000
        self._counter = itertools.count(1)
        self._aliases: dict[tuple[bytes, str], str] = {}  # (owner, the id it chose) -> the session's id
        self._key = _session_key(settings.state_dir)
        self._reaper: asyncio.Task[None] | None = None
        self._spares: dict[str, asyncio.Task[Family]] = {}
        # A session's process has the score it was born with (the worker's); a kept cell, which
        # becomes the session, had 1000 while it ran, and gets this one back when the next cell starts.
        self._session_oom_score = _own_oom_score()
        self._closing = False
        self._http: httpx.AsyncClient | None = None  # host function calls' (made at the first)
        self.id_prefix = ""  # before the ids it makes, in the ids clients know (a Redis worker's tag and a dot)
        self._families: JailCgroup | None = None
        #: Counters since start: cells run, sessions lost (their processes, mid-cell or idle) and
        #: evicted (memory), for the worker's figures.
        self.counts: collections.Counter[str] = collections.Counter()
        #: When forks were last moved into their cgroups (see session_forks.py).
        self.moved = 0.0

    # --- ids ------------------------------------------------------------------------------------

    def _mac(self, epoch: int, counter: int, owner: bytes) -> str:
        digest = hmac.new(self._key, f"{epoch:x}.{counter:x}.".encode() + owner, hashlib.sha256).digest()[:18]
        return base64.urlsafe_b64encode(digest).decode()

    def _new_id(self, owner: bytes) -> str:
        counter = next(self._counter)
        return f"{self.epoch:x}.{counter:x}.{self._mac(self.epoch, counter, owner)}"

    def lookup(self, session_id: str, owner: bytes = b"", kind: str = SESSION) -> Session:
        """The live session (or, with `kind` SNAPSHOT, snapshot) `session_id` of `owner` (the hash of its
        creator's key); SessionError not_found if it never existed, is another owner's (the same answer)
        or of the other kind, ended if it ended. The id's MAC covers the owner, so that even an ended
        session's id tells another owner nothing."""
        session = self.sessions.get(session_id)
        if session is not None and hmac.compare_digest(session.owner, owner):
            if session.kind != kind:
                raise session_not_found(session_id)
            return session
        named = self._aliases.get((owner, session_id))
        if named:
            session = self.sessions.get(named)
            if session is not None:
                return session
        why = self._ended.get(_alias_key(owner, session_id))
        if why is not None:
            raise session_lost(session_id, why)
        shape = SESSION_ID.fullmatch(session_id)
        if shape is not None:
            epoch, counter = int(shape[1], 16), int(shape[2], 16)
            if hmac.compare_digest(shape[3].encode(), self._mac(epoch, counter, owner).encode()):
                why = self._ended.get(session_id)
                if why is None:
                    why = "its worker restarted" if epoch != self.epoch else "it ended"
                raise session_lost(session_id, why)
        raise session_not_found(session_id)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap(), name="codeenv-sessions")

    async def close(self) -> None:
        self._closing = True
        for spare in self._spares.values():
            spare.cancel()
        await asyncio.gather(*self._spares.values(), return_exceptions=True)
        self._spares.clear()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        families = list(self.families.values())
        await asyncio.gather(*(self._end_family(f, "the worker is shutting down") for f in families),
                             return_exceptions=True)
        for jail in self.jails.values():
            await jail.stop()
            await asyncio.to_thread(jail.cgroup.remove)
        self.jails = {}
        if self._families is not None:
            await asyncio.to_thread(self._families.remove)
            self._families = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _jail(self, profile: Profile) -> SessionJail:
        async with self._jail_lock:
            jail = self.jails.get(profile.name)
            if jail is not None and not jail.dead:
                return jail
            if jail is not None:  # its zygote died: its families are gone with it
                for family in [f for f in self.families.values() if f.jail is jail]:
                    await self._end_family(family, "its worker's session jail restarted")
                await jail.stop()
            index = [p.name for p in self.image.spec.profiles].index(profile.name)
            jail = SessionJail(self.settings, self.image, profile, self.root_uid + index, self.family_uid,
                               self.sessions_max, self.tree.group(f"sessions-{profile.name}"), self.nsjail,
                               self.runtime_dir, self.zygote_dir)
            await jail.start()
            self.jails[profile.name] = jail
            return jail

    def _profile(self, name: str | None) -> Profile:
        if name is None:
            names = [p.name for p in self.image.spec.profiles]
            fallback = self.settings.session_profile if self.settings.session_profile in names else names[-1]
            return self.image.profile(fallback)
        try:
            return self.image.profile(name)
        except Exception as exc:
            raise InvalidRequest(str(exc)) from None

    async def create(self, profile_name: str | None = None, limits: Limits | None = None,
                     idle_ttl_s: float | None = None, owner: bytes = b"", alias: str | None = None,
                     host: HostFunctions | None = None) -> Session:
        """A new session (and family) of `owner` (the hash of its creator's key), known as `alias` (an
        id its creator chose: for this owner only) when given, with `host` functions. InvalidRequest
        for a bad profile, limits or host function URL; SessionError (full) when the worker holds as
        many as it may (or is short of memory with every session busy); (conflict) when `owner` has a
        live session known as `alias`."""
        s = self.settings
        if self.sessions_max == 0:
            raise SessionError("this worker runs no sessions (CODEENV_SESSIONS_MAX=0, or none fit this host)",
                               SessionErrorKind.unsupported)
        if not family_filter_hex(s):
            # The session jail's policy allows the calls that set a family up; the family's own filter
            # is what keeps them from its code, and there is none without the allowlist.
            raise SessionError("sessions need the seccomp allowlist (CODEENV_SECCOMP=allowlist) on x86_64 or "
                               "aarch64", SessionErrorKind.unsupported)
        if self.tree.version == 1 and in_user_namespace():
            # A family's processes run as its own uid, and v1 lets only the host's root move another
            # uid's process between cgroups: without its cgroup a family would run uncapped.
            raise SessionError("sessions need cgroup v2 when the worker runs in a user namespace (a Kubernetes "
                               "pod with hostUsers: false): on cgroup v1 only the host's root may move a "
                               "session's processes into their cgroups", SessionErrorKind.unsupported)
        profile = self._profile(profile_name)
        limits = limits or Limits()
        resolve_limits(limits, s.defaults, s.caps)  # LimitExceedsCap now, not at its first cell
        if host is not None:
            check_urls(host, s.host_function_urls)
        self._admit(owner)
        named = (owner, alias) if alias is not None else None
        if named is not None:
            if named in self._aliases:
                raise SessionError(f"you have a live session {alias!r} already: delete it, or choose another id",
                                   SessionErrorKind.conflict)
            self._aliases[named] = ""  # taken while the session starts
        try:
            await self._make_room(owner)
            family = await self._take_spare(profile)
            if family is None:
                family = await self._start_family(profile)
        except BaseException:
            if named is not None:
                self._aliases.pop(named, None)
            raise
        self._refill(profile)
        session = Session(self._new_id(owner), 0, family, owner, profile.name, idle_ttl_s or s.session_idle_ttl_s,
                          limits, alias=alias, host=HostSession(host) if host is not None else None)
        logger.debug("session family %d started (%s)", family.fid, profile.name)  # ids are secrets: never logged
        family.sessions[0] = session
        self.sessions[session.id] = session
        self.counts["sessions_created"] += 1
        if named is not None:
            self._aliases[named] = session.id
            self._ended.pop(_alias_key(owner, session.public_id), None)
        return session

    def _admit(self, owner: bytes, count: int = 1) -> None:
        """SessionError (full) when the worker, or this client (`owner`), has no room for `count` more
        sessions (snapshots count: each holds a process, a cgroup and its memory)."""
        if len(self.sessions) + count > self.sessions_max:
            more = "" if count == 1 else f" and has no room for {count} more"
            raise SessionError(f"this worker holds {len(self.sessions)} sessions and snapshots{more}, its most "
                               "(CODEENV_SESSIONS_MAX, held to what the host allows); end some, or retry later",
                               SessionErrorKind.full)
        if self.client_max < self.sessions_max:
            mine = sum(1 for session in self.sessions.values() if session.owner == owner)
            if mine + count > self.client_max:
                raise SessionError(f"you hold {mine} sessions on this worker, the most one client may "
                                   "(CODEENV_SESSION_CLIENT_MAX); end some, or retry later", SessionErrorKind.full)

    def _families_group(self) -> JailCgroup:
        """The common parent group of every family of this worker (made with the first family): its
        caps bound all families together. Running cells take at most `session_cpu_share` of the
        host's CPUs, and are sure of that share while calls want the rest (its weight against the
        slots' groups); families hold at most `session_memory_share` of the host's memory, and half
        its pids; its socket buffer cap bounds their sockets."""
        if self._families is None:
            s = self.settings
            self._families = self.tree.group(FAMILIES_GROUP)
            self._families.delegate()
            self._families.set_pids_max(int(PID_MAX.read_text()) // 2)
            self._families.set_cpu_limit(s.session_cpu_share * len(os.sched_getaffinity(0)))
            # Each busy slot's group weighs the default: cells weigh share / (1 - share) of all slots.
            self._families.set_cpu_weight(s.slots * s.session_cpu_share / max(1 - s.session_cpu_share, 1e-3))
            total = meminfo_bytes("MemTotal")
            if total is not None:
                self._families.set_memory_limit(int(total * s.session_memory_share))
            if not self._families.set_socket_memory_limit(families_socket_memory_limit(self.settings)):
                logger.debug("this kernel cannot cap session families' socket buffers on cgroup v1")
            self._families.close_files()
        return self._families

    async def _take_spare(self, profile: Profile) -> Family | None:
        """The family made ahead of demand for `profile`, if it is (or becomes) ready and alive."""
        task = self._spares.pop(profile.name, None)
        if task is None:
            return None
        try:
            family = await asyncio.shield(task)
        except Exception:  # it failed: the caller starts one itself, and says why if that fails too
            return None
        return family if family.ended is None and not family.sessions else None

    def _refill(self, profile: Profile) -> None:
        """Start the next family of `profile` ahead of demand (a session's creation then only takes it)."""
        if not self.settings.session_spares or profile.name in self._spares or self._closing:
            return
        if len(self._free_uids) <= 1 or len(self.sessions) + 1 >= self.sessions_max:
            return  # the last uid is for a session asked for, not a spare
        task = asyncio.create_task(self._start_family(profile), name=f"codeenv-spare-{profile.name}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures: see _take_spare
        self._spares[profile.name] = task

    async def _start_family(self, profile: Profile) -> Family:
        s = self.settings
        if not self._free_uids:
            raise SessionError(f"this worker holds {len(self.families)} session families, its most "
                               "(CODEENV_SESSIONS_MAX); end some, or retry later", SessionErrorKind.full)
        uid_index = self._free_uids.popleft()
        fid = next(self._fids)
        groups: list[JailCgroup] = []
        try:
            jail = await self._jail(profile)
            parent = self._families_group()
            groups.append(cgroup := self.tree.group(f"{parent.name}/family{fid}"))
            memory_cap = s.session_memory_mb << 20
            cgroup.set_pids_max(FAMILY_PIDS + s.session_forks_max + s.caps.processes * 2)
            cgroup.set_cpu_limit(s.cpus_per_call)
            cgroup.delegate()
            groups += [self.tree.group(f"{cgroup.name}/main"), self._session_group(cgroup, 0, memory_cap)]
            # Before the family's first process, so before its first socket (cgroup v1 charges a
            # socket to its creator's group only if that group has a TCP limit, and to nothing
            # otherwise): the family's cap, which counts in the families' common one. (s0 set its own.)
            for group in groups[:2]:
                group.set_socket_memory_limit(socket_memory_limit(s))
            sock, pidfd = await jail.create(fid, uid_index)
        except BaseException:
            for group in reversed(groups):
                await asyncio.to_thread(group.remove)
            self._free_uids.append(uid_index)
            raise
        family = Family(fid, uid_index, jail, sock, pidfd, cgroup, groups[1], {0: groups[2]}, memory_cap)
        self.families[fid] = family
        try:
            supervisor = pidfd_pid(pidfd)
            family.move([supervisor], family.main)
            first = await self._ask(family, family.channel.go(s.control_timeout_s + s.zygote_start_timeout_s / 10))
            family.move([self._found(family.main, first)], family.groups[0])
            # After its first session's fork (which would inherit it): the OOM killer never takes
            # the supervisor, whose death would end every session of the family.
            write_oom_score(supervisor, b"-1000")
            family.close_files()
        except BaseException as exc:
            await self._end_family(family, f"it could not start: {exc!r}")
            if isinstance(exc, Exception) and not isinstance(exc, (SessionError, SandboxError)):
                raise SandboxError(f"a session could not start: {exc!r}") from exc
            raise
        return family

    def _session_group(self, family_group: JailCgroup, index: int, memory_cap: int) -> JailCgroup:
        """Session `index`'s group below its family's: its own memory cap, and pids for its process and
        a fork's while it is made (a cell's limits replace them while it runs)."""
        group = self.tree.group(f"{family_group.name}/s{index}")
        try:
            group.set_memory_limit(memory_cap)
            group.set_pids_max(SESSION_PIDS)
            # Before its first process, so before its first socket (cgroup v1 charges a socket to its
            # creator's group only if that group has a TCP limit, and to nothing otherwise).
            group.set_socket_memory_limit(socket_memory_limit(self.settings))
        except BaseException:
            group.remove()
            raise
        return group

    @staticmethod
    def _found(group: JailCgroup, ns_pid: int) -> int:
        """The pid here of the session process the supervisor named (`ns_pid`), which is in `group`."""
        pid = host_pid(group.procs(), ns_pid)
        if pid is None:
            raise SandboxError(f"the session process {ns_pid} of the family is not in its group {group.name}")
        return pid

    async def _ask[T](self, family: Family, request: Awaitable[T]) -> T:
        """A request to the family's supervisor (FamilyChannel) and its reply; SessionError 410 if
        the supervisor is gone."""
        try:
            return await request
        except (OSError, TimeoutError) as exc:
            await self._end_family(family, "its processes were lost")
            raise SessionError(f"the session has ended: its processes were lost ({exc})",
                               SessionErrorKind.ended) from None

    async def _end_family(self, family: Family, why: str) -> None:
        if family.ended is not None:
            return
        family.ended = why
        for session in family.sessions.values():
            self._forget(session, why)
        family.sessions.clear()
        self.families.pop(family.fid, None)
        # Shut down, not closed yet: whoever waits on the socket (a cell, a fork) reads its end now,
        # and the fd stays ours until then. The supervisor reads EOF too; its SIGKILL ends its whole
        # pid namespace.
        with contextlib.suppress(OSError):
            family.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(family.pidfd, signal.SIGKILL)
        await family.jail.end(family.fid)
        family.sock.close()
        os.close(family.pidfd)
        await asyncio.to_thread(family.remove_cgroups)  # kills what is left, then removes the groups
        self._free_uids.append(family.uid_index)

    def _forget(self, session: Session, why: str) -> None:
        self.sessions.pop(session.id, None)
        self._ended[session.id] = why
        if session.alias is not None:
            self._aliases.pop((session.owner, session.alias), None)
            self._ended[_alias_key(session.owner, session.alias)] = why
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        for fut in session.cell_ids.values():
            if not fut.done():
                fut.cancel()

    async def delete(self, session_id: str, owner: bytes = b"", kind: str = SESSION) -> None:
        session = self.lookup(session_id, owner, kind)
        await self._close(session, "it was deleted")

    async def _close(self, session: Session, why: str) -> None:
        family = session.family
        if len(family.sessions) <= 1:
            await self._end_family(family, why)
            return
        async with family.lock:
            if family.ended is not None or family.sessions.get(session.index) is not session:
                return
            del family.sessions[session.index]
            self._forget(session, why)
            with contextlib.suppress(SessionError):
                await self._ask(family, family.channel.close(
                    session.index, self.settings.control_timeout_s + self.settings.cleanup_timeout_s))
            await self._drop_group(family, session.index)

    @staticmethod
    async def _drop_group(family: Family, index: int) -> None:
        """Remove a session's group once it left the family (kills whatever of it is left)."""
        group = family.groups.pop(index, None)
        if group is not None:
            await asyncio.to_thread(group.remove)

    async def fork(self, session_id: str, owner: bytes = b"") -> Session:
        """A new session in the same family (and of the same owner), from this one's state (after its
        running cell, if any)."""
        [child] = await self.forks(session_id, owner)
        return child

    async def forks(self, session_id: str, owner: bytes = b"", count: int = 1, kind: str = SESSION) -> list[Session]:
        """`count` new sessions in the same family (and of the same owner), each from the state of session
        `session_id` (after its running cell, if any), or of snapshot `session_id` with `kind` SNAPSHOT."""
        return await session_forks.branch(self, self.lookup(session_id, owner, kind), count)

    async def snapshot(self, session_id: str, owner: bytes = b"", ttl_s: float | None = None) -> Session:
        """A snapshot of session `session_id` (after its running cell, if any): a fork that runs no cell and
        holds its work dir in its memory, forkable until `ttl_s` (default: the setting) has passed, after
        the session ended too."""
        ttl = min(ttl_s or self.settings.snapshot_ttl_s, self.settings.session_max_lifetime_s)
        [snapshot] = await session_forks.branch(self, self.lookup(session_id, owner), 1, ttl)
        return snapshot

    async def _make_room(self, owner: bytes) -> None:
        """Evict least recently used idle families of `owner` (the client that needs room, never
        another's) while available memory is below the floor."""
        floor = self.settings.session_min_available_mb << 20
        while _mem_available() < floor:
            idle = [f for f in self.families.values()
                    if not f.lock.locked() and f.sessions and all(s.busy == 0 and s.owner == owner
                                                                  for s in f.sessions.values())]
            if not idle:
                raise SessionError("the worker is short of memory and none of your sessions is idle to make "
                                   "room; retry later", SessionErrorKind.full)
            victim = min(idle, key=lambda f: f.last_used)
            logger.info("evicting session family %d (idle %.0fs): memory is low", victim.fid,
                        time.monotonic() - victim.last_used)
            self.counts["sessions_evicted"] += len(victim.sessions)
            await self._end_family(victim, "it was evicted: the worker ran short of memory")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_EVERY_S)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if session.busy:
                    continue
                if session.expires is not None:
                    if now < session.expires:
                        continue
                    why = "its TTL ran out"
                elif now - session.last_used > session.idle_ttl_s:
                    why = f"it was idle for more than {session.idle_ttl_s:g}s"
                elif now - session.created > self.settings.session_max_lifetime_s:
                    why = f"it reached the maximum lifetime of {self.settings.session_max_lifetime_s:g}s"
                else:
                    continue
                with contextlib.suppress(Exception):
                    await self._close(session, why)
            for family in list(self.families.values()):
                if family.ended is None and not family.lock.locked() and _exited(family.pidfd):
                    self.counts["sessions_lost"] += len(family.sessions)
                    await self._end_family(family, "its processes were lost")

    # --- cells ----------------------------------------------------------------------------------

    async def execute(self, request: ExecRequest, queued: float) -> ExecResult:
        """Run `request` as the next cell of its session. An unknown session is answered `rejected`,
        one that ended `session_lost`, a worker without room `overloaded`."""
        try:
            return await self._execute(request, queued)
        except SessionError as exc:
            status = {SessionErrorKind.ended: Status.session_lost, SessionErrorKind.full: Status.overloaded}.get(
                exc.kind, Status.rejected)
            refusal = None if status is not Status.rejected else \
                Refusal.no_session if exc.kind is SessionErrorKind.not_found else Refusal.invalid
            return self._finish(request, ExecResult(status=status, refusal=refusal, started=False, message=str(exc),
                                                    session=request.session), self.image.spec.profiles[-1])

    async def _execute(self, request: ExecRequest, queued: float) -> ExecResult:
        assert request.session is not None
        session = self.lookup(request.session, request._owner)
        if session.limits != Limits():
            merged = {**session.limits.model_dump(exclude_none=True), **request.limits.model_dump(exclude_none=True)}
            request = request.model_copy(update={"limits": Limits(**merged)})
        profile = self.image.profile(session.profile)
        # Before the cell_id is registered: a refused cell never ran, and a retry must not wait for it.
        admitted = admit(request, self.settings)
        if request.cell_id is not None:
            earlier = session.cell_ids.get(request.cell_id)
            if earlier is not None:
                return (await asyncio.shield(earlier)).model_copy(update={"id": request.id})
            fut: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
            session.cell_ids[request.cell_id] = fut
            while len(session.cell_ids) > CELL_IDS_KEPT:
                session.cell_ids.popitem(last=False)
        session.busy += 1
        try:
            async with session.family.lock:
                if session.family.ended is not None or self.sessions.get(session.id) is not session:
                    raise session_lost(session.public_id, self._ended.get(session.id, "it ended"))
                queue_s = time.monotonic() - queued
                session.cells += 1
                try:
                    async with self._cells:  # so many at once, whatever the number of sessions
                        result = await self._cell(session, admitted.code, admitted.stdin, admitted.limits)
                finally:
                    session.family.close_files()
        except BaseException as exc:
            if request.cell_id is not None:
                fut = session.cell_ids.pop(request.cell_id)
                if isinstance(exc, SessionError):
                    fut.set_exception(exc)
                    fut.exception()  # retrieved: nobody else may wait for it
                else:
                    fut.cancel()
            raise
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()
        self.counts["cells"] += 1
        session.cpu_s += result.cpu_s
        result.session = session.public_id
        result.execution_count = session.cells
        result = self._finish(request, result, profile)
        result.queue_s = round(queue_s, 6)
        result.worker = f"{self.worker}/sessions"
        if request.cell_id is not None:
            session.cell_ids[request.cell_id].set_result(result)
        return result

    async def _cell(self, session: Session, code: bytes, stdin: bytes, limits: LimitValues) -> ExecResult:
        family = session.family
        cg, group = family.cgroup, family.groups[session.index]
        out = Outcome(started=True)
        # The cell's process is forked in the session's group, which holds what the session kept of
        # its earlier cells (and only that: a fork's pages shared with its parent stay its parent's):
        # the cell's memory limit counts from it, and the session's own cap bounds both. It is set
        # once the cell's process exists (its fork, under the session's cap, counts in it) and before
        # it runs a line; the OOM killer then takes the cell's processes first.
        usage0 = group.memory_usage()
        group.set_pids_max(group.pids_current() + limits.processes)  # on top of the session's threads
        group.reset_peak()
        oom0, pids0, family_oom0 = group.oom_kills(), group.pids_limit_hits(), cg.oom_kills()
        cpu0 = cg.cpu_usage_ns()
        before = set(group.procs())  # the session's process

        def started() -> None:
            with contextlib.suppress(OSError, ValueError):
                for pid in set(group.procs()) - before:  # the cell's go first, before the pre-cell process
                    write_oom_score(pid, b"1000")
                for pid in before:  # which is a kept cell's (1000) after one: it would go as soon
                    write_oom_score(pid, self._session_oom_score)
            try:
                group.set_memory_limit(min(family.memory_cap, usage0 + (limits.memory_mb << 20)))
            except OSError:  # cgroup v1 refuses a limit below what the group holds: the fork took more
                out.oom_killed = True
                over()  # the pre-cell process must not meet a half-set limit (memory, not memsw)
                family.channel.kill()

        def over() -> None:  # the session's own cap again, before its pre-cell process resumes
            with contextlib.suppress(OSError, ValueError):
                group.set_memory_limit(family.memory_cap)

        def overflow() -> None:
            out.output_overflow = True
            family.channel.kill()

        calls = None
        if session.host is not None:
            known_as = session.public_id if session.alias is not None else self.id_prefix + session.id
            self._http = self._http or host_client()
            calls = CellCalls(session.host, known_as, session.cells, self._http, family.channel.send)
        with CallFiles(code, stdin, None, None, 0, REPORT_BYTES) as call:
            try:
                family.channel.send_cell(session.index, session.cells, limits, call,
                                         session.host.cell_message() if session.host is not None else None)
            except OSError:
                call.close_theirs()
                await self._end_family(family, "its processes were lost")
                raise session_lost(session.public_id, "its processes were lost") from None
            call.close_theirs()
            t0 = time.monotonic()
            drains = call.drain(asyncio.get_running_loop(), limits.output_bytes, overflow)
            budget = limits.wall_s + self.settings.kill_grace_s + self.settings.control_timeout_s
            try:
                run = await family.channel.watch_cell(budget, int(limits.cpu_s * 1e9), cpu0, cg, started, over,
                                                      calls.take if calls is not None else None)
            finally:  # before any other await: no call is answered after the cell (nor outlives it)
                if calls is not None:
                    calls.close()
            out.wall_s = time.monotonic() - t0
            await collect(out, call, drains, REPORT_BYTES, self.settings.control_timeout_s)
        with contextlib.suppress(OSError, ValueError):
            out.oom_killed = out.oom_killed or group.oom_kills() > oom0 or cg.oom_kills() > family_oom0
            out.pids_limit_hit = group.pids_limit_hits() > pids0
            peak = group.memory_peak()
            if peak is not None:
                out.memory_peak_kb = max(0, peak - usage0) >> 10
        over()  # between cells: the session's own cap
        cpu1 = None
        with contextlib.suppress(OSError, ValueError):  # a family ended meanwhile (deleted) has no group
            cpu1 = cg.cpu_usage_ns()
        cpu_s = (cpu1 - cpu0) / 1e9 if cpu0 is not None and cpu1 is not None else 0.0
        result = await self._cell_result(session, out, run, cpu_s, limits)
        if calls is not None:
            calls.report(result, run.done.host_refused if run.done is not None else 0)
        return result

    async def _cell_result(self, session: Session, out: Outcome, run: CellRun, cpu_s: float,
                           limits: LimitValues) -> ExecResult:
        """A cell's result from what was observed; a session that cannot go on ends here."""
        family = session.family
        done = run.done
        if done is None or done.lost:
            why = "the cell outlived its limits and its session could not be rolled back" if done is None \
                else "its process ended during the cell and there was nothing to roll back to"
            self.counts["sessions_lost"] += 1 if done is not None else len(family.sessions)
            if done is None or len(family.sessions) <= 1:
                await self._end_family(family, why)
            else:  # its forks live on in the family
                family.sessions.pop(session.index, None)
                self._forget(session, why)
                await self._drop_group(family, session.index)
            result = classify(out, limits)
            result.status, result.message = Status.session_lost, f"the session has ended: {why}"
            return result
        wall_s = done.wall_s if done.wall_s is not None else out.wall_s
        if run.cpu_exceeded:
            out.exited = Exited(wait_status=signal.SIGKILL, wall_s=wall_s, cpu_s=max(cpu_s, limits.cpu_s))
        else:
            out.exited = Exited(wait_status=done.wait_status_as_kept, wall_s=wall_s, cpu_s=cpu_s,
                                timed_out=done.timed_out, killed=done.killed)
        result = classify(out, limits)
        if out.exited.killed and not out.output_overflow and not run.cpu_exceeded:
            result.message = "the cell was stopped by the service"
        result.rolled_back = not done.kept
        if not done.kept:
            self.counts["rollbacks"] += 1
            result.written_files = [printable(p[:500]) for p in done.written]
            result.not_restored = [printable(p[:300]) for p in done.unrestored]
        return result

    # --- views ----------------------------------------------------------------------------------

    def figures(self, taking: bool = True) -> dict[str, float]:
        """Its sessions and room for more (none unless `taking`: a stopping worker takes none), its
        counters since start and its families' memory now, for the worker's figures."""
        memory = 0
        with contextlib.suppress(OSError, ValueError):
            memory = self._families.memory_usage() if self._families is not None else 0
        room = max(0, self.sessions_max - len(self.sessions)) if taking else 0
        counts = self.counts
        return {"sessions": len(self.sessions), "session_room": room, "cells": counts["cells"],
                "sessions_created": counts["sessions_created"], "rollbacks": counts["rollbacks"],
                "sessions_lost": counts["sessions_lost"], "sessions_evicted": counts["sessions_evicted"],
                "session_memory_bytes": memory}

    def describe(self, owner: bytes = b"") -> list[dict[str, Any]]:
        """The live sessions of `owner`, and no one else's."""
        return [s.describe(self.worker) for s in self.sessions.values() if hmac.compare_digest(s.owner, owner)]


def _exited(pidfd: int) -> bool:
    import select

    return bool(select.select([pidfd], [], [], 0)[0])


def _own_oom_score() -> bytes:
    """This process's oom_score_adj (what its jails' processes inherit)."""
    try:
        with open("/proc/self/oom_score_adj", "rb") as f:
            return f.read().strip() or b"0"
    except OSError:
        return b"0"


def _session_key(state_dir: Path) -> bytes:
    """The key of this host's session ids (kept across restarts, so old ids read as ended)."""
    path = state_dir / "session.key"
    with contextlib.suppress(FileNotFoundError):
        key = path.read_bytes()
        if len(key) >= 32:
            return key
    key = secrets.token_bytes(32)
    with contextlib.suppress(OSError):
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
    return key

