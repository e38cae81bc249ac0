"""A judged call's process: the submission compiled (and, for function-call tests, its top-level code
run) once, then a child forked per test (the judge channel: see protocol.py).

With function-call tests this process has run the submission's code: the worker believes nothing
it says beyond what a program could say about itself, and measures and enforces limits from outside.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import stat
import sys
import time

from . import child, proc
from .protocol import JUDGE_BINARY, JUDGE_FUNCTION, JUDGE_STDIN, CallFd, Judge
from .workdir import Workdir

#: Where a test's fds are moved before its processes' fds are placed at 3 to 9.
HIGH_FD = 64
#: A test of a program that reads and writes files (input_mode "file"): their names in the work dir.
INPUT_FILE, OUTPUT_FILE = "input.txt", "output.txt"

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from typing import Any, NoReturn


class Submission:
    """The submission's process: its compiled code, its prepared __main__, how its tests run."""

    def __init__(self, sock: socket.socket, main: types.ModuleType | None, compiled: types.CodeType | None,
                 mode: str, fn_name: str | None, workdir: Workdir, cleanup_timeout_s: float,
                 binary_fd: int | None = None, stack_bytes: int = 0) -> None:
        self.sock = sock
        self.main = main
        self.compiled = compiled
        self.binary_fd = binary_fd  # a compiled program's (mode binary): each test execs it
        self.stack_bytes = stack_bytes
        self.mode = mode
        self.fn_name = fn_name
        self.workdir = workdir
        self.cleanup_timeout_s = cleanup_timeout_s

    def shareable(self) -> str | None:
        """Why the state after the top-level code cannot be shared by forking (None if it can): a fork
        keeps neither threads nor children, each test must find the work dir as it was, and no test
        may leave anything for the next in memory or files the forks share."""
        try:
            threads = len(os.listdir("/proc/self/task"))
        except OSError:
            threads = sys.modules["threading"].active_count() if "threading" in sys.modules else 1
        if threads > 1:
            return "its top-level code left threads running"
        try:
            if os.waitpid(-1, os.WNOHANG) is not None:
                return "its top-level code left processes running"
        except ChildProcessError:
            pass
        if not self.workdir.untouched():
            return "its top-level code changed the work dir"
        shared = _shared_with_forks({0, 1, 2, self.sock.fileno()})
        if shared is not None:
            return f"its top-level code left {shared}, which tests would share"
        return None

    def serve(self) -> NoReturn:
        """Fork a child per test the worker sends; answer "done" once every process of it is gone and
        the work dir is as it was (never returns)."""
        while True:
            msg, fds = proc.next_request(self.sock)  # none: the worker is done with this submission
            if msg.get("op") != Judge.TEST or len(fds) != CallFd.PLAIN + _extra_fds(msg, self.binary_fd, len(fds)):
                proc.close_all(fds)
                continue
            proc.send(self.sock, self.test(msg, fds))

    def test(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        output = None
        if msg.get("io") == "file":  # it reads input.txt and writes output.txt: the worker reads that as stdout
            self.write_input(fds[CallFd.STDIN])
            output, fds[CallFd.STDOUT] = fds[CallFd.STDOUT], os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)

        def body() -> None:
            self.sock.close()
            self.test_child(fds, msg)

        if "procs" in msg:  # a Communication task's processes, at once
            pids = self.spawn_processes(msg, fds)
        else:
            pids = [self.spawn_binary(fds, msg["cpu_s"]) if self.binary_fd is not None else proc.spawn(body)]
            proc.close_all(fds)
        waited, statuses, maxrss, killed = self.wait_for(pids, t0 + msg["wall_s"])
        wall = time.monotonic() - t0
        proc.kill_all()  # what the test left behind (orphans come to us: we are their subreaper)
        if output is not None:
            self.send_output(output, int(msg.get("output_bytes", 0)) + 1)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        clean = self.workdir.clean(self.cleanup_timeout_s)
        self.workdir.reset_times()
        return {"op": Judge.DONE, "i": msg.get("i"), "wait_status": next((w for w in statuses if w), 0),
                "wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                "maxrss_kb": maxrss, "timed_out": waited == proc.TIMED_OUT, "killed": killed, "clean": clean}

    def wait_for(self, pids: list[int], deadline: float) -> tuple[str, list[int], int, bool]:
        """Wait for a test's processes, in turn, until `deadline` (past it, or on the worker's KILL,
        every process of the jail is killed): how the wait ended, each one's wait status, the
        largest resident size, and whether the worker killed them."""
        killed = False

        def on_message() -> bool:
            nonlocal killed
            if proc.recv_or_exit(self.sock).get("op") == Judge.KILL:
                killed = True
                os.kill(-1, signal.SIGKILL)
            return False

        waited, statuses, maxrss = proc.ENDED, [], 0
        for pid in pids:
            pidfd = os.pidfd_open(pid)
            if waited == proc.ENDED:
                waited = proc.wait_child(pidfd, deadline, {self.sock.fileno(): on_message})
                if waited != proc.ENDED:
                    os.kill(-1, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            os.close(pidfd)
            statuses.append(status)
            maxrss = max(maxrss, usage.ru_maxrss)
        return waited, statuses, maxrss, killed

    def spawn_processes(self, msg: dict[str, Any], fds: list[int]) -> list[int]:
        """A compiled program started as several processes at once (each its argv and fds, by index
        into `fds`; stderr shared), each under the test's CPU limit; `fds` are closed here."""
        import fcntl  # here: a judged test's process maps no module that ordinary tests did not

        assert self.binary_fd is not None
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in (*fds, self.binary_fd)]  # above targets
        proc.close_all(fds)
        *fds, exe = high
        pids = []
        try:
            for spec in msg["procs"]:
                moves = {int(target): fds[index] for target, index in spec["fds"].items()}
                pids.append(self.spawn_binary(fds, msg["cpu_s"], [str(a) for a in spec["argv"]], moves, exe))
        finally:
            proc.close_all([*fds, exe])
        return pids

    def write_input(self, stdin_fd: int) -> None:
        """The test's input as input.txt in the (empty) work dir."""
        fd = os.open(os.path.join(self.workdir.path, INPUT_FILE),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            offset = 0
            while chunk := os.pread(stdin_fd, 1 << 20, offset):
                offset += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def send_output(self, out_fd: int, most: int) -> None:
        """What the test left in output.txt, at most `most` bytes, written to the test's stdout pipe
        (nothing unless it is a regular file of its own: not a link, a FIFO or a device)."""
        try:
            fd = os.open(os.path.join(self.workdir.path, OUTPUT_FILE),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            os.close(out_fd)
            return
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                left = most
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    left -= len(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out_fd, view):]
        except OSError:  # the worker stopped reading (over the output limit)
            pass
        finally:
            os.close(fd)
            os.close(out_fd)

    def spawn_binary(self, fds: list[int], cpu_s: int, argv: list[str] | None = None,
                     moves: dict[int, int] | None = None, exe: int | None = None) -> int:
        """One test of a compiled program: the binary started by posix_spawn (a vfork and an exec,
        not a copy of this interpreter), its stdio the test's, no other fd (all are close-on-exec
        here), every signal at its default and none blocked; it inherits the stack limit and the CPU
        limit, set here to the test's (this process ignores SIGXCPU: its own few ms never end it)."""
        assert self.binary_fd is not None
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (min(cpu_s, hard), hard))
        for fd in fds:
            os.set_inheritable(fd, False)
        placed = {0: fds[CallFd.STDIN], 1: fds[CallFd.STDOUT], 2: fds[CallFd.STDERR], **(moves or {})}
        # Every source is above every target (received after stdio; with moves, dup'd to HIGH_FD and
        # up): no DUP2 overwrites a source still to be placed.
        return os.posix_spawn(f"/proc/self/fd/{self.binary_fd if exe is None else exe}", ["solution", *(argv or [])],
                              os.environ,
                              file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in placed.items()],
                              setsigdef=SPAWN_DEFAULT_SIGNALS, setsigmask=())

    def test_child(self, fds: list[int], msg: dict[str, Any]) -> NoReturn:
        """One test, forked from the submission's process; never returns."""
        args: Any = None
        assert self.main is not None
        with child.Setup(fds) as setup:
            report = setup.open_report()
            if self.mode != JUDGE_STDIN:
                args = json.loads(setup.read(CallFd.CODE) or b"[]")
            setup.install_stdio()
            setup.keep_only()
            setup.limit_cpu_below_hard(msg["cpu_s"])
        del setup, fds
        assert self.compiled is not None
        namespace, compiled, mode, fn_name = self.main.__dict__, self.compiled, self.mode, self.fn_name

        def program() -> None:
            if mode != JUDGE_FUNCTION:  # stdin tests, or function tests that cannot share a prepared state
                exec(compiled, namespace)
            if mode != JUDGE_STDIN:
                assert fn_name is not None
                child.report_value(report, child.call_function(namespace, fn_name, args))

        proc.hard_exit(child.finalize(child.run(program, report)))


def _extra_fds(msg: dict[str, Any], binary_fd: int | None, count: int) -> int:
    """How many fds a test's message may carry beyond a call's: a compiled program's processes'
    (each of their fds an index below `count`, placed at 0, 1 or 3 to 9); else none."""
    procs = msg.get("procs")
    if procs is None:
        return 0
    if binary_fd is None or not isinstance(procs, list) or not 1 <= len(procs) <= 16:
        return -1
    for spec in procs:
        if not isinstance(spec, dict) or not isinstance(spec.get("argv"), list) or len(spec["argv"]) > 8:
            return -1
        places = spec.get("fds")
        if not isinstance(places, dict) or not all(
                target in ("0", "1", *map(str, range(3, 10))) and isinstance(index, int) and 0 <= index < count
                for target, index in places.items()):
            return -1
    return count - CallFd.PLAIN


def _shared_with_forks(own_fds: set[int]) -> str | None:
    """What the process holds that its forks would share rather than copy (None if nothing): a
    MAP_SHARED mapping (mmap.mmap(-1, n), multiprocessing's Value), or an fd beyond `own_fds` (an
    open file's offset, a pipe's or memfd's contents)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) > 1 and fields[1][3:4] == b"s":
                    return "a shared memory mapping"
        fds = {int(name) for name in os.listdir("/proc/self/fd")}
    except (OSError, ValueError):
        return "state that could not be inspected"
    for fd in fds - own_fds:
        try:
            os.fstat(fd)
        except OSError:  # listdir's own, closed again by now
            continue
        return "open files"
    return None


def serve_submission(fds: list[int], msg: dict[str, Any], pre: child.Preloaded, main: types.ModuleType | None,
                     workdir: Workdir, cleanup_timeout_s: float) -> NoReturn:
    """A judged call's child: the submission's process (`main`: as a spare prepared it). It compiles
    the code once (for function-call tests it also runs its top-level code once), then forks one
    child per test (never returns)."""
    mode, fn_name = msg["judge"], msg.get("fn_name")
    if mode == JUDGE_BINARY:
        serve_binary(fds, msg, pre, main, workdir, cleanup_timeout_s)
    with child.Setup(fds) as setup:
        if main is None:
            main = child.prepare(pre)
        code = setup.read(CallFd.CODE)
        setup.install_stdio()
        sock_fd = fds[CallFd.JUDGE]
        setup.keep_only(sock_fd)
        setup.limit(msg, cpu_slack=2)
        proc.set_child_subreaper()
        setup.register_source(child.FILENAME, code)
        sock = socket.socket(fileno=sock_fd)
    del setup, fds
    try:
        compiled = compile(code, child.FILENAME, "exec", dont_inherit=True)
    except BaseException as exc:  # SyntaxError, a NUL byte, too deep to compile, out of memory
        import traceback

        text = "".join(traceback.format_exception_only(type(exc), exc))
        proc.send(sock, {"op": Judge.PREPARED, "compile_error": child.exception_report(exc),
                         "stderr": text[-8000:]})
        proc.hard_exit(0)
    submission = Submission(sock, main, compiled, mode, fn_name, workdir, cleanup_timeout_s)
    if mode == JUDGE_FUNCTION:
        why = None
        try:
            exec(compiled, main.__dict__)
        except BaseException:  # every test fails the same way: each runs the top-level code itself
            why = "its top-level code failed"
        why = why or submission.shareable()
        if why is not None:
            proc.send(sock, {"op": Judge.PREPARED, "unshared": why})
            proc.hard_exit(0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    proc.send(sock, {"op": Judge.PREPARED, "cpu_s": usage.ru_utime + usage.ru_stime})
    submission.serve()


SPAWN_DEFAULT_SIGNALS = frozenset(signal.valid_signals()) - child.UNCATCHABLE


def serve_binary(fds: list[int], msg: dict[str, Any], pre: child.Preloaded, main: types.ModuleType | None,
                 workdir: Workdir, cleanup_timeout_s: float) -> NoReturn:
    """A judged call of a compiled program (the code memfd holds it, sealed): nothing to prepare; each
    test spawns it (never returns)."""
    with child.Setup(fds) as setup:
        if main is None:  # a child forked on demand: its session, work dir and environment as a spare's
            child.prepare(pre)
        binary_fd, sock_fd = fds[CallFd.CODE], fds[CallFd.JUDGE]
        setup.install_stdio()
        setup.keep_only(sock_fd, binary_fd)
        setup.limit(msg, cpu_slack=2)
        proc.set_child_subreaper()
        sock = socket.socket(fileno=sock_fd)
    del setup
    for fd in os.listdir("/proc/self/fd"):  # what was received is inheritable: no test may get it
        with contextlib.suppress(OSError):
            if int(fd) > 2:
                os.set_inheritable(int(fd), False)
    del fds
    signal.signal(signal.SIGXCPU, signal.SIG_IGN)  # the tests' CPU limit is this process's soft limit
    child.raise_stack(msg["stack_bytes"])
    submission = Submission(sock, None, None, JUDGE_BINARY, None, workdir, cleanup_timeout_s,
                            binary_fd=binary_fd, stack_bytes=msg["stack_bytes"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    proc.send(sock, {"op": Judge.PREPARED, "cpu_s": usage.ru_utime + usage.ru_stime})
    submission.serve()
