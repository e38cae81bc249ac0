"""A call's I/O on the worker's side: the fds handed to the child, the drains that read its output
into bounded buffers while it runs, and what it leaves in its memfds (report, setup error, fetched
files). Everything read here was written inside the jail, so it is checked like any untrusted input.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.inside.protocol import (
    FETCH_DATA_AT,
    MAX_MSG,
    REPORT_BYTES,
    STARTED_MARK,
    CallFd,
    frame,
    read_frame,
)

READ_CHUNK = 65536
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x1, 0x2, 0x4, 0x8
F_ADD_SEALS = 1033



def _number(msg: dict[str, Any], key: str, kind: type[int] | type[float], default: Any) -> Any:
    """Field `key` of a message from the jail as `kind` (`default` if absent); ValueError if it is
    not a number."""
    value = msg.get(key, default)
    if value is default or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value if value is default else kind(value)
    raise ValueError(f"{msg.get('op', 'a message')!r} has a bad {key}: {value!r}")


@dataclass(frozen=True, slots=True)
class Ready:
    """The zygote's "ready" (or the same carried by an "exited"): the call's traces are wiped
    (`clean`: as it believes; the worker checks from outside), and whether a spare child now waits."""

    clean: bool = False
    spare: bool = False
    fresh_workdir: bool = False  # a new tmpfs on the work dir: the worker's baselines are taken anew

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Ready:
        return cls(clean=msg.get("clean") is True, spare=msg.get("spare") is True,
                   fresh_workdir=msg.get("fresh_workdir") is True)


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
    ready: Ready | None = None  # it said "ready" too: the traces are wiped already

    @property
    def clean(self) -> bool:
        """Its traces were wiped by the time it was reported."""
        return self.ready is not None and self.ready.clean

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> Exited:
        refused = msg.get("refused")
        return cls(wait_status=_number(msg, "wait_status", int, 0), wall_s=_number(msg, "wall_s", float, 0.0),
                   cpu_s=_number(msg, "cpu_s", float, 0.0), maxrss_kb=_number(msg, "maxrss_kb", int, None),
                   timed_out=msg.get("timed_out") is True, killed=msg.get("killed") is True,
                   refused=str(refused)[:500] if refused is not None else None,
                   ready=Ready.parse(msg) if msg.get("also_ready") is True else None)


@dataclass(frozen=True, slots=True)
class TestDone:
    """A judged test's "done", from the submission's process: its own account of the test (which may
    have run the submission's code), checked like any input from the jail."""

    __test__ = False  # not a pytest test class

    wait_status: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    maxrss_kb: int | None = None
    timed_out: bool = False
    killed: bool = False
    clean: bool = False  # the work dir is as before the test

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> TestDone:
        return cls(wait_status=_number(msg, "wait_status", int, 0), wall_s=_number(msg, "wall_s", float, 0.0),
                   cpu_s=_number(msg, "cpu_s", float, 0.0), maxrss_kb=_number(msg, "maxrss_kb", int, None),
                   timed_out=msg.get("timed_out") is True, killed=msg.get("killed") is True,
                   clean=msg.get("clean") is True)


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


def started_mark(setup_fd: int) -> bool:
    """Whether the zygote marked the call as started (it does so just before it forks)."""
    try:
        return os.pread(setup_fd, 1, REPORT_BYTES - 1) == STARTED_MARK
    except OSError:
        return True  # cannot prove it never started



def pack_files(files: list[tuple[str, bytes]]) -> bytes:
    """Input files as the child reads them: a frame with the index [[path, size], ...], then the contents."""
    return frame([[path, len(data)] for path, data in files]) + b"".join(data for _, data in files)


def read_fetched(fd: int, asked: list[str]) -> tuple[dict[str, bytes], dict[str, str]]:
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


def sealed_memfd(name: str, data: bytes) -> int:
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


class Drain:
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


@dataclass
class SharedFds:
    """The fds every test of a judged submission shares: the empty arguments, the setup and the
    report memfds (a report is read, then its frame header cleared); only a test's input and output
    pipes are its own."""

    no_args: int
    setup_fd: int
    report_fd: int
    report_bytes: int = 0

    @classmethod
    def make(cls) -> SharedFds:
        setup_fd = os.memfd_create("setup", os.MFD_CLOEXEC)
        os.ftruncate(setup_fd, REPORT_BYTES)
        return cls(sealed_memfd("args", b""), setup_fd, os.memfd_create("report", os.MFD_CLOEXEC))

    def close(self) -> None:
        for fd in (self.no_args, self.setup_fd, self.report_fd):
            os.close(fd)


class CallFiles:
    """The fds of one call, in `CallFd` order for the child (`theirs`, closed here once sent), and
    the worker's own ends: the output pipes' read ends (owned by their drains once draining), the
    report and setup memfds, and the fetched-files memfd. Everything is closed on every path out."""

    def __init__(self, code: bytes, stdin: bytes, files: list[tuple[str, bytes]] | None,
                 fetch: list[str] | None, fetch_bytes: int, report_bytes: int = REPORT_BYTES,
                 shared: SharedFds | None = None, talk: tuple[int, int] | None = None,
                 extra: list[int] | None = None) -> None:
        """`shared`: a judged test's fds; its empty code (arguments) memfd, report and setup memfds
        are the submission's (dup'd to send), only its input and output pipes are its own. `talk`:
        an interactive test's stdin and stdout (the interactor's pipes, dup'd to send); its stdout
        drain then sees nothing. `extra`: more fds sent after the call's (a Communication task's
        processes' pipes, dup'd)."""
        self.theirs: list[int] = []
        self._ours: list[int] = []
        self._drains: list[Drain] = []
        self.fetched: int | None = None
        try:
            if shared is None:
                self.theirs.append(sealed_memfd("code", code))
            else:
                self.theirs.append(sealed_memfd("args", code) if code else os.dup(shared.no_args))
            if talk is None:
                self.theirs.append(sealed_memfd("stdin", stdin))
                self.stdout, self.stderr = (self._pipe() for _ in range(2))
            else:
                self.theirs.append(os.dup(talk[0]))
                self.stdout, unused = os.pipe2(os.O_CLOEXEC)  # an empty stream: the interactor reads the output
                os.close(unused)
                self._ours.append(self.stdout)
                self.theirs.append(os.dup(talk[1]))
                self.stderr = self._pipe()
            if shared is None:
                self.report, self.setup = self._memfd("report", report_bytes), self._memfd("setup", REPORT_BYTES)
            else:
                if report_bytes > shared.report_bytes:
                    os.ftruncate(shared.report_fd, report_bytes)
                    shared.report_bytes = report_bytes
                self.report, self.setup = shared.report_fd, shared.setup_fd
                self.theirs += [os.dup(shared.report_fd), os.dup(shared.setup_fd)]
            if files or fetch:
                self.theirs += [sealed_memfd("files", pack_files(files or [])),
                                sealed_memfd("fetch", json.dumps(fetch or []).encode())]
                self.fetched = self._memfd("fetched", fetch_bytes)
            assert len(self.theirs) in CallFd.COUNTS
            self.theirs += [os.dup(fd) for fd in extra or ()]
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

    def drain(self, loop: asyncio.AbstractEventLoop, cap: int, on_overflow: Callable[[], None]) -> list[Drain]:
        """Start draining stdout and stderr into bounded buffers; the drains own the read ends now."""
        fired = False

        def once() -> None:
            nonlocal fired
            if not fired:
                fired = True
                on_overflow()

        self._drains = [Drain(loop, self.stdout, cap, once), Drain(loop, self.stderr, cap, once)]
        self._ours = [fd for fd in self._ours if fd not in (self.stdout, self.stderr)]
        return self._drains

    def close(self) -> None:
        for d in self._drains:
            d.close()
        for fd in self._ours:
            os.close(fd)
        self._ours = []

    def __enter__(self) -> CallFiles:
        return self

    def __exit__(self, *_: object) -> None:
        self.close_theirs()
        self.close()



#: How often a judged test's CPU time is read from the cgroup (its limit is enforced within ~2x this).
CPU_POLL_S = 0.02


async def collect(out: Outcome, call: CallFiles, drains: list[Drain], report_bytes: int, timeout_s: float) -> None:
    """A call's output and reports into `out`, once every writer is dead (so the pipes reach EOF
    promptly; after `timeout_s` what was read is what there is)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(d.done for d in drains)), timeout_s)
    out.stdout, out.stderr = bytes(drains[0].buf), bytes(drains[1].buf)
    out.stdout_truncated, out.stderr_truncated = drains[0].truncated, drains[1].truncated
    out.report = read_report(call.report, report_bytes)
    setup = read_report(call.setup, REPORT_BYTES)
    if setup is not None:
        out.setup_error = str(setup.get("setup_error", "unknown"))[:500]


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

def take_report(fd: int, limit: int) -> dict[str, Any] | None:
    """The report in a memfd that the next test uses too: read, then cleared whole (a test can read
    all of it, and must find nothing of the test before)."""
    if os.pread(fd, 4, 0) == b"\0\0\0\0" and not _written(fd):
        return None
    report = read_report(fd, limit)
    size = os.fstat(fd).st_size
    os.ftruncate(fd, 0)  # frees its pages: the next test maps zeros
    os.ftruncate(fd, size)
    return report


def _written(fd: int) -> bool:
    """Whether the memfd `fd` holds any data (tmpfs allocates no block for a page never written)."""
    return os.fstat(fd).st_blocks > 0


def read_report(fd: int, limit: int) -> dict[str, Any] | None:
    """The report frame at the start of the memfd `fd`, if it holds one (most calls leave it empty)."""
    try:
        if os.pread(fd, 4, 0) == b"\0\0\0\0":
            return None
        report = read_frame(fd, limit)
        return report if isinstance(report, dict) else None
    except (OSError, ValueError, RecursionError):  # the program may have scribbled on it
        return None
