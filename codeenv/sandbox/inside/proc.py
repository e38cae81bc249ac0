"""Process primitives of the jail's programs: libc (loaded once), prctl, seccomp, signals, fds, the
one fork, the one reaper, the one kill-all and the one wait for a child."""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from posix import _exit as hard_exit  # bound here: a program may replace os._exit

from .protocol import MAX_FDS, MAX_MSG, SETUP_FAILED, decode, encode

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ctypes
    from collections.abc import Callable
    from typing import Any, NoReturn

__all__ = ["hard_exit"]

PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER = 4, 22, 36
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 0x40000
MNT_DETACH = 2
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
SECCOMP_MODE_FILTER = 2
MADV_COLLAPSE = 14 + 11
#: Landlock's calls (the same numbers on every architecture) and its scopes (ABI 6, Linux 6.12).
LANDLOCK_CREATE_RULESET, LANDLOCK_RESTRICT_SELF = 444, 446
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, LANDLOCK_SCOPE_SIGNAL = 1, 2


class _Libc:
    handle: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """The C library, loaded once per process tree (children inherit the handle)."""
    if _Libc.handle is None:
        import ctypes

        _Libc.handle = ctypes.CDLL(None, use_errno=True)
    return _Libc.handle


def _prctl(option: int, *args: Any, what: str) -> None:
    import ctypes

    if libc().prctl(option, *args) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({what}) failed")


def set_dumpable(flag: int) -> None:
    _prctl(PR_SET_DUMPABLE, flag, 0, 0, 0, what="PR_SET_DUMPABLE")


def set_child_subreaper() -> None:
    _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0, what="PR_SET_CHILD_SUBREAPER")


def _fprog(program_hex: str) -> tuple[object, object]:
    """A seccomp filter program (classic BPF, hex) as prctl takes it: (struct sock_fprog, its buffer,
    which must live as long as the struct is used)."""
    import ctypes

    program = ctypes.create_string_buffer(bytes.fromhex(program_hex))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    return SockFprog(len(program.raw) // 8, ctypes.addressof(program)), program


def _install(prog: tuple[object, object]) -> None:
    """Stack `prog` (from `_fprog`: the struct and its buffer, both alive while the kernel copies it)."""
    import ctypes

    # nsjail has set no_new_privs.
    _prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog[0]),  # type: ignore[arg-type]
           ctypes.c_ulong(0), ctypes.c_ulong(0), what="PR_SET_SECCOMP")


def install_abi_filter(program_hex: str | None) -> None:
    """Stack a seccomp filter (classic BPF, built by the worker) on nsjail's: it kills any call made
    through a foreign ABI (the 32-bit entry, x32 numbers), and (a family's) what only the set-up may
    call. Fails closed: no filter, no zygote."""
    if program_hex:
        _install(_fprog(program_hex))


def enter_own_domain() -> None:
    """Put this process in a Landlock domain of its own, nested in the one it is in: from now on it and
    what it forks may signal, trace (and so read or write through /proc/PID/mem, environ, fd...) and
    reach by an abstract Unix socket only the processes of this domain and of domains nested in it.
    OSError when the kernel cannot: no Landlock or no scopes (ABI < 6: EINVAL, EOPNOTSUPP, ENOSYS), or
    16 domains deep (E2BIG)."""
    import ctypes

    attr = (ctypes.c_uint64 * 3)(0, 0, LANDLOCK_SCOPE_SIGNAL | LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET)
    fd = libc().syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(24),
                        ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:  # nsjail has set no_new_privs, which this needs
        if libc().syscall(ctypes.c_long(LANDLOCK_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)


class _Children:
    """What a call jail's zygote does at each fork (see `children_drop_caps`, `hold_pid_counter`).
    Everything a child needs is built here, once: a child only makes the system calls."""

    drop_caps = False
    #: capset's header and data (all capabilities empty), and the filter's sock_fprog and buffer.
    capset_args: tuple[object, object] | None = None
    fprog: tuple[object, object] | None = None
    #: The jail's pid counter (ns_last_pid), written back to `last_pid` before each fork.
    last_pid_fd: int | None = None
    last_pid = b""


def children_drop_caps(filter_hex: str | None) -> None:
    """Every child forked from now on drops this process's capabilities and stacks `filter_hex`
    (the calls only the zygote may make kill) before it does anything else."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)  # this thread
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable}, all empty
    _Children.capset_args = (header, data)
    _Children.fprog = _fprog(filter_hex) if filter_hex else None
    _Children.drop_caps = True


def unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python >= 3.12
        os.unshare(flags)
        return
    import ctypes

    if libc().unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def loopback_up() -> None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def hold_pid_counter(mount_point: str) -> None:
    """Keep the jail's pid counter (/proc/sys/kernel/ns_last_pid; the jail's /proc is read-only)
    through a /proc of our own, mounted at `mount_point` for a moment, and its present value: each
    fork from now on sets it back first, so every call's processes get the same pids whatever the
    last call forked (finding 14). Needs CAP_SYS_ADMIN in the jail's user namespace; the fd works
    for nobody without it, so a child that kept it could not move the counter either."""
    path = mount_point.encode()
    mount(b"proc", path, b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    try:
        fd = os.open(mount_point + "/sys/kernel/ns_last_pid", os.O_RDWR | os.O_CLOEXEC)
    finally:
        libc().umount2(path, MNT_DETACH)  # the fd keeps the mount; no path reaches it
    _Children.last_pid = os.pread(fd, 32, 0).strip()
    _Children.last_pid_fd = fd


def _first_in_child() -> None:
    """A call jail's child, before anything else: no capability (which empties the ambient set
    too), no pid counter, the filter. Any failure ends the child."""
    if _Children.last_pid_fd is not None:
        os.close(_Children.last_pid_fd)
        _Children.last_pid_fd = None
    _Children.drop_caps = False  # for its own children: they inherit all of this
    try:
        assert _Children.capset_args is not None
        if libc().capset(*_Children.capset_args) != 0:
            import ctypes

            raise OSError(ctypes.get_errno(), "capset")
        if _Children.fprog is not None:
            _install(_Children.fprog)
    except BaseException as exc:
        log("a child could not drop its capabilities:", repr(exc))
        hard_exit(SETUP_FAILED)


def compact_heap() -> int:
    """Make forks cheap: trim the heap, then back it with transparent huge pages.

    A fork copies one page-table entry per mapped page, and the child's exit tears them down;
    with the heap in 2 MB pages both cost a fraction (a copy-on-write fault in a child still
    copies only 4 kB). MADV_COLLAPSE works whenever THP is not disabled outright.
    """
    import ctypes

    lib = libc()
    try:
        lib.malloc_trim(0)
    except AttributeError:
        pass
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 2 << 20
    collapsed = 0
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:
        if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        start = (start + huge - 1) & ~(huge - 1)
        end &= ~(huge - 1)
        if end > start and lib.madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += end - start
    return collapsed


def immortalize() -> int:
    """Make every object alive now immortal (CPython 3.12+, a build with the GIL): what a fork shares
    then stays shared.

    A fork shares the zygote's pages until one side writes to them, and in Python merely using an
    object writes to it (its reference count). So after each fork the zygote's own loop, and each
    child, copied a page for every object they touched (per `print(1)` call: 235 page faults in the
    zygote and 423 in the child before, 134 and 293 with this). CPython skips the count of an
    immortal object (PEP 683: a 32-bit count of 2**32 - 1, as the interpreter's own constants
    have), so that work stops writing. Nothing the program can observe changes but
    `sys.getrefcount` of these objects and their memory never being freed, which the zygote, alive
    for the jail's life, would not free either. Objects the collector does not track (strings,
    numbers, untracked tuples) are reached from those it does.
    Returns the number of tracked objects made immortal (0 where the build has no immortal objects).
    """
    import ctypes
    import gc
    import sys
    import sysconfig

    if sys.version_info < (3, 12) or sysconfig.get_config_var("Py_GIL_DISABLED") or sys.byteorder != "little":
        return 0
    immortal = (0xFFFFFFFF).to_bytes(4, "little")  # the low half of ob_refcnt, as _Py_IMMORTAL_REFCNT
    memmove, referents, is_tracked = ctypes.memmove, gc.get_referents, gc.is_tracked
    # No set of what was done: an object written twice stays as it is, and a set of half a million
    # ids stayed in the heap as freed memory (a slot's three zygotes 212 MB with it; 165 MB without
    # it and with the pass before compact_heap's trim).
    made = 0
    for obj in gc.get_objects():
        memmove(id(obj), immortal, 4)
        made += 1
        for ref in referents(obj):
            if not is_tracked(ref):
                memmove(id(ref), immortal, 4)
    return made


def mount(source: bytes | None, target: bytes, fstype: bytes | None, flags: int, data: bytes | None) -> None:
    import ctypes

    if libc().mount(source, target, fstype, ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target!r}: {os.strerror(err)}")


def deaf_to_signals() -> None:
    """Make PID 1 deaf to its children's signals.

    The kernel drops every signal sent to a pid namespace's init from inside the namespace unless
    init has installed a handler for it (even SIGKILL and SIGSTOP). So the zygote keeps no handler
    at all: Python's SIGINT handler goes (a Python PID 1 gets KeyboardInterrupt from a child's
    SIGINT otherwise), and every other disposition stays the default or ignored. Children then
    inherit the dispositions of a fresh interpreter, less SIGINT's handler, which they put back.
    """
    for sig in signal.valid_signals():
        try:
            if signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass


def log(*parts: object) -> None:
    try:
        os.write(2, ("zygote: " + " ".join(str(p) for p in parts) + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.send(encode(msg))


def keep_only(keep: set[int]) -> None:
    """Close every fd but those in `keep`."""
    low = 0
    for fd in sorted(keep):
        if fd > low:  # os.closerange(0, 0) would close every fd (close_range(0, -1))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def next_message(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The next message on `sock` and the fds that came with it; the process exits (0) when the
    other end has closed it."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, MAX_FDS)
    except OSError:
        hard_exit(0)
    if not data:
        hard_exit(0)
    return data, fds


def next_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """`next_message` as a JSON object ({} for anything else) and its fds."""
    data, fds = next_message(sock)
    return decode(data) or {}, fds


def recv_or_exit(sock: socket.socket) -> dict[str, Any]:
    """The next message on `sock` (no fds; {} if it is not an object); the process exits (0) once the
    other end is gone."""
    try:
        data = sock.recv(MAX_MSG)
    except OSError:
        data = b""
    if not data:
        hard_exit(0)
    return decode(data) or {}


def fork() -> int:
    """The one fork of the jail's programs: 0 in the child, the child's pid in the parent."""
    if _Children.last_pid_fd is not None:
        try:
            os.pwrite(_Children.last_pid_fd, _Children.last_pid, 0)
        except OSError:
            pass
    pid = os.fork()
    if pid == 0 and _Children.drop_caps:
        _first_in_child()
    return pid


def spawn(body: Callable[[], object]) -> int:
    """Fork a child that runs `body()` and exits: SETUP_FAILED if `body` returns or raises (a
    program's child exits on its own, even if the program patched os._exit)."""
    pid = fork()
    if pid == 0:
        try:
            body()
        finally:
            hard_exit(SETUP_FAILED)
    return pid


def reap_children() -> int | None:
    """Reap every child that has ended, without waiting: how many, or None when no child is left."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return None
        if pid == 0:
            return reaped
        reaped += 1


def kill_all() -> None:
    """SIGKILL every process this one can signal (in a jail: every process of the pid namespace but
    ourselves), then reap them all."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reaped = reap_children()
        if reaped is None:
            return
        if not reaped:
            time.sleep(0.0005)


def in_child(name: str, work: Callable[[], object], timeout_s: float) -> bool:
    """Run `work()` in a forked child (never in the zygote); True if it finished within
    `timeout_s` and did not fail. A child that overruns is killed with everything else."""

    def body() -> NoReturn:
        code = 0
        try:
            work()
        except BaseException as exc:
            log(f"{name}:", type(exc).__name__, exc)
            code = 1
        os._exit(code)

    pid = spawn(body)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], timeout_s)
    os.close(pidfd)
    if not ready:
        kill_all()
        return False
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


#: What `wait_child` returns: the child ended, the deadline passed, or a handler said stop.
ENDED, TIMED_OUT, STOPPED = "child ended", "timed out", "stopped"


def wait_child(pidfd: int | None, deadline: float, handlers: dict[int, Callable[[], bool]]) -> str:
    """Wait for the child behind `pidfd` to end, until `deadline` (time.monotonic()); meanwhile
    call `handlers[fd]()` whenever that fd is readable (a handler that returns True ends the wait).
    Returns ENDED, TIMED_OUT or STOPPED."""
    poller = select.poll()
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    for fd in handlers:
        poller.register(fd, select.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return TIMED_OUT
        ended = False
        for fd, _ in poller.poll(max(1, int(remaining * 1000 + 0.999))):
            if fd == pidfd:
                ended = True
            elif handlers[fd]():
                return STOPPED
        if ended:
            return ENDED
