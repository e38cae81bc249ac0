"""A session's forks and snapshots, made for its SessionManager (`branch`): N at once, all or none.

The forks' groups are made in a thread while the family's supervisor has the session's process fork
them (one after the other, while the first ones set themselves up); then each fork's process, born in
its parent's group, is moved into its own. A snapshot is such a fork that runs no cell and holds its
work dir in its memory (see sandbox/inside/sessions.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Protocol

from codeenv.errors import InvalidRequest, SandboxError, SessionError, SessionErrorKind, session_lost
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.outside.family import SNAPSHOT, Family, Session
from codeenv.sandbox.outside.process import host_pids
from codeenv.settings import SandboxSettings

logger = logging.getLogger("codeenv.sandbox.sessions")


class SessionManager(Protocol):
    """What of the SessionManager (sandbox/sessions.py) its forks need: its own steps, used here."""

    settings: SandboxSettings
    sessions: dict[str, Session]
    moved: float  # when forks were last moved into their cgroups
    counts: collections.Counter[str]  # the worker's session counters

    def _admit(self, owner: bytes, count: int = 1) -> None: ...
    def _new_id(self, owner: bytes) -> str: ...
    def _session_group(self, family_group: JailCgroup, index: int, memory_cap: int) -> JailCgroup: ...
    async def _ask[T](self, family: Family, request: Awaitable[T]) -> T: ...
    async def _end_family(self, family: Family, why: str) -> None: ...


#: Forks made this long after the last ones warm the kernel's cgroup move lock first (`_warm_moves`):
#: it goes cold about one RCU grace period after the last move.
WARM_MOVES_AFTER_S = 0.005


async def branch(m: SessionManager, source: Session, count: int,
                 snapshot_ttl_s: float | None = None) -> list[Session]:
    """`count` forks of `source` (a session or a snapshot) made at once; a snapshot when `snapshot_ttl_s`
    is set. All or none: a fork that cannot be made ends those made with it."""
    s = m.settings
    family = source.family
    if count < 1:
        raise InvalidRequest("count: at least 1")
    if len(family.sessions) + count > s.session_forks_max:
        raise SessionError(f"this session's family holds {len(family.sessions)} sessions and snapshots: "
                           f"{count} more would pass the most one may hold ({s.session_forks_max}, "
                           "CODEENV_SESSION_FORKS_MAX); delete some first", SessionErrorKind.conflict)
    m._admit(source.owner, count)
    source.busy += 1
    try:
        async with family.lock:
            if family.ended is not None:
                raise session_lost(source.public_id, family.ended)
            indexes = list(range(family.next_index, family.next_index + count))
            family.next_index += count
            # Their groups are made (and the move lock warmed, after a pause) while they are forked.
            made = asyncio.ensure_future(asyncio.to_thread(
                _session_groups, m, family, source.index, indexes,
                time.monotonic() - m.moved > WARM_MOVES_AFTER_S))
            try:
                pids = await _fork_processes(m, source, indexes, snapshot_ttl_s is not None)
            except BaseException:
                with contextlib.suppress(BaseException):
                    for group in await made:
                        await asyncio.to_thread(group.remove)
                    if family.ended is not None:  # its removal waited on these groups: once more now
                        await asyncio.to_thread(family.cgroup.remove)
                raise
            try:
                groups = await made
            except BaseException:
                await _close_forks(m, family, indexes)
                raise
            family.groups.update(zip(indexes, groups, strict=True))
            try:  # the forks' processes were born in their parent's group
                _move_forks(m, family, source.index, pids, groups)
            except SandboxError as exc:  # without its own caps none may run
                why = f"its fork could not be kept in its cgroup: {exc}"
                logger.error("session family %d: %s", family.fid, why)
                await m._end_family(family, why)
                raise SessionError(f"the session has ended: {why}", SessionErrorKind.ended) from None
            finally:
                family.close_files()
            children = []
            for index in indexes:
                child = Session(m._new_id(source.owner), index, family, source.owner, source.profile,
                                source.idle_ttl_s, source.limits, cells=source.cells,
                                host=source.host.fork() if source.host is not None else None)
                if snapshot_ttl_s is not None:  # what its forks take: its source's idle TTL and limits
                    child.kind, child.expires = SNAPSHOT, time.monotonic() + snapshot_ttl_s
                family.sessions[index] = child
                m.sessions[child.id] = child
                m.counts["snapshots_created" if snapshot_ttl_s is not None else "sessions_created"] += 1
                children.append(child)
            return children
    finally:
        source.busy -= 1
        source.last_used = time.monotonic()


async def _fork_processes(m: SessionManager, source: Session, indexes: list[int], snapshot: bool) -> list[int]:
    """The supervisor forks `source`'s process once per index: the forks' pids in the family's
    namespace. A fork refused or not made ends the others made with it."""
    s, family = m.settings, source.family
    parent = family.groups[source.index]  # the forks' processes are born there
    with contextlib.suppress(OSError, ValueError):
        parent.set_pids_max(parent.pids_current() + len(indexes))
    timeout = s.control_timeout_s + s.cleanup_timeout_s + 2.0 * len(indexes)
    pids, refused = await m._ask(family, family.channel.fork(
        source.index, indexes, s.session_forks_apart, snapshot, timeout))
    made = [p for p in pids if p is not None]
    if len(made) == len(indexes):
        return made
    await _close_forks(m, family, [index for index, pid in zip(indexes, pids, strict=True) if pid is not None])
    if refused is not None:
        hint = ("; CODEENV_SESSION_FORKS_APART=false makes forks that share their family's domain"
                if "Landlock" in refused else "")
        raise SessionError(f"the session cannot be forked: its fork would be {refused}{hint}",
                           SessionErrorKind.conflict)
    raise SessionError("the session could not be forked (its process is gone)" if not made else
                       f"the session could not be forked: {len(indexes) - len(made)} of its {len(indexes)} "
                       "forks were not made (none was kept)", SessionErrorKind.ended if not made
                       else SessionErrorKind.full)


def _session_groups(m: SessionManager, family: Family, parent: int, indexes: list[int],
                    warm: bool) -> list[JailCgroup]:
    """The groups of forks `indexes` of session `parent` (none if one cannot be made), then, if
    `warm`, the move lock warmed (`_warm_moves`)."""
    groups: list[JailCgroup] = []
    try:
        for index in indexes:
            groups.append(m._session_group(family.cgroup, index, family.memory_cap))
    except BaseException:
        for group in groups:
            group.remove()
        raise
    if warm:
        _warm_moves(family.groups[parent])
    return groups


async def _close_forks(m: SessionManager, family: Family, indexes: list[int]) -> None:
    """End forks the supervisor made (their processes are in their parent's group)."""
    s = m.settings
    for index in indexes:
        with contextlib.suppress(SessionError):
            await m._ask(family, family.channel.close(index, s.control_timeout_s + s.cleanup_timeout_s))


def _move_forks(m: SessionManager, family: Family, parent: int, ns_pids: list[int],
                groups: list[JailCgroup]) -> None:
    m.moved = time.monotonic()
    found = host_pids(family.groups[parent].procs(), ns_pids)
    for ns_pid, group in zip(ns_pids, groups, strict=True):
        pid = found.get(ns_pid)
        if pid is None:
            raise SandboxError(f"the session process {ns_pid} of the family is not in its group "
                               f"{family.groups[parent].name}")
        family.move([pid], group)


def _warm_moves(group: JailCgroup) -> None:
    """Move `group`'s first process into `group` (where it is: nothing changes), while its forks are
    made. Moving a process between cgroups first waits out an RCU grace period when none moved for a
    while (the kernel's threadgroup lock, on cgroup v1 and on v2 without favordynmods): about 15 ms
    here, which this spends while the supervisor forks (forks do not wait for it), so that the forks'
    own moves after it find the lock warm. It holds the cgroup mutex while it waits: groups are made
    before it."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        group.procs_files()[0].write_text(str(group.procs()[0]))
