"""The call zygote: a child per call (forked ahead of it when it can: the spare), its wall clock, and
the wipe after it, reported as "exited" and "ready" (see protocol.py)."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import time

from . import child, proc
from .judge import serve_submission
from .protocol import (
    FIRST_UNSTD_FD,
    GO_TIMEOUT_S,
    JUDGE_SERVED,
    MAX_FDS,
    MAX_MSG,
    REPORT_BYTES,
    SETUP_FAILED,
    STARTED_MARK,
    CallFd,
    Ctl,
)
from .workdir import Workdir, fetch_files

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from typing import Any, NoReturn

#: Time the collector has to copy the fetched files (the worker waits for "exited" meanwhile).
FETCH_TIMEOUT_S = 5


def _discard(spare: tuple[int, int, socket.socket]) -> None:
    """Kill a spare child and reap it; close its pidfd and socket."""
    pid, pidfd, sock = spare
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(pidfd)
    sock.close()


class CallZygote:
    """PID 1 of a call jail, once preloaded: its control socket, its work dir, its spare child."""

    def __init__(self, ctl: socket.socket, pre: child.Preloaded, workdir: Workdir, cleanup_timeout_s: float,
                 prefork: bool) -> None:
        self.ctl = ctl
        self.pre = pre
        self.workdir = workdir
        self.cleanup_timeout_s = cleanup_timeout_s
        self.prefork = prefork
        #: (pid, pidfd, socket) of the child forked ahead of the next call.
        self.spare: tuple[int, int, socket.socket] | None = None

    def serve(self) -> NoReturn:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.ctl, MAX_MSG, MAX_FDS)
                if not data:
                    os._exit(0)  # the worker closed the socket: stop
                msg = json.loads(data)
                op = msg.get("op")
                if op == Ctl.RUN:
                    self.run(data, msg, fds)
                else:
                    proc.close_all(fds)
                    if op == Ctl.RENEW:
                        self.renew_network(msg)
                    if op == Ctl.PING:
                        proc.send(self.ctl, {"op": Ctl.PONG})
            except OSError as exc:  # the worker went away mid-call
                proc.log("control socket failed:", exc)
                os._exit(1)

    # --- a child ahead of its call ----------------------------------------------------------------

    def make_spare(self) -> None:
        """Fork the next call's child now, while the worker is busy with the last result.

        This takes the fork off the next call's latency; the worker asks for it with the "spare"
        flag of a call (the `prefork` setting).
        """
        if not self.prefork:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

        def body() -> None:
            ours.close()
            self.spare_child(theirs)

        pid = proc.spawn(body)
        theirs.close()
        self.spare = (pid, os.pidfd_open(pid), ours)

    def spare_child(self, sock: socket.socket) -> NoReturn:
        """A child forked ahead of demand: prepared, it waits for its call's fds (never returns)."""
        fds: list[int] = []
        try:
            os.closerange(FIRST_UNSTD_FD, sock.fileno())
            os.closerange(sock.fileno() + 1, 1 << 20)
            main = child.prepare(self.pre)
            data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, MAX_FDS)
            if not data or len(fds) not in CallFd.COUNTS:
                proc.hard_exit(SETUP_FAILED)
            msg = json.loads(data)
            sock.close()
            if not CallFd.fits(msg, len(fds)):
                raise ValueError(f"{len(fds)} fds do not fit the call")
        except BaseException as exc:
            if len(fds) in CallFd.COUNTS:
                child.report_setup_error(fds[CallFd.SETUP], exc)
            proc.hard_exit(SETUP_FAILED)
        self.call_child(fds, msg, main)

    def call_child(self, fds: list[int], msg: dict[str, Any], main: types.ModuleType | None) -> NoReturn:
        if msg.get("judge") in JUDGE_SERVED:
            serve_submission(fds, msg, self.pre, main, self.workdir, self.cleanup_timeout_s)
        child.run_call(fds, msg, self.pre, main)
        proc.hard_exit(SETUP_FAILED)  # run_call never returns, even if the program patched os._exit

    def renew_network(self, msg: dict[str, Any]) -> None:
        """The last call used the network (its counters moved, seen from outside): a fresh network
        namespace for the next, so no socket, port in TIME_WAIT or counter of it is left, without a
        restart. A spare was forked in the old namespace: it goes, and a new one is forked."""
        spare, self.spare = self.spare, None
        if spare is not None:
            _discard(spare)
        try:
            proc.unshare(proc.CLONE_NEWNET)
            proc.loopback_up()
            clean = True
        except OSError as exc:  # no capability (the legacy policy): the worker recycles the jail
            proc.log("a fresh network namespace failed:", exc)
            clean = False
        if clean and spare is not None:
            self.make_spare()
        proc.send(self.ctl, {"op": Ctl.READY, "seq": msg.get("seq"), "clean": clean, "spare": self.spare is not None})

    def take_spare(self) -> tuple[int, int, socket.socket] | None:
        """The waiting spare child, if it is still alive."""
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        pid, pidfd, sock = spare
        if select.select([pidfd], [], [], 0)[0]:  # it exited: reap it, fork a fresh child instead
            os.waitpid(pid, 0)
            os.close(pidfd)
            sock.close()
            return None
        return spare

    def await_go(self, seq: int) -> bool:
        """A freshly forked child waits while the worker raises its OOM score from outside (a child
        cannot, and may not lower it): say "forked", wait for "go"."""
        proc.send(self.ctl, {"op": Ctl.FORKED, "seq": seq})
        deadline = time.monotonic() + GO_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            if not select.select([self.ctl], [], [], remaining)[0]:
                break
            msg = proc.recv_or_exit(self.ctl)  # the worker is gone: exit
            if msg.get("op") == Ctl.GO and msg.get("seq") == seq:
                return True
            if msg.get("op") == Ctl.PING:
                proc.send(self.ctl, {"op": Ctl.PONG})
            elif msg.get("op") == Ctl.KILL:
                return False
        return False

    # --- one call ---------------------------------------------------------------------------------

    def start(self, data: bytes, msg: dict[str, Any], fds: list[int]) -> tuple[int, int]:
        """The call's child, running (the spare, or a fresh child once the worker says go): (pid, pidfd)."""
        spare = self.take_spare()
        if spare is not None:
            pid, pidfd, sock = spare
            try:
                socket.send_fds(sock, [data], fds)
            except OSError:  # it died after all, before it got the call: fork a fresh child
                _discard(spare)
            else:
                sock.close()
                return pid, pidfd
        go_r, go_w = os.pipe()

        def body() -> None:
            os.close(go_w)
            if os.read(go_r, 1) != b"g":  # not before the worker has raised its OOM score
                proc.hard_exit(SETUP_FAILED)
            os.close(go_r)
            self.call_child(fds, msg, None)

        pid = proc.spawn(body)
        os.close(go_r)
        pidfd = os.pidfd_open(pid)
        if self.await_go(msg["seq"]):
            os.write(go_w, b"g")
        os.close(go_w)  # without "go" the child reads EOF and exits before any of the call runs
        return pid, pidfd

    def run(self, data: bytes, msg: dict[str, Any], fds: list[int]) -> None:
        seq = msg["seq"]
        if not CallFd.fits(msg, len(fds)):
            proc.close_all(fds)
            proc.send(self.ctl, {"op": Ctl.EXITED, "seq": seq,
                                 "refused": f"expected {CallFd.COUNTS} fds, got {len(fds)}"})
            proc.send(self.ctl, {"op": Ctl.READY, "seq": seq, "clean": True, "spare": self.spare is not None})
            return
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        # Before the fork, the mark that the call may have started: the worker reads it only if this
        # zygote dies or hangs, to tell a call it can safely run elsewhere from one it must not rerun.
        os.pwrite(fds[CallFd.SETUP], STARTED_MARK, REPORT_BYTES - 1)
        t0 = time.monotonic()
        pid, pidfd = self.start(data, msg, fds)
        fetch = fds[CallFd.FETCH_LIST:]  # the fetch list and fetch-out memfds stay for the collector
        proc.close_all(fds[:CallFd.FETCH_LIST])
        killed = False

        def on_message() -> bool:
            nonlocal killed
            op = proc.recv_or_exit(self.ctl).get("op")  # the worker is gone: nobody will read a result
            if op == Ctl.KILL:
                killed = True
                os.kill(-1, signal.SIGKILL)
            elif op == Ctl.PING:
                proc.send(self.ctl, {"op": Ctl.PONG})
            return False

        waited = proc.wait_child(pidfd, t0 + msg["wall_s"], {self.ctl.fileno(): on_message})
        wall = time.monotonic() - t0
        if waited != proc.ENDED:
            os.kill(-1, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        os.close(pidfd)
        proc.kill_all()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if fetch:
            if msg.get("fetch"):
                proc.in_child("collector", lambda: fetch_files(self.workdir.path, fetch[0], fetch[1]),
                              FETCH_TIMEOUT_S)
            proc.close_all(fetch)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        self.report(msg, {
            "op": Ctl.EXITED, "seq": seq, "wait_status": status, "wall_s": wall, "cpu_s": cpu,
            "maxrss_kb": usage.ru_maxrss, "timed_out": waited == proc.TIMED_OUT, "killed": killed,
        })

    def report(self, msg: dict[str, Any], exited: dict[str, Any]) -> None:
        """Send "exited", wipe what the call left, send "ready" (one message when nothing was left)."""
        # The spare (if any) is forked before "ready", which says so: the worker then knows exactly
        # how many processes the jail must hold.
        if self.workdir.settle():  # the common case: one message says both "exited" and "ready"
            if msg.get("spare"):
                self.make_spare()
            exited.update(also_ready=True, clean=True, spare=self.spare is not None)
            proc.send(self.ctl, exited)
            return
        proc.send(self.ctl, exited)
        try:
            fresh = self.workdir.fresh()
        except OSError as exc:  # no work dir now: the worker recycles the jail
            proc.log("a fresh work dir failed:", exc)
            fresh, clean = False, False
        else:
            clean = fresh or self.workdir.clean(self.cleanup_timeout_s)
            if not fresh:
                self.workdir.reset_times()
                self.workdir.record_baseline()
        if clean and msg.get("spare"):
            self.make_spare()
        proc.send(self.ctl, {"op": Ctl.READY, "seq": msg["seq"], "clean": clean, "spare": self.spare is not None,
                             "fresh_workdir": fresh})
