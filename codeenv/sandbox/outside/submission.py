"""A judged call's worker end: the judge channel to the submission's process in the jail (see
protocol.py), a test at a time, with CPU and wall time enforced from here.

The process at the other end may run the submission's own code, so nothing it says decides a
limit: CPU time is read from the cgroup, wall time and OOM events are observed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from codeenv.errors import ZygoteDied
from codeenv.models import LimitValues
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.inside.protocol import REPORT_BYTES, Ctl, Judge, decode, encode
from codeenv.sandbox.outside.call_io import (
    CallFiles,
    Drain,
    Exited,
    Outcome,
    SharedFds,
    TestDone,
    read_report,
    receive,
    take_report,
)
from codeenv.settings import SandboxSettings

#: How long the submission's process has to stop a test it was asked to stop, before the jail does.
STOP_WAIT_S = 0.5


class JudgeJail(Protocol):
    """What a submission needs of its call jail (calls.CallJail)."""

    settings: SandboxSettings
    cgroup: JailCgroup
    dead: bool

    @property
    def name(self) -> str: ...

    def next_seq(self) -> int: ...
    def apply_limits(self, limits: LimitValues, extra_pids: int = 0) -> int: ...
    def raise_oom_scores(self) -> None: ...
    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None: ...
    def forget_events(self) -> None: ...
    async def await_exit(self, out: Outcome, seq: int, setup_fd: int, wall_s: float) -> None: ...


@dataclass
class TestOutcome:
    """What the worker observed of one judged test, before it is compared and classified."""

    __test__ = False  # not a pytest test class

    done: TestDone | Exited | None = None  # its "done" (or, run alone as a plain call, its "exited")
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

    def __init__(self, zygote: JudgeJail, seq: int, sock: socket.socket, call: CallFiles,
                 limits: LimitValues, total_wall_s: float, usage0: int) -> None:
        self.zygote = zygote
        self.seq = seq
        self.sock = sock
        self.call = call
        self.limits = limits
        self.total_wall_s = total_wall_s
        self.usage0 = usage0
        self.drains: list[Drain] = []
        self.prepared: dict[str, Any] | None = None
        self.prep_cpu_s = 0.0
        self.lost: str | None = None
        self.outcome: Outcome | None = None
        self.shared = SharedFds.make()
        #: The next test's files, made while the test before it ran (`prepare_next`): (its index, args,
        #: stdin, report size, the files).
        self._next: tuple[int, bytes, bytes, int, CallFiles] | None = None

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
            self.sock.send(encode({"op": Judge.KILL}))
        data, _ = await self.receive(STOP_WAIT_S, None, None)
        msg = decode(data) if data else None
        if msg is not None and msg.get("op") == Judge.DONE:
            return msg
        self.lost = self.lost or "the submission's process did not stop the test"
        with contextlib.suppress(ZygoteDied):
            self.zygote.send({"op": Ctl.KILL, "seq": self.seq})
        return None

    def prepare_next(self, index: int, args: bytes, stdin: bytes, report_bytes: int) -> None:
        """Make test `index`'s files now (its input's memfd, its output pipes), while the test before it
        runs: `test` takes them if it is asked for that test with that input. Nothing else is done
        ahead: its cgroup figures are read as it starts and ends."""
        self.drop_next()
        self._next = (index, args, stdin, report_bytes, CallFiles(args, stdin, None, None, 0, report_bytes,
                                                                  shared=self.shared))

    def drop_next(self) -> None:
        if self._next is not None:
            files = self._next[4]
            self._next = None
            files.close_theirs()
            files.close()

    def _files(self, index: int, args: bytes, stdin: bytes, report_bytes: int) -> CallFiles:
        """Test `index`'s files: those made ahead for it (`prepare_next`), else new ones."""
        if self._next is not None and self._next[:4] == (index, args, stdin, report_bytes):
            files, self._next = self._next[4], None
            return files
        self.drop_next()  # made for another test (or another input)
        return CallFiles(args, stdin, None, None, 0, report_bytes, shared=self.shared)

    async def test(self, index: int, args: bytes, stdin: bytes, output_cap: int, report_bytes: int,
                   talk: tuple[int, int] | None = None, file_io: bool = False,
                   procs: tuple[list[dict[str, Any]], list[int]] | None = None,
                   meanwhile: Callable[[], None] | None = None) -> TestOutcome:
        """Run one test in a fresh child of the prepared process; its limits are the call's, less
        the preparation's CPU time. `talk`: an interactive test's stdin and stdout (CallFiles);
        `file_io`: its input is input.txt in the work dir and its output output.txt, which the
        submission's process sends as its stdout. `procs`: a compiled program run as several
        processes at once (their argv and fds, by index in the message's fds; the fds sent after
        the call's), each under the test's limits. `meanwhile`: called once the test has started
        (e.g. to prepare the next one's files while this one runs)."""
        z, limits = self.zygote, self.limits
        out = TestOutcome(report_bytes=report_bytes)
        oom0, pids0 = z.cgroup.oom_kills(), z.cgroup.pids_limit_hits()
        z.cgroup.reset_peak()
        cpu0 = z.cgroup.cpu_usage_ns()
        budget = max(0.001, limits.cpu_s - self.prep_cpu_s)
        processes = len(procs[0]) if procs is not None else 1  # each has the CPU limit: the cgroup's, all of them
        loop = asyncio.get_running_loop()
        stopping = False

        def overflow() -> None:
            nonlocal stopping
            out.output_overflow = stopping = True
            with contextlib.suppress(OSError):
                self.sock.send(encode({"op": Judge.KILL}))

        if talk is None and procs is None:
            files = self._files(index, args, stdin, report_bytes)
        else:
            files = CallFiles(args, stdin, None, None, 0, report_bytes, shared=self.shared, talk=talk,
                              extra=procs[1] if procs is not None else None)
        with files:
            try:
                socket.send_fds(self.sock, [encode({
                    "op": Judge.TEST, "i": index, "cpu_s": max(1, int(budget + 1.999)), "wall_s": limits.wall_s,
                    **({"io": "file", "output_bytes": output_cap} if file_io else {}),
                    **({"procs": procs[0]} if procs is not None else {}),
                })], files.theirs)
            except OSError as exc:
                self.lost = f"the submission's process is gone: {exc}"
                out.lost = self.lost
                return out
            finally:
                files.close_theirs()
            t0 = time.monotonic()
            drains = files.drain(loop, output_cap, overflow)
            if meanwhile is not None:
                meanwhile()
            # The process ends the test at its wall limit; a little slack before the jail does it.
            data, why = await self.receive(limits.wall_s + z.settings.kill_grace_s, int(processes * budget * 1e9),
                                           cpu0)
            msg = decode(data) if data else None
            if why == "cpu":
                out.cpu_exceeded = True
                msg = await self.stop_test()
            elif why == "wall":
                out.wall_exceeded = True
                msg = await self.stop_test()
            elif msg is None or msg.get("op") != Judge.DONE:
                self.lost = "the submission's process ended during a test"
                out.lost = self.lost
                with contextlib.suppress(ZygoteDied):
                    z.send({"op": Ctl.KILL, "seq": self.seq})
            out.wall_s = time.monotonic() - t0
            if msg is not None and msg.get("op") == Judge.DONE:
                try:
                    out.done = TestDone.parse(msg)
                except ValueError:
                    self.lost = out.lost = "the submission's process sent a malformed message"
            if not all(d.done.done() for d in drains):  # (most often both saw their end with the "done")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*(d.done for d in drains)), z.settings.control_timeout_s)
            out.stdout, out.stderr = bytes(drains[0].buf), bytes(drains[1].buf)
            out.report = take_report(self.shared.report_fd, report_bytes)
            setup = take_report(self.shared.setup_fd, REPORT_BYTES)
            if setup is not None:
                out.setup_error = str(setup.get("setup_error", "unknown"))[:500]
        with contextlib.suppress(OSError, ValueError):
            self._charge(out, oom0, pids0, cpu0)
        return out

    def _charge(self, out: TestOutcome, oom0: int, pids0: int, cpu0: int | None) -> None:
        """What the jail's cgroup says of the test that just ended (its figures read as it started):
        an OOM kill, the pids limit hit, its CPU time and its memory peak."""
        cgroup = self.zygote.cgroup
        out.oom_killed = cgroup.oom_kills() > oom0
        out.pids_limit_hit = cgroup.pids_limit_hits() > pids0
        cpu1 = cgroup.cpu_usage_ns()
        own = out.done.cpu_s if out.done is not None else None
        if own is None and cpu0 is not None and cpu1 is not None:
            own = (cpu1 - cpu0) / 1e9
        out.cpu_s = self.prep_cpu_s + (own or 0.0)
        if out.cpu_exceeded:
            out.cpu_s = max(out.cpu_s, self.limits.cpu_s)
        peak = cgroup.memory_peak()
        if peak is not None:
            out.memory_peak_kb = max(0, peak - self.usage0) >> 10
        elif out.done is not None:
            out.memory_peak_kb = out.done.maxrss_kb

    def abandon(self) -> None:
        """Drop the worker's fds of a call that will not be closed (cancelled; its jail is recycled)."""
        if self.outcome is not None:
            return
        self.drop_next()
        self.sock.close()
        self.call.close()
        self.shared.close()
        self.outcome = Outcome(notes=["abandoned"])

    async def close(self) -> Outcome:
        """End the judged call: every process of it goes; the zygote then wipes as after any call."""
        if self.outcome is not None:
            return self.outcome
        z = self.zygote
        out = Outcome()
        self.drop_next()
        self.sock.close()
        with contextlib.suppress(ZygoteDied):
            z.send({"op": Ctl.KILL, "seq": self.seq})
        try:
            await z.await_exit(out, self.seq, self.call.setup, STOP_WAIT_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(d.done for d in self.drains)), z.settings.control_timeout_s)
            setup = read_report(self.call.setup, REPORT_BYTES)
            if setup is not None:
                out.setup_error = str(setup.get("setup_error", "unknown"))[:500]
        finally:
            self.call.close()
            self.shared.close()
            self.outcome = out
        return out



async def prepare(jail: JudgeJail, code: bytes, mode: str, fn_name: str | None, limits: LimitValues,
                  total_wall_s: float) -> Submission:
    """Start a judged call: a process in the jail compiles `code` (for function-call tests, also
    runs its top-level code) and then runs the tests sent to the returned Submission, one child
    each. `limits` are per test; the preparation counts against each. Raises ZygoteDied
    (started=False) only if it provably never started."""
    if jail.dead:
        raise ZygoteDied(f"zygote {jail.name} is not running", started=False)
    seq = jail.next_seq()
    usage0 = jail.apply_limits(limits, extra_pids=1)  # the submission's process itself
    jail.forget_events()
    cpu0 = jail.cgroup.cpu_usage_ns()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    ours.setblocking(False)
    jail.raise_oom_scores()
    call = CallFiles(code, b"", None, None, 0)
    call.theirs.append(theirs.detach())
    sub = Submission(jail, seq, ours, call, limits, total_wall_s, usage0)
    try:
        try:
            jail.send({"op": Ctl.RUN, "seq": seq, "wall_s": total_wall_s,
                       "cpu_s": max(1, int(limits.cpu_s + 0.999)), "fsize_bytes": limits.file_size_mb << 20,
                       "nofile": limits.open_files, "spare": jail.settings.prefork, "fetch": False,
                       "judge": mode, "fn_name": fn_name, "stack_bytes": limits.memory_mb << 20}, call.theirs)
        finally:
            call.close_theirs()
        sub.drains = call.drain(asyncio.get_running_loop(), limits.output_bytes, lambda: None)
        data, why = await sub.receive(limits.wall_s, int(limits.cpu_s * 1e9), cpu0)
        cpu1 = jail.cgroup.cpu_usage_ns()
        msg = decode(data) if data else None
        if msg is None or msg.get("op") != Judge.PREPARED:
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
