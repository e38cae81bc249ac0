"""A family's processes as its supervisor and sessions see them: through /proc (alive, stopped), by
signals (stopped and resumed between cells), and the random state a fork must carry over."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from .protocol import MAX_MSG

TYPE_CHECKING = False  # typing is not imported in the jail
if TYPE_CHECKING:
    from typing import Any

#: Time the kernel has to show a stopped session's threads stopped.
STOP_WAIT_S = 1.0


def sender_pid(sock: socket.socket) -> tuple[bytes, int | None]:
    """(message, the sending process's pid as the kernel saw it) from a socket with SO_PASSCRED."""
    import struct

    data, anc, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(12))
    pid = None
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
            pid = struct.unpack("3i", payload[:12])[0]
    return data, pid


def thread_count() -> int:
    """Threads of this process (a fork keeps one; those it drops may hold locks)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # unknown: as if there were others


def random_state() -> object:
    """The random module's own generator state: CPython reseeds it in every forked child, and a
    session's next cell (a fork) must find it as the last cell left it."""
    module = sys.modules.get("random")
    return module.getstate() if module is not None else None


def restore_random(state: Any) -> None:
    if state is not None:
        sys.modules["random"].setstate(state)


#: Process states (/proc/PID/stat's third field) of a process that has exited.
EXITED = (b"Z", b"X")


def proc_state(stat: str) -> bytes | None:
    """The state letter in the /proc stat file `stat`, or None if it cannot be read (gone)."""
    try:
        with open(stat, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: str) -> bool:
    """Whether process `pid` (a /proc entry's name) has not exited: a zombie has nothing left to kill."""
    state = proc_state(f"/proc/{pid}/stat")
    return state is not None and state not in EXITED


def stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (or gone), as /proc shows it."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(proc_state(f"/proc/{pid}/task/{task}/stat") in (None, b"T", b"t", *EXITED) for task in tasks)


def send_signal(pid: int, sig: int) -> bool:
    """Send `sig` to `pid`; False if it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_stopped(pid: int) -> bool:
    """Wait until the kernel shows every thread of `pid` stopped (at most STOP_WAIT_S); whether it does."""
    deadline = time.monotonic() + STOP_WAIT_S
    while not stopped(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0001)
    return True


def freeze(pid: int) -> None:
    """Stop an idle session's process, threads and all, and wait until the kernel shows it stopped: a
    session runs nothing between cells, and its CPU time ends when its cell's answer is made.

    One already stopped is not signalled again: a stopped process does not take a SIGSTOP off its
    queue, and a queued signal counts against the family's RLIMIT_SIGPENDING until it is resumed
    (each stopped sibling held one of the family's 64 while its siblings' cells ran)."""
    if not stopped(pid) and send_signal(pid, signal.SIGSTOP):
        wait_stopped(pid)


def thaw(pid: int) -> None:
    send_signal(pid, signal.SIGCONT)
