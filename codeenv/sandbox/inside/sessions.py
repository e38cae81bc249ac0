"""The session zygote: a family of live interpreters per fork of a session jail's zygote.

In a session jail the zygote runs as the jail's root (in the jail's user namespace; a host uid of
its own) and keeps CAP_SETUID, CAP_SETGID, CAP_SYS_ADMIN and CAP_NET_ADMIN there. It runs no
call. Per family (a session and its forks) it forks a supervisor in new pid, mount, network and
IPC namespaces: PID 1 of the family. The supervisor mounts the family's own /proc and work dir
(a tmpfs), brings up its loopback, drops to the family's uid (no capability survives), stacks a
seccomp filter that kills mount/unshare/set*id, and only then forks the first session process.
It runs no user code; user code cannot signal it (a namespace's init ignores signals it has no
handler for), trace it (the policy kills ptrace) or read it (non-dumpable).

A cell runs in a fork of its session's process: the process before the cell (the "pre-cell"
process) is stopped (SIGSTOP, its threads too) while the cell runs. A cell that ends by itself
(normally, with an exception, with SystemExit) becomes the session and the pre-cell process is
killed; a cell stopped by a limit is killed with everything it started, and the pre-cell process
is resumed: the session is exactly as before the cell, without replay. A cell's "done" is only its
word: an idle session's process is stopped too (SIGSTOP, until the kernel shows every thread
stopped) before its cell is answered, and resumed only for its next cell or fork, so a session runs
nothing between cells whatever it announced. The channels are drawn in protocol.py.
"""

from __future__ import annotations

import errno
import os
import resource
import select
import signal
import socket
import sys
import time

from . import child, hostcalls, proc, workdir
from .proc import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
)
from .protocol import MAX_FDS, MAX_MSG, ONE_FD, SETUP_FAILED, CallFd, Cell, CellFd, Ctl, Family, Session, decode, encode
from .rollback import UNRESTORED_MAX, not_restored, open_files
from .session_procs import (
    alive,
    freeze,
    random_state,
    restore_random,
    send_signal,
    sender_pid,
    stopped,
    thaw,
    thread_count,
    wait_stopped,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from collections.abc import Callable
    from typing import Any, NoReturn

#: Time a pre-cell process has to report its cell's end after it is resumed.
SESSION_REPLY_S = 2.0
#: How long a rolled-back cell's supervisor waits for the worker to lift the cell's memory limit.
RESUME_WAIT_S = 60.0
#: Most forks one request makes (a family holds at most CODEENV_SESSION_FORKS_MAX sessions anyway).
FORKS_AT_ONCE = 1024
class SessionProcess:
    """A session's process: it waits for a cell (or a fork) on its channel. A cell's process that ends
    by itself, and a fork, carry on in this same loop (no call nests: a session lives through any
    number of cells)."""

    def __init__(self, ch: socket.socket, main: types.ModuleType, top: str) -> None:
        self.ch = ch
        self.main = main
        self.top = top
        #: Std streams a cell replaced, never freed here (see `fresh_stdio`).
        self.retired: list[tuple[object, ...]] = []
        #: A snapshot's work dir, held in its memory: no process of the family can change what its
        #: forks start from (the family's dirs are one tmpfs, under one uid).
        self.held: workdir.Held | None = None

    def enter(self, sid: int) -> None:
        """Its own dir, HOME and TMPDIR."""
        path = session_dir(self.top, sid)
        os.chdir(path)
        os.environ["HOME"] = os.environ["TMPDIR"] = path
        sys.path[0] = path
        if "tempfile" in sys.modules:  # its cached dir is the zygote's; TMPDIR says ours (no import: 10 ms)
            setattr(sys.modules["tempfile"], "tempdir", None)  # noqa: B010

    def loop(self) -> NoReturn:
        while True:
            msg, fds = proc.next_request(self.ch)  # none: the supervisor is gone
            op = msg.get("op")
            if op == Session.CELL and len(fds) == CellFd.COUNT:
                self.cell(msg, fds)
            elif op == Session.FORK and len(fds) == ONE_FD:
                state = random_state()
                try:
                    pid = proc.fork()
                except OSError:  # no process to be had (its pids cap): no fork, and this session lives on
                    os.close(fds[0])
                    continue
                if pid == 0:  # the new session: our child until we end (then the supervisor's)
                    try:
                        self.ch.close()
                        restore_random(state)
                        self.forked(fds[0], msg)
                    except BaseException:
                        proc.hard_exit(SETUP_FAILED)
                    continue
                os.close(fds[0])
            else:
                proc.close_all(fds)
                if op == Session.REAP:  # a fork of ours was closed: its process is gone, reap it
                    proc.reap_children()

    def cell(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Fork the cell; here, wait for it unless it becomes the session (then return in it)."""
        proc.reap_children()  # only the cell's process may be our child while it runs
        state = random_state()
        threads = thread_count()
        opened = open_files({*fds, self.ch.fileno()})
        pid = proc.fork()
        if pid == 0:
            try:
                self.ch.close()
                restore_random(state)
                self.run_cell(fds, msg, fresh_streams=threads > 1)
            except BaseException:
                proc.hard_exit(SETUP_FAILED)
            return  # the cell ended by itself: this process is the session now
        proc.close_all(fds)
        # The pre-cell process stops itself, threads and all, before the cell runs a line (the cell
        # waits for it): a stop the supervisor sent later would sit in the family's signal queue,
        # one of its RLIMIT_SIGPENDING, for a moment of the cell's.
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            _, status = os.waitpid(pid, 0)  # reached only if the cell does not become the session
        except ChildProcessError:
            status = SETUP_FAILED << 8
        try:
            unrestored = not_restored(opened)
        except BaseException as exc:  # what an earlier cell made of this process: say so, roll back anyway
            unrestored = [f"(what the rollback could not restore was not found: {type(exc).__name__})"]
        try:
            proc.send(self.ch, {"op": Session.REAPED, "wait_status": status, "unrestored": unrestored})
        except OSError:
            proc.hard_exit(0)

    def forked(self, ch_fd: int, msg: dict[str, Any]) -> None:
        """A new session made from this one's state: it enters a Landlock domain of its own (unless
        the worker says not to), copies its dir and takes its channel. In its own domain it can
        signal or trace none of the family's processes but its own: not the session it was forked
        from, nor that one's other forks, cells and subprocesses."""
        self.ch = socket.socket(fileno=ch_fd)
        if msg.get("apart"):
            try:
                proc.enter_own_domain()
            except OSError as exc:
                why = "16 generations deep (Landlock's most)" if exc.errno == errno.E2BIG else \
                    f"this kernel cannot keep it apart from its family ({exc.strerror}: Landlock ABI 6, Linux 6.12)"
                proc.send(self.ch, {"op": Session.HELLO, "refused": why})
                proc.hard_exit(SETUP_FAILED)
        ok = True
        source, target = session_dir(self.top, msg["sid"]), session_dir(self.top, msg["new_sid"])
        held, self.held = self.held, None  # a snapshot's fork is a session: it holds no dir
        try:
            if msg.get("snapshot"):
                self.held = workdir.read_tree(source)
                os.mkdir(target, 0o700)
            elif held is not None:
                workdir.write_tree(held, target)
            else:
                workdir.copy_tree(source, target)
        except BaseException:
            ok = False  # e.g. the family's work dir is full: the fork has a fresh dir instead
            if msg.get("snapshot"):
                why = "without its work dir (it could not be read into memory)"
                proc.send(self.ch, {"op": Session.HELLO, "refused": why})
                proc.hard_exit(SETUP_FAILED)
            try:
                os.mkdir(target, 0o700)
            except OSError:
                pass
        self.enter(msg["new_sid"])
        proc.send(self.ch, {"op": Session.HELLO, "copied": ok})

    def fresh_stdio(self) -> None:
        """New std streams on fds 0-2: a lock a thread held in the old ones (say, stdout's, while it
        printed when the cell's fork happened) stays with the old objects."""
        import io

        # The old objects are kept, never freed here: freeing flushes them, and a flush would wait
        # forever for a lock that a thread of the session's process (which the fork did not copy) held.
        self.retired.append((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
        streams = []
        for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
            raw = io.FileIO(fd, mode, closefd=False)
            buffered: io.BufferedReader | io.BufferedWriter = (
                io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
            streams.append(io.TextIOWrapper(buffered, encoding="utf-8",
                                            errors="strict" if fd == 0 else "backslashreplace",
                                            line_buffering=False))
        sys.stdin = sys.__stdin__ = streams[0]  # type: ignore[misc]
        sys.stdout = sys.__stdout__ = streams[1]  # type: ignore[misc]
        sys.stderr = sys.__stderr__ = streams[2]  # type: ignore[misc]

    def run_cell(self, fds: list[int], msg: dict[str, Any], fresh_streams: bool) -> None:
        """One cell, in a fork of the session's process; once it ends by itself this process is the
        session, with the cell's channel. `fresh_streams`: the session's process had other threads,
        which may hold the std streams' locks (the fork did not copy them), so the cell gets new ones."""
        name = f"<cell {msg.get('n', '?')}>"  # tracebacks and the error's line name the cell
        wait_stopped(os.getppid())  # the pre-cell process: see `cell`
        with child.Setup(fds) as setup:
            ch = socket.socket(fileno=fds[CellFd.CHANNEL])
            proc.send(ch, {"op": Cell.STARTED})  # the supervisor learns our pid from the kernel (SO_PASSCRED)
            if (decode(ch.recv(MAX_MSG)) or {}).get("op") != Cell.GO:  # once our OOM score is set
                proc.hard_exit(SETUP_FAILED)
            report = setup.open_report()
            code = setup.read(CallFd.CODE)
            saved = [os.dup(0), os.dup(1), os.dup(2)]
            setup.install_stdio()
            proc.close_all([fd for fd in fds[:CellFd.CHANNEL] if fd != setup.setup_fd])
            limits = setup.limit_soft(msg)
            if fresh_streams:
                self.fresh_stdio()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            setup.register_source(name, code)
        del setup, fds
        namespace = self.main.__dict__
        hostcalls.bind(ch, msg.get("host"), namespace)
        exit_code = child.run(lambda: child.exec_displaying_last(code, namespace, report, name), report, name)
        hostcalls.unbind()
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None and not stream.closed:
                    stream.flush()
            except BaseException:
                pass
        # Back to an idle session: no cell's fds, no limits of the cell.
        try:
            report.close()
        except BaseException:
            pass
        for target, fd in enumerate(saved):
            os.dup2(fd, target)
            os.close(fd)
        for which, value in limits.items():
            try:
                resource.setrlimit(which, value)
            except (ValueError, OSError):
                pass
        self.ch = ch
        try:
            proc.send(ch, {"op": Cell.DONE, "exit_code": exit_code})
        except OSError:
            proc.hard_exit(0)


def session_dir(top: str, sid: int) -> str:
    return f"{top}/s{sid}"


class Supervisor:
    """A family's PID 1: its account of its sessions, sid -> (pid, channel)."""

    def __init__(self, sock: socket.socket, top: str, cleanup_timeout_s: float) -> None:
        self.sock = sock
        self.top = top
        self.cleanup_timeout_s = cleanup_timeout_s
        self.sessions: dict[int, tuple[int, socket.socket]] = {}
        #: Why the last session started did not (its own word), if it said.
        self.refused: str | None = None

    def session_pids(self) -> set[int]:
        return {pid for pid, _ in self.sessions.values()}

    def freeze_all(self) -> None:
        """Stop every session's process (a cell may have resumed a sibling: they share a uid)."""
        for pid in self.session_pids():
            freeze(pid)

    def kill_others(self, keep: set[int], once: bool = False) -> None:
        """SIGKILL every process of the family but the supervisor and `keep` (again, until a look at
        /proc finds none alive: one may have forked meanwhile; `once`: one round); reap what is ours."""
        for attempt in range(1 if once else 200):
            victims = []
            for name in os.listdir("/proc"):
                if name.isdigit() and int(name) != 1 and int(name) not in keep and alive(name):
                    victims.append(int(name))
            if not victims:
                return
            for pid in victims:
                send_signal(pid, signal.SIGKILL)
            proc.reap_children()
            if attempt:
                time.sleep(0.001)

    def new_session(self, sid: int, make: Callable[[socket.socket, socket.socket], bool]) -> int | None:
        """A session process: `make(theirs, ours)` starts it in a child (forked here or by a session), which
        says hello on `theirs`; returns its pid, or None."""
        ours = self.start_session(make)
        return None if ours is None else self.greet(sid, ours, time.monotonic() + SESSION_REPLY_S * 5)

    @staticmethod
    def start_session(make: Callable[[socket.socket, socket.socket], bool]) -> socket.socket | None:
        """The supervisor's end of a new session's channel, once `make(theirs, ours)` started it; None if it
        could not."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ok = make(theirs, ours)
        theirs.close()
        if not ok:
            ours.close()
            return None
        return ours

    def greet(self, sid: int, ours: socket.socket, deadline: float) -> int | None:
        """The pid of the session that says hello on `ours` by `deadline` (then it is session `sid`), or None."""
        ready, _, _ = select.select([ours], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            ours.close()
            return None
        try:
            data, pid = sender_pid(ours)
        except OSError:
            data, pid = b"", None
        hello = decode(data) if data else None
        refused = hello.get("refused") if hello is not None else None
        if hello is None or pid is None or refused is not None:
            self.refused = str(refused)[:300] if refused else self.refused
            ours.close()
            return None
        self.sessions[sid] = (pid, ours)
        return pid

    def cell(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """Run a cell in a fork of its session's process; the "cell_done" reply."""
        sid = msg.get("sid")
        reply: dict[str, Any] = {
            "op": Family.CELL_DONE, "seq": msg.get("seq"), "kept": False, "wait_status": 0, "exit_code": None,
            "timed_out": False, "killed": False, "wall_s": 0.0, "lost": False, "written": []}
        if not isinstance(sid, int) or sid not in self.sessions or len(fds) != CallFd.PLAIN:
            proc.close_all(fds)
            reply.update(lost=True, refused="no such session here")
            return reply
        pid, ch = self.sessions[sid]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        t0 = time.monotonic()
        files_before = workdir.listing(session_dir(self.top, sid))
        deadline = t0 + msg["wall_s"]
        thaw(pid)  # it reads the cell and forks its process; stopped again once that one started
        cell_pid = self._start_cell(ch, msg, fds, theirs, ours, deadline)
        if cell_pid is None:  # the session's process is gone or does not answer: the session is lost
            ours.close()
            self.end(sid)
            reply["lost"] = True
            return reply
        if not stopped(pid):  # the pre-cell process stops itself; if it did not, it is stopped here
            send_signal(pid, signal.SIGSTOP)
        # The worker makes the cell's processes the first the OOM killer takes (the pre-cell process
        # shares their group), then the cell may run.
        try:
            proc.send(self.sock, {"op": Family.CELL_STARTED, "seq": msg.get("seq")})
        except OSError:
            pass
        if self._await_go(deadline):
            try:
                proc.send(ours, {"op": Cell.GO})
            except OSError:
                pass
        else:  # stopped before it ran a line
            reply["killed"] = True
            send_signal(cell_pid, signal.SIGKILL)
        done = self._watch_cell(cell_pid, ours, deadline, reply, hostcalls.HostRelay(self.sock, ours, msg))
        reply["wall_s"] = time.monotonic() - t0
        if done is not None:  # the cell is the session now
            code = done.get("exit_code")
            reply.update(kept=True, exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None)
            ch.close()
            self.sessions[sid] = (cell_pid, ours)
            # Its "done" is its own word: whatever it still runs stops now, before the answer (and
            # before the worker reads the cell's CPU time); its next cell resumes it.
            self.freeze_all()
            # SIGKILL to the pre-cell process and what the cell left: none of them runs an instruction
            # more. Making sure none is left (one may have forked meanwhile) waits until the reply is
            # sent (the supervisor's loop, before the next message).
            self.kill_others(self.session_pids(), once=True)
            return reply
        ours.close()
        self._roll_back(sid, pid, ch, msg.get("seq"), files_before, reply)
        return reply

    def _start_cell(self, ch: socket.socket, msg: dict[str, Any], fds: list[int], theirs: socket.socket,
                    ours: socket.socket, deadline: float) -> int | None:
        """Hand the cell to its session's process; the cell's pid once it says it started, or None."""
        try:
            socket.send_fds(ch, [encode(msg)], [*fds, theirs.fileno()])
            sent = True
        except OSError:
            sent = False
        theirs.close()
        proc.close_all(fds)
        if not sent:
            return None
        ready, _, _ = select.select([ours], [], [], max(0.0, deadline - time.monotonic()) + SESSION_REPLY_S)
        if not ready:
            return None
        try:
            data, cell_pid = sender_pid(ours)
        except OSError:
            return None
        return cell_pid if data else None

    def _await_go(self, deadline: float) -> bool:
        """The worker's go for a cell (False: it said kill, or nothing in time)."""
        while select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()) + SESSION_REPLY_S)[0]:
            op = proc.recv_or_exit(self.sock).get("op")
            if op == Family.GO:
                return True
            if op == Family.KILL:
                return False
            if op == Family.PING:
                proc.send(self.sock, {"op": Family.PONG})
        return False

    def _await_resume(self, deadline: float) -> None:
        """Until the worker's "resume" (a late kill, whose cell is over, is read and dropped; a ping is
        answered), or `deadline`."""
        while select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            op = proc.recv_or_exit(self.sock).get("op")
            if op == Family.RESUME:
                return
            if op == Family.PING:
                proc.send(self.sock, {"op": Family.PONG})

    def _watch_cell(self, cell_pid: int, ours: socket.socket, deadline: float, reply: dict[str, Any],
                    host: hostcalls.HostRelay) -> dict[str, Any] | None:
        """Wait for the cell until its deadline, passing its host calls on (`host`); its "done" if it
        ended by itself (else None, with "timed_out" or "killed" set in `reply` when so)."""
        try:
            cell_fd: int | None = os.pidfd_open(cell_pid)
        except OSError:
            cell_fd = None
        done: dict[str, Any] | None = None

        def from_cell() -> bool:
            nonlocal done
            try:
                data, sender = sender_pid(ours)
            except OSError:
                data, sender = b"", None
            if not data:
                return True
            if sender == cell_pid:
                got = decode(data)
                if got is not None and got.get("op") == Cell.DONE:
                    done = got
                    return True
                if got is not None and got.get("op") == Cell.HOST_CALL:
                    host.call(got, len(data))
            return False

        def from_worker() -> bool:
            got = proc.recv_or_exit(self.sock)
            op = got.get("op")
            if op == Family.KILL:
                reply["killed"] = True
                return True
            if op == Family.PING:
                proc.send(self.sock, {"op": Family.PONG})
            elif op == Family.HOST_RESULT:
                host.answer(got)
            return False

        waited = proc.wait_child(cell_fd, deadline, {ours.fileno(): from_cell, self.sock.fileno(): from_worker})
        reply["timed_out"] = waited == proc.TIMED_OUT
        if host.refused:
            reply["host_refused"] = host.refused
        if cell_fd is not None:
            os.close(cell_fd)
        return done

    def _roll_back(self, sid: int, pid: int, ch: socket.socket, seq: object,
                   files_before: dict[str, Any], reply: dict[str, Any]) -> None:
        """Stopped by a limit, or it ended the interpreter: everything of the cell goes, the pre-cell
        process is the session again."""
        self.kill_others(self.session_pids())
        # The worker lifts the cell's memory limit before the pre-cell process runs again: thawed
        # under the cell's limit, the pre-cell process would meet the OOM killer (a worker whose
        # event loop stalled for 2 s lost sessions so). It waits for the worker's "resume".
        try:
            proc.send(self.sock, {"op": Family.CELL_OVER, "seq": seq})
            self._await_resume(time.monotonic() + RESUME_WAIT_S)
        except OSError:
            pass
        thaw(pid)
        ready, _, _ = select.select([ch], [], [], SESSION_REPLY_S)
        got = None
        if ready:
            try:
                got = decode(ch.recv(MAX_MSG))
            except OSError:
                got = None
        if got is None or got.get("op") != Session.REAPED or not isinstance(got.get("wait_status"), int):
            self.end(sid)
            reply["lost"] = True
            return
        reply["wait_status"] = got["wait_status"]
        unrestored = got.get("unrestored")  # the pre-cell process's word, for its own session only
        if isinstance(unrestored, list):
            reply["unrestored"] = [str(x)[:300] for x in unrestored[:UNRESTORED_MAX]]
        self.freeze_all()
        reply["written"] = workdir.changed(files_before, workdir.listing(session_dir(self.top, sid)))

    def fork(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Fork session `sid` once per new sid, all at once: it reads each fork's channel and forks in
        turn while the forks already made set themselves up."""
        sid, new_sids = msg.get("sid"), msg.get("new_sids")
        if not isinstance(sid, int) or sid not in self.sessions or not isinstance(new_sids, list) \
                or not new_sids or len(new_sids) > FORKS_AT_ONCE \
                or not all(isinstance(n, int) and n not in self.sessions for n in new_sids) \
                or len(set(new_sids)) != len(new_sids):
            return {"op": Family.FORKED, "pids": None}
        pid, ch = self.sessions[sid]
        thaw(pid)  # it forks the new sessions; all are stopped again after
        self.refused = None
        started: list[tuple[int, socket.socket | None]] = []
        for new_sid in new_sids:  # it forks them one after the other while the first ones set up
            fork = {"op": Session.FORK, "sid": sid, "new_sid": new_sid, "apart": msg.get("apart") is True,
                    "snapshot": msg.get("snapshot") is True}

            def make(theirs: socket.socket, _: socket.socket, fork: dict[str, Any] = fork) -> bool:
                try:
                    socket.send_fds(ch, [encode(fork)], [theirs.fileno()])
                    return True
                except OSError:
                    return False

            started.append((new_sid, self.start_session(make)))
        deadline = time.monotonic() + SESSION_REPLY_S * (5 + len(new_sids))
        pids = [None if ours is None else self.greet(new_sid, ours, deadline) for new_sid, ours in started]
        if None in pids:
            proc.reap_children()
            try:  # a fork that refused itself has exited: its parent reaps it
                ch.send(encode({"op": Session.REAP}))
            except OSError:
                pass
        self.freeze_all()
        return {"op": Family.FORKED, "pids": pids, "refused": self.refused}

    def end(self, sid: object) -> None:
        pid, ch = self.sessions.pop(sid, (None, None)) if isinstance(sid, int) else (None, None)
        if ch is not None:
            ch.close()
        if pid is not None:
            send_signal(pid, signal.SIGKILL)
        proc.reap_children()
        for _, other in self.sessions.values():  # its parent may be one of them: it reaps it
            try:
                other.send(encode({"op": Session.REAP}))
            except OSError:
                pass
        if not isinstance(sid, int):
            return
        path = session_dir(self.top, sid)
        if os.path.lexists(path):
            proc.in_child("janitor", lambda: workdir.wipe_tree(path), self.cleanup_timeout_s)

    def serve(self) -> NoReturn:
        while True:
            ready, _, _ = select.select([self.sock], [], [], 1.0)
            proc.reap_children()
            if not ready:
                continue
            msg, fds = proc.next_request(self.sock)  # none: the worker is done with this family
            op = msg.get("op")
            if op == Family.CELL:
                reply = self.cell(msg, fds)
                proc.send(self.sock, reply)
                if reply.get("kept"):  # after the reply: until no process but the sessions' is left
                    self.kill_others(self.session_pids())
                continue
            proc.close_all(fds)
            if op == Family.FORK:
                proc.send(self.sock, self.fork(msg))
            elif op == Family.CLOSE:
                self.end(msg.get("sid"))
                proc.send(self.sock, {"op": Family.CLOSED, "sid": msg.get("sid")})
            elif op == Family.PING:
                proc.send(self.sock, {"op": Family.PONG})


def _set_up_family(msg: dict[str, Any], top: str) -> None:
    """The family's namespaces and work dir, then its uid: no capability survives."""
    uid = msg["uid"]
    proc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
    proc.mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    opts = f"size={msg['workdir_bytes']},nr_inodes={msg['workdir_inodes']},mode=0700,uid={uid},gid={uid}"
    proc.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode())
    proc.loopback_up()
    resource.setrlimit(resource.RLIMIT_NOFILE, (msg["nofile"], msg["nofile"]))  # the zygote's is higher
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    proc.set_dumpable(0)
    proc.install_abi_filter(msg.get("deny_filter"))
    proc.set_child_subreaper()
    os.chdir(top)
    for name in child.ZYGOTE_ONLY_ENV:
        os.environ.pop(name, None)


def _family_supervisor(sock: socket.socket, msg: dict[str, Any], pre: child.Preloaded,
                       cleanup_timeout_s: float) -> NoReturn:
    """PID 1 of a family (never returns): set up its namespaces, drop to its uid, serve its sessions."""
    try:
        _set_up_family(msg, pre.workdir)
    except BaseException as exc:
        proc.log("family set-up failed:", type(exc).__name__, exc)
        proc.hard_exit(SETUP_FAILED)
    supervisor = Supervisor(sock, pre.workdir, cleanup_timeout_s)
    # The worker moves us into the family's cgroup, then says go: the sessions start there.
    if proc.recv_or_exit(sock).get("op") != Family.GO:
        proc.hard_exit(0)
    os.mkdir(session_dir(pre.workdir, 0), 0o700)

    def first(theirs: socket.socket, ours: socket.socket) -> bool:
        def body() -> None:
            try:
                sock.close()
                ours.close()  # the supervisor's end of our channel: no session, cell or fork may hold it
                main = _prepare_session(pre)
                ch = socket.socket(fileno=os.dup(theirs.fileno()))
                theirs.close()
                session = SessionProcess(ch, main, pre.workdir)
                session.enter(0)
                proc.send(ch, {"op": Session.HELLO})
                session.loop()
            except BaseException as exc:
                proc.log("session start failed:", type(exc).__name__, exc)

        proc.spawn(body)
        return True

    pid = supervisor.new_session(0, first)
    if pid is None:
        proc.send(sock, {"op": Family.READY, "ok": False})
        proc.hard_exit(0)
    supervisor.freeze_all()
    proc.send(sock, {"op": Family.READY, "ok": True, "sid": 0, "pid": pid})
    supervisor.serve()


def _prepare_session(pre: child.Preloaded) -> types.ModuleType:
    """The first session process's set-up: a fresh __main__, fresh streams on /dev/null."""
    import stat

    main = child.prepare(pre)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    sockets = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                sockets.add(int(name))
        except OSError:
            pass
    proc.keep_only({0, 1, 2, *sockets})
    return main


def _create_family(ctl: socket.socket, msg: dict[str, Any], fds: list[int], pre: child.Preloaded,
                   cleanup_timeout_s: float) -> tuple[int, int] | None:
    """Fork a family's supervisor in new namespaces; send the worker a pidfd of it."""
    fid = msg.get("fid")
    if len(fds) != ONE_FD:
        proc.close_all(fds)
        proc.send(ctl, {"op": Ctl.CREATED, "fid": fid, "error": "expected one fd"})
        return None
    r, w = os.pipe()

    def middle() -> None:  # unshares, then forks the supervisor: PID 1 of the new pid namespace
        try:
            os.close(r)
            sock = socket.socket(fileno=fds[0])
            proc.keep_only({0, 1, 2, w, sock.fileno()})
            proc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID)

            def supervisor() -> None:
                os.close(w)
                _family_supervisor(sock, msg, pre, cleanup_timeout_s)

            os.write(w, str(proc.spawn(supervisor)).encode())
        except BaseException as exc:
            proc.log("family fork failed:", type(exc).__name__, exc)

    pid = proc.spawn(middle)
    os.close(w)
    os.close(fds[0])
    data = b""
    while chunk := os.read(r, 32):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    if not data.isdigit():
        proc.send(ctl, {"op": Ctl.CREATED, "fid": fid, "error": "the family's supervisor did not start"})
        return None
    sup = int(data)
    pidfd = os.pidfd_open(sup)
    socket.send_fds(ctl, [encode({"op": Ctl.CREATED, "fid": fid})], [pidfd])
    return sup, pidfd


def _end_family(made: tuple[int, int]) -> None:
    sup, pidfd = made
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    select.select([pidfd], [], [], 5.0)
    try:
        os.waitpid(sup, os.WNOHANG)
    except ChildProcessError:
        pass
    os.close(pidfd)


def serve_sessions(ctl: socket.socket, pre: child.Preloaded, cleanup_timeout_s: float) -> NoReturn:
    """A session jail's zygote: it forks families and reaps their supervisors (never returns)."""
    families: dict[object, tuple[int, int]] = {}
    while True:
        ready, _, _ = select.select([ctl], [], [], 1.0)
        proc.reap_children()  # supervisors whose family ended (they were re-parented to us)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctl, MAX_MSG, MAX_FDS)
        except OSError as exc:
            proc.log("control socket failed:", exc)
            os._exit(1)
        if not data:
            os._exit(0)
        msg = decode(data) or {}
        op = msg.get("op")
        if op == Ctl.CREATE:
            made = _create_family(ctl, msg, fds, pre, cleanup_timeout_s)
            if made is not None:
                families[msg.get("fid")] = made
            continue
        proc.close_all(fds)
        if op == Ctl.END:
            made = families.pop(msg.get("fid"), None)
            if made is not None:
                _end_family(made)
            proc.send(ctl, {"op": Ctl.ENDED, "fid": msg.get("fid")})
        elif op == Ctl.PING:
            proc.send(ctl, {"op": Ctl.PONG})
