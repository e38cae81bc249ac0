"""The zygote: PID 1 of a jail. It preloads modules once, then forks a child per call.

Runs inside the jail under the image's interpreter, so it imports nothing but the standard library
and nothing from codeenv. It is started as ``python3 -s -B zygote.py CONFIG_JSON`` with a
SOCK_SEQPACKET control socket on fd 3 whose other end the worker holds.

Invariants it keeps (shared/DESIGN.md):

1. It never holds request bytes: a call arrives as limits (numbers) plus file descriptors (code and
   stdin memfds, stdout/stderr pipes, report and setup memfds) that it passes to the child unread.
2. The child cannot reach it: it is non-dumpable, keeps no signal handler (so the kernel drops its
   children's signals), and hands the child fds 0-2 only.
3. Nothing of a call survives: after each call it kills every other process in the jail, reaps them,
   and has a short-lived janitor child wipe the work dir if anything was left there.

Protocol (JSON messages; fds travel as SCM_RIGHTS with "run"):

    zygote -> worker  {"op": "hello", ...}                      preloaded and ready
    worker -> zygote  {"op": "run", "seq", limits...} + 6 fds   start a call (code, stdin, stdout,
                                                                stderr, report and setup memfds)
                      ... + 9 fds, "fetch": bool                also files to write into the work dir
                                                                (the child writes them), a list of
                                                                paths to fetch and a memfd for them
                                                                (a collector child reads them there
                                                                after the call, before the wipe)
    (no message)      a byte set in the setup memfd             written before the fork: from here
                                                                on the call counts as started
    zygote -> worker  {"op": "forked", "seq"}                   no spare child: a fresh one waits until
    worker -> zygote  {"op": "go", "seq"}                       the worker has raised its OOM score
    worker -> zygote  {"op": "kill", "seq"}                     stop the call now (output cap, cancel)
    zygote -> worker  {"op": "exited", "seq", status...}        every process of the call is gone
    zygote -> worker  {"op": "ready", "seq", "clean"}           traces wiped; ready for the next call
                                                                (folded into "exited" when the call
                                                                left nothing to wipe)
    worker -> zygote  {"op": "ping"}  ->  {"op": "pong"}        liveness
"""

import errno
import gc
import json
import os
import resource
import select
import signal
import socket
import stat
import sys
import time
from posix import _exit as _hard_exit  # bound here: a program may replace os._exit

# --- the protocol: what the worker (zygote_proc.py) and the zygote must agree on ---------------

#: The control socket's fd number in the jail (nsjail passes it through under the same number).
CTL_FD = 3
#: Largest control message, either way.
MAX_MSG = 65536
#: Size of a call's report and setup memfds. The setup memfd's last byte is the "started" mark.
REPORT_BYTES = 64 << 10
#: How long a freshly forked child waits for the worker's "go" (its OOM score raised).
GO_TIMEOUT_S = 10


class CallFd:
    """Positions of a call's fds in its "run" message (SCM_RIGHTS)."""

    CODE, STDIN, STDOUT, STDERR, REPORT, SETUP = range(6)
    FILES_IN, FETCH_LIST, FETCH_OUT = range(6, 9)  # only when the call has files in or out
    JUDGE = 6  # a judged call (see _judge_server): the socket of the worker's judge channel
    COUNTS = (6, 7, 9)  # a call sends one of these many fds

    @staticmethod
    def fits(msg, count):
        """Whether `count` fds is what a call like `msg` sends."""
        return count == 7 if msg.get("judge") in JUDGE_SERVED else count in (6, 9)


#: Judged calls served by a submission's process (a judge channel); "function_single" is one
#: function-call test run as a plain call (its arguments in the stdin memfd, its value reported).
JUDGE_SERVED = ("stdin", "function", "function_inline")


def frame(obj: object, limit: int | None = None) -> bytes:
    """Length-prefixed JSON, the one framing of the protocol's memfds: a 4-byte little-endian length,
    then the JSON, cut to `limit` bytes in all (a cut frame does not parse, and reads as nothing)."""
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()
    if limit is not None:
        data = data[: limit - 4]
    return len(data).to_bytes(4, "little") + data


def unframe(buf: bytes, limit: int) -> tuple[object, int]:
    """(the object, the offset after it) of the frame at the start of `buf`; ValueError unless it is
    a whole frame of at most `limit` bytes."""
    size = int.from_bytes(bytes(buf[:4]), "little")
    if len(buf) < 4 or not 0 < size <= limit - 4 or 4 + size > len(buf):
        raise ValueError(f"no frame of at most {limit} bytes")
    return json.loads(bytes(buf[4 : 4 + size])), 4 + size


def read_frame(fd: int, limit: int) -> object:
    """The object of the frame at the start of the memfd `fd` (ValueError if there is none)."""
    size = int.from_bytes(os.pread(fd, 4, 0), "little")
    if not 0 < size <= limit - 4:
        raise ValueError(f"no frame of at most {limit} bytes")
    return unframe(os.pread(fd, 4 + size, 0), limit)[0]


FILENAME = "main.py"
#: Environment the zygote's interpreter start-up needs but a program should not inherit.
ZYGOTE_ONLY_ENV = ("PYTHONMALLOC", "GLIBC_TUNABLES")
#: Exit code of a child whose setup (before user code) failed; the setup memfd says why.
SETUP_FAILED = 125
#: Where fetched files' contents start in the fetch-out memfd (a JSON index comes first).
FETCH_DATA_AT = 256 << 10
#: Time the collector has to copy the fetched files (the worker waits for "exited" meanwhile).
FETCH_TIMEOUT_S = 5

_config: dict = {}
_random_instances: list = []
_numpy_states: list = []


def _send(sock, msg):
    sock.send(json.dumps(msg, separators=(",", ":")).encode())


def _log(*parts):
    try:
        os.write(2, ("zygote: " + " ".join(str(p) for p in parts) + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


_prctl = None


def _set_dumpable(flag):
    global _prctl
    import ctypes

    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    if _prctl(4, flag, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def _install_abi_filter(program_hex):
    """Stack a seccomp filter (classic BPF, built by the worker) on nsjail's: it kills any call made
    through a foreign ABI (the 32-bit entry, x32 numbers). Fails closed: no filter, no zygote."""
    if not program_hex:
        return
    import ctypes

    program = ctypes.create_string_buffer(bytes.fromhex(program_hex))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program.raw) // 8, ctypes.addressof(program))
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    # PR_SET_SECCOMP (22), SECCOMP_MODE_FILTER (2); nsjail has set no_new_privs.
    if prctl(22, ctypes.c_ulong(2), ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


def _compact_heap():
    """Make forks cheap: trim the heap, then back it with transparent huge pages.

    A fork copies one page-table entry per mapped page, and the child's exit tears them down;
    with the heap in 2 MB pages both cost a fraction (a copy-on-write fault in a child still
    copies only 4 kB). MADV_COLLAPSE works whenever THP is not disabled outright.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
        if end > start and libc.madvise(start, end - start, 25) == 0:  # MADV_COLLAPSE
            collapsed += end - start
    return collapsed


def _deaf_to_signals():
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


def _preload(modules):
    errors = {}
    for name in modules:
        try:
            __import__(name)
        except BaseException as exc:  # a broken preload must not kill the zygote
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


#: Compiled and run once in the zygote before it freezes its heap, so every child finds the
#: compiler's and interpreter's lazily-built structures ready instead of building (and copying) them.
_WARMUP = """
import sys, io, traceback, linecache
def _f(a, *b, k=1, **kw):
    return [x * 2 for x in range(a)], {'k': k}, (b, kw), f"{a!r:>3}"
class _C:
    def m(self):
        return _f(3, 4, k=5, z=6)
try:
    _C().m()
    1 / 0
except ZeroDivisionError as e:
    traceback.format_exception(type(e), e, e.__traceback__)
print(sum(range(10)), file=io.StringIO())
"""


def _warm_up(extra):
    for source in (_WARMUP, extra or ""):
        for _ in range(2):
            try:
                exec(compile(source, "<warmup>", "exec", dont_inherit=True), {"__name__": "__warmup__"})
            except BaseException as exc:
                _log("warm-up failed:", type(exc).__name__, exc)
                break


def _collect_generators():
    """Random generators created at import time; every child reseeds them (invariant 5)."""
    import random

    np_random_state = None
    if "numpy.random" in sys.modules:
        np_random_state = sys.modules["numpy.random"].RandomState
    for obj in gc.get_objects():
        if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
            if obj is not random._inst:  # random reseeds its own instance after every fork
                _random_instances.append(obj)
        elif np_random_state is not None and isinstance(obj, np_random_state):
            _numpy_states.append(obj)


def _workdir_usage():
    st = os.statvfs(_config["workdir"])
    return st.f_files - st.f_ffree, st.f_blocks - st.f_bfree


# --- the child ---------------------------------------------------------------------------------


def _write_report(report, obj):
    data = frame(obj, len(report))
    report[: len(data)] = data


def _exception_report(exc):
    line = None
    if isinstance(exc, SyntaxError) and exc.filename == FILENAME:
        line = exc.lineno
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == FILENAME:
            line = tb.tb_lineno
        tb = tb.tb_next
    try:
        message = str(exc)
    except BaseException:
        message = "<exception str() failed>"
    return {"type": type(exc).__name__, "message": message[:4000], "line": line}


def _exit_code(exc):
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except BaseException:
        pass
    return 1


def _finalize(code):
    """What the interpreter does on exit: join threads, run atexit, flush the streams."""
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is None or stream.closed:
                continue  # as CPython: a stream set to None or closed is not flushed
            stream.flush()
        except BaseException:
            if stream is sys.stdout and code == 0:
                code = 120  # as CPython does when flushing stdout fails at exit
    return code


def _unused_stdio():
    """Std streams on fds 0-2 as a fresh interpreter makes them, built once and never used here.

    Each child gets its own copy with the fork and points fds 0-2 at its call's files: fresh
    streams without paying for three wrappers per call.
    """
    import io

    def text(fd, mode, old):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffered, encoding=old.encoding, errors=old.errors,
            line_buffering=old.line_buffering, write_through=old.write_through,
        )

    return text(0, "r", sys.__stdin__), text(1, "w", sys.__stdout__), text(2, "w", sys.__stderr__)


_stdio = None


def _prepare():
    """The part of a child's set-up that needs no call: a spare child does it before one arrives."""
    import builtins
    import types

    os.setsid()
    # SIGPIPE and SIGXFSZ are already ignored, as CPython does at start-up; see _deaf_to_signals.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    # Stays non-dumpable, as forked from the zygote: no core dump, no /proc entries others may open
    # (the seccomp policy kills a call that makes itself dumpable again).
    os.chdir(_config["workdir"])
    for name in ZYGOTE_ONLY_ENV:
        os.environ.pop(name, None)
    sys.stdin = sys.__stdin__ = _stdio[0]
    sys.stdout = sys.__stdout__ = _stdio[1]
    sys.stderr = sys.__stderr__ = _stdio[2]
    for rng in _random_instances:
        rng.seed()
    if _numpy_states:
        # 128 bits from the kernel; seed(None) would build a SeedSequence (10x slower).
        words = sys.modules["numpy"].frombuffer(os.urandom(16), dtype="uint32")
        for state in _numpy_states:
            state.seed(words)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = [FILENAME]
    sys.path[0] = _config["workdir"]
    return main


def _spare(sock):
    """A child forked ahead of demand: prepared, it waits for its call's fds (never returns)."""
    fds = []
    try:
        os.closerange(3, sock.fileno())
        os.closerange(sock.fileno() + 1, 1 << 20)
        main = _prepare()
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 16)
        if not data or len(fds) not in CallFd.COUNTS:
            _hard_exit(SETUP_FAILED)
        msg = json.loads(data)
        sock.close()
        if not CallFd.fits(msg, len(fds)):
            raise ValueError(f"{len(fds)} fds do not fit the call")
    except BaseException as exc:
        if len(fds) in CallFd.COUNTS:
            _report_setup_error(fds[CallFd.SETUP], exc)
        _hard_exit(SETUP_FAILED)
    if msg.get("judge") in JUDGE_SERVED:
        _judge_server(fds, msg, main)
    _child(fds, msg, main)


def _read_all(fd):
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _dir_beneath(dirs, create):
    """An fd of the directory `dirs` (a list of names) under the work dir, made if `create`; no link
    is followed on the way."""
    fd = os.open(_config["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in dirs:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_files(files_fd):
    """In the child, before user code: write the call's input files into the work dir.

    The memfd holds a frame with the index [[path, size], ...], then the contents. Paths were
    checked by the worker (relative, no "..", no NUL); directories are made as needed and no link
    is followed.
    """
    blob = _read_all(files_fd)
    if not blob:
        return
    index, offset = unframe(blob, len(blob))
    for path, length in index:
        *dirs, name = path.split("/")
        fd = _dir_beneath(dirs, create=True)
        try:
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                          dir_fd=fd)
            try:
                view = memoryview(blob)[offset:offset + length]
                while view:
                    view = view[os.write(out, view):]
            finally:
                os.close(out)
        finally:
            os.close(fd)
        offset += length


def _open_beneath(path):
    """Open a file under the work dir without following any link (a FIFO does not block)."""
    *dirs, name = path.split("/")
    fd = _dir_beneath(dirs, create=False)
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def _fetch_files(list_fd, out_fd):
    """In a collector child, after the call: copy the requested files into the fetch-out memfd.

    Only regular files, no link followed, at most the memfd's room in all; anything else is
    refused by name. The index (JSON {"files": {path: [offset, size]}, "errors": {path: why}})
    goes at the start, the contents from FETCH_DATA_AT.
    """
    paths = json.loads(_read_all(list_fd) or b"[]")
    room = os.fstat(out_fd).st_size - FETCH_DATA_AT
    offset = FETCH_DATA_AT
    files, errors = {}, {}
    for path in paths:
        try:
            fd = _open_beneath(path)
        except FileNotFoundError:
            errors[path] = "no such file"
            continue
        except OSError as exc:
            errors[path] = "a symbolic link" if exc.errno == errno.ELOOP else f"cannot open: {os.strerror(exc.errno)}"
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                errors[path] = "not a regular file"
                continue
            if st.st_size > room - (offset - FETCH_DATA_AT):
                errors[path] = f"{st.st_size} bytes: more than the {room - (offset - FETCH_DATA_AT)} left to fetch"
                continue
            start = offset
            while offset - start < st.st_size:
                chunk = os.read(fd, min(1 << 20, st.st_size - (offset - start)))
                if not chunk:
                    break
                os.pwrite(out_fd, chunk, offset)
                offset += len(chunk)
            files[path] = [start, offset - start]
        finally:
            os.close(fd)
    index = frame({"files": files, "errors": errors})
    if len(index) > FETCH_DATA_AT:
        index = frame({"files": {}, "errors": {p: "too many files to fetch" for p in paths}})
    os.pwrite(out_fd, index, 0)


def _report_uncaught(report, exc):
    """An uncaught exception of the program: in the report (type, message, line) and on stderr, as
    the interpreter prints it (through the program's own excepthook, if it set one)."""
    try:
        _write_report(report, {"error": _exception_report(exc)})
    except BaseException:
        pass
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:  # e.g. _exec_displaying_last
        tb = tb.tb_next
    try:
        if sys.excepthook is sys.__excepthook__:
            # 3.12's built-in hook reads source lines from disk, not from linecache.
            import traceback

            traceback.print_exception(type(exc), exc.with_traceback(tb), tb, file=sys.stderr)
        else:
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    except BaseException:
        pass


def _report_setup_error(setup_fd, exc):
    # The setup memfd is closed before user code runs, so only a real setup failure (never the
    # program) can report one: the worker turns it into internal_error.
    try:
        os.pwrite(setup_fd, frame({"setup_error": f"{type(exc).__name__}: {exc}"[:2000]}, REPORT_BYTES - 1), 0)
    except BaseException:
        pass


#: Characters of a displayed value kept (its JSON, \u-escaped, must fit the report memfd).
VALUE_CHARS = 8192


def _exec_displaying_last(code, namespace, report):
    """Run `code`; if its last top-level statement is an expression, report that value's repr as
    Jupyter shows it (nothing for None)."""
    import ast

    tree = ast.parse(code, FILENAME)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, FILENAME, "exec", dont_inherit=True), namespace)
    if last is None:
        return
    value = eval(compile(ast.Expression(last.value), FILENAME, "eval", dont_inherit=True), namespace)
    if value is not None:
        _write_report(report, {"value": repr(value)[:VALUE_CHARS]})


def _child(fds, limits, main=None):
    """Runs in the forked child; never returns."""
    import mmap

    code_fd, stdin_fd, out_fd, err_fd = fds[CallFd.CODE], fds[CallFd.STDIN], fds[CallFd.STDOUT], fds[CallFd.STDERR]
    report_fd, setup_fd = fds[CallFd.REPORT], fds[CallFd.SETUP]
    report = None
    fn_name = args = None
    try:
        if main is None:
            main = _prepare()
        report = mmap.mmap(report_fd, os.fstat(report_fd).st_size)
        size = os.fstat(code_fd).st_size
        code = os.pread(code_fd, size, 0) if size else b""
        if limits.get("judge") == "function_single":
            fn_name, args = limits["fn_name"], json.loads(_read_all(stdin_fd) or b"[]")
            stdin_fd = os.open("/dev/null", os.O_RDONLY)  # a function-call test has no input
        if len(fds) > CallFd.FILES_IN:
            _write_files(fds[CallFd.FILES_IN])
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # Every fd above 2 goes, the control socket included; the setup memfd last (below).
        os.closerange(3, setup_fd)
        os.closerange(setup_fd + 1, 1 << 20)
        cpu = limits["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        import linecache

        source = code.decode("utf-8", "replace")
        linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
        del code_fd, stdin_fd, out_fd, err_fd, report_fd, fds
        os.close(setup_fd)
    except BaseException as exc:
        _report_setup_error(setup_fd, exc)
        _hard_exit(SETUP_FAILED)

    status = 0
    try:
        if limits.get("display_last"):
            _exec_displaying_last(code, main.__dict__, report)
        else:
            exec(compile(code, FILENAME, "exec", dont_inherit=True), main.__dict__)
        if fn_name is not None:
            _report_value(report, _call_function(main.__dict__, fn_name, args))
    except SystemExit as exc:
        status = _exit_code(exc)
    except BaseException as exc:
        status = 1
        _report_uncaught(report, exc)
    _hard_exit(_finalize(status))


# --- a judged call: one process per submission, one child per test -----------------------------


def _keep_only(keep):
    """Close every fd but those in `keep`."""
    low = 0
    for fd in sorted(keep):
        if fd > low:  # os.closerange(0, 0) would close every fd (close_range(0, -1))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def _set_child_subreaper():
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _shared_with_forks(own_fds):
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


def _shareable(own_fds):
    """Why the state after a submission's top-level code cannot be shared by forking (None if it can):
    a fork keeps neither threads nor children, each test must find the work dir as it was, and no
    test may leave anything for the next in memory or files the forks share."""
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
    if not _untouched(_baseline):
        return "its top-level code changed the work dir"
    shared = _shared_with_forks(own_fds)
    if shared is not None:
        return f"its top-level code left {shared}, which tests would share"
    return None


def _call_function(namespace, fn_name, args):
    """fn_name(*args): a method of a LeetCode-style `class Solution`, or a plain function."""
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, fn_name):
        return getattr(solution(), fn_name)(*args)
    fn = namespace.get(fn_name)
    if fn is None:
        raise NameError(f"name {fn_name!r} is not defined")
    return fn(*args)


def _report_value(report, value):
    try:
        data = frame({"value": value})
    except (TypeError, ValueError, RecursionError):
        try:
            text = repr(value)[:4000]
        except BaseException:
            text = "<repr() failed>"
        data = frame({"unserializable": text})
    if len(data) > len(report):
        data = frame({"too_large": len(data)})
    report[: len(data)] = data


def _test_child(fds, msg, main, compiled, mode, fn_name):
    """One test, forked from the submission's process; never returns."""
    import mmap

    setup_fd = fds[CallFd.SETUP]
    try:
        report = mmap.mmap(fds[CallFd.REPORT], os.fstat(fds[CallFd.REPORT]).st_size)
        args = None
        if mode != "stdin":
            args = json.loads(_read_all(fds[CallFd.CODE]) or b"[]")
        os.dup2(fds[CallFd.STDIN], 0)
        os.dup2(fds[CallFd.STDOUT], 1)
        os.dup2(fds[CallFd.STDERR], 2)
        _keep_only({0, 1, 2, setup_fd})
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]  # the submission's process's: no higher
        resource.setrlimit(resource.RLIMIT_CPU, (min(msg["cpu_s"], hard), hard))
        del fds
        os.close(setup_fd)
    except BaseException as exc:
        _report_setup_error(setup_fd, exc)
        _hard_exit(SETUP_FAILED)
    status = 0
    try:
        if mode != "function":  # stdin tests, or function tests that cannot share a prepared state
            exec(compiled, main.__dict__)
        if mode != "stdin":
            _report_value(report, _call_function(main.__dict__, fn_name, args))
    except SystemExit as exc:
        status = _exit_code(exc)
    except BaseException as exc:
        status = 1
        _report_uncaught(report, exc)
    _hard_exit(_finalize(status))


def _next_message(sock):
    """The next message on `sock` and the fds that came with it; the process exits (0) when the
    other end has closed it."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 16)
    except OSError:
        _hard_exit(0)
    if not data:
        _hard_exit(0)
    return data, fds


def _next_request(sock):
    """`_next_message` as a JSON object ({} for anything else) and its fds."""
    data, fds = _next_message(sock)
    try:
        msg = json.loads(data)
    except ValueError:
        msg = None
    return (msg if isinstance(msg, dict) else {}), fds


def _serve_tests(sock, main, compiled, mode, fn_name):
    """Fork a child per test the worker sends; answer "done" once every process of it is gone and
    the work dir is as it was (never returns)."""
    while True:
        data, fds = _next_message(sock)  # none: the worker is done with this submission
        msg = json.loads(data)
        if msg.get("op") != "test" or len(fds) != 6:
            for fd in fds:
                os.close(fd)
            continue
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                _test_child(fds, msg, main, compiled, mode, fn_name)
            finally:
                _hard_exit(SETUP_FAILED)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.register(sock, select.POLLIN)
        deadline = t0 + msg["wall_s"]
        timed_out = killed = ended = False
        while not ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for fd, _ in poller.poll(max(1, int(remaining * 1000 + 0.999))):
                if fd == pidfd:
                    ended = True
                elif fd == sock.fileno():
                    data = sock.recv(MAX_MSG)
                    if not data:
                        _hard_exit(0)
                    if json.loads(data).get("op") == "kill":
                        killed = True
                        os.kill(-1, signal.SIGKILL)
        wall = time.monotonic() - t0
        if not ended:
            os.kill(-1, signal.SIGKILL)
        _, status, usage = os.wait4(pid, 0)
        os.close(pidfd)
        _kill_everything()  # what the test left behind (orphans come to us: we are their subreaper)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        clean = _clean(_baseline, _config["cleanup_timeout_s"])
        _reset_workdir_times()
        _send(sock, {"op": "done", "i": msg.get("i"), "wait_status": status, "wall_s": wall,
                     "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
                     "maxrss_kb": usage.ru_maxrss, "timed_out": timed_out, "killed": killed, "clean": clean})


def _judge_server(fds, msg, main):
    """A judged call's child: the submission's process. It compiles the code once (for function-call
    tests it also runs its top-level code once), then forks one child per test (never returns).

    The worker's judge channel (fd JUDGE, SOCK_SEQPACKET) carries:

        us -> worker  {"op": "prepared", "cpu_s"}                  ready for tests
                      {"op": "prepared", "compile_error", "stderr"} the code does not compile
                      {"op": "prepared", "unshared": why}           function tests whose top-level state
                                                                    a fork cannot keep: the worker asks
                                                                    again with judge=function_inline
        worker -> us  {"op": "test", "i", "cpu_s", "wall_s"} + 6 fds (as a call's; CODE holds the args)
        worker -> us  {"op": "kill"}                               stop the running test
        us -> worker  {"op": "done", "i", "wait_status", "wall_s", "cpu_s", "maxrss_kb", ...}

    With function-call tests this process has run the submission's code: the worker believes nothing
    it says beyond what a program could say about itself, and measures and enforces limits from outside.
    """
    mode, fn_name = msg["judge"], msg.get("fn_name")
    setup_fd = fds[CallFd.SETUP]
    try:
        if main is None:
            main = _prepare()
        code = _read_all(fds[CallFd.CODE])
        os.dup2(fds[CallFd.STDIN], 0)
        os.dup2(fds[CallFd.STDOUT], 1)
        os.dup2(fds[CallFd.STDERR], 2)
        sock_fd = fds[CallFd.JUDGE]
        _keep_only({0, 1, 2, setup_fd, sock_fd})
        cpu = msg["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
        resource.setrlimit(resource.RLIMIT_FSIZE, (msg["fsize_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (msg["nofile"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        _set_child_subreaper()
        import linecache

        source = code.decode("utf-8", "replace")
        linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
        sock = socket.socket(fileno=sock_fd)
        del fds
        os.close(setup_fd)
    except BaseException as exc:
        _report_setup_error(setup_fd, exc)
        _hard_exit(SETUP_FAILED)
    try:
        compiled = compile(code, FILENAME, "exec", dont_inherit=True)
    except BaseException as exc:  # SyntaxError, a NUL byte, too deep to compile, out of memory
        import traceback

        text = "".join(traceback.format_exception_only(type(exc), exc))
        _send(sock, {"op": "prepared", "compile_error": _exception_report(exc), "stderr": text[-8000:]})
        _hard_exit(0)
    if mode == "function":
        why = None
        try:
            exec(compiled, main.__dict__)
        except BaseException:  # every test fails the same way: each runs the top-level code itself
            why = "its top-level code failed"
        why = why or _shareable({0, 1, 2, sock.fileno()})
        if why is not None:
            _send(sock, {"op": "prepared", "unshared": why})
            _hard_exit(0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _send(sock, {"op": "prepared", "cpu_s": usage.ru_utime + usage.ru_stime})
    _serve_tests(sock, main, compiled, mode, fn_name)


# --- sessions: a family of live interpreters per fork of a session jail's zygote ---------------
#
# In a session jail the zygote runs as the jail's root (in the jail's user namespace; a host uid of
# its own) and keeps CAP_SETUID, CAP_SETGID, CAP_SYS_ADMIN and CAP_NET_ADMIN there. It runs no
# call. Per family (a session and its forks) it forks a supervisor in new pid, mount, network and
# IPC namespaces: PID 1 of the family. The supervisor mounts the family's own /proc and work dir
# (a tmpfs), brings up its loopback, drops to the family's uid (no capability survives), stacks a
# seccomp filter that kills mount/unshare/set*id, and only then forks the first session process.
# It runs no user code; user code cannot signal it (a namespace's init ignores signals it has no
# handler for), trace it (the policy kills ptrace) or read it (non-dumpable).
#
# Family socket (worker <-> supervisor, SOCK_SEQPACKET):
#
#     worker -> sup  {"op": "go"}                                  the supervisor is in its cgroup
#     sup -> worker  {"op": "ready", "sid": 0}                     the first session is idle
#     worker -> sup  {"op": "cell", "sid", "seq", limits...} + 6 fds (as a call's)
#     sup -> worker  {"op": "cell_done", "seq", "kept", "wait_status", "exit_code", "timed_out",
#                     "killed", "wall_s", "lost", "written"}
#     worker -> sup  {"op": "kill", "seq"}                         stop the running cell (rolled back)
#     worker -> sup  {"op": "fork", "sid", "new_sid"}  ->  {"op": "forked", "new_sid", "ok"}
#     worker -> sup  {"op": "close", "sid"}  ->  {"op": "closed", "sid"}
#     worker -> sup  {"op": "ping"}  ->  {"op": "pong"}
#
# A cell runs in a fork of its session's process: the process before the cell (the "pre-cell"
# process) is stopped (SIGSTOP, its threads too) while the cell runs. A cell that ends by itself
# (normally, with an exception, with SystemExit) becomes the session and the pre-cell process is
# killed; a cell stopped by a limit is killed with everything it started, and the pre-cell process
# is resumed: the session is exactly as before the cell, without replay.

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 0x40000
#: Time a pre-cell process has to report its cell's end after it is resumed.
SESSION_REPLY_S = 2.0
#: Files listed as written by a rolled-back cell, at most.
WRITTEN_MAX = 100


def _libc():
    global _libc_handle
    if _libc_handle is None:
        import ctypes

        _libc_handle = ctypes.CDLL(None, use_errno=True)
    return _libc_handle


_libc_handle = None


def _mount(source, target, fstype, flags, data):
    import ctypes

    libc = _libc()
    if libc.mount(source, target, fstype, ctypes.c_ulong(flags), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _unshare(flags):
    if hasattr(os, "unshare"):  # Python >= 3.12
        os.unshare(flags)
        return
    import ctypes

    libc = _libc()
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _loopback_up():
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, ifreq))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))  # SIOCSIFFLAGS, IFF_UP


def _sender_pid(sock):
    """(message, the sending process's pid as the kernel saw it) from a socket with SO_PASSCRED."""
    import struct

    data, anc, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(12))
    pid = None
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
            pid = struct.unpack("3i", payload[:12])[0]
    return data, pid


def _session_dir(sid):
    return f"{_config['workdir']}/s{sid}"


def _enter_session(sid):
    """In a session's process: its own dir, HOME and TMPDIR."""
    path = _session_dir(sid)
    os.chdir(path)
    os.environ["HOME"] = os.environ["TMPDIR"] = path
    sys.path[0] = path
    if "tempfile" in sys.modules:  # its cached dir is the zygote's; TMPDIR says ours (no import: 10 ms)
        sys.modules["tempfile"].tempdir = None


def _session_loop(ch, main):
    """A session's process: it waits for a cell (or a fork) on its channel (never returns).

    A cell's process that ends by itself, and a fork, carry on in this same loop (no call nests: a
    session lives through any number of cells)."""
    while True:
        msg, fds = _next_request(ch)  # none: the supervisor is gone
        op = msg.get("op")
        if op == "cell" and len(fds) == 7:
            _reap_children()  # only the cell's process may be our child while it runs
            state = _random_state()
            threads = _threads()
            pid = os.fork()
            if pid == 0:
                try:
                    ch.close()
                    _restore_random(state)
                    ch = _cell_child(fds, msg, main, fresh_streams=threads > 1)
                except BaseException:
                    _hard_exit(SETUP_FAILED)
                continue  # the cell ended by itself: this process is the session now
            for fd in fds:
                os.close(fd)
            try:
                _, status = os.waitpid(pid, 0)  # reached only if the cell does not become the session
            except ChildProcessError:
                status = SETUP_FAILED << 8
            try:
                _send(ch, {"op": "reaped", "wait_status": status})
            except OSError:
                _hard_exit(0)
        elif op == "fork" and len(fds) == 1:
            state = _random_state()
            pid = os.fork()
            if pid == 0:  # the new session: our child until we end (then the supervisor's)
                try:
                    ch.close()
                    _restore_random(state)
                    ch = _forked_session(fds[0], msg)
                except BaseException:
                    _hard_exit(SETUP_FAILED)
                continue
            os.close(fds[0])
        elif op == "reap":  # a fork of ours was closed: its process is gone, reap it
            for fd in fds:
                os.close(fd)
            _reap_children()
        else:
            for fd in fds:
                os.close(fd)


def _threads():
    """Threads of this process (a fork keeps one; those it drops may hold locks)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # unknown: as if there were others


def _reap_children():
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


def _random_state():
    """The random module's own generator state: CPython reseeds it in every forked child, and a
    session's next cell (a fork) must find it as the last cell left it."""
    module = sys.modules.get("random")
    return module.getstate() if module is not None else None


def _restore_random(state):
    if state is not None:
        sys.modules["random"].setstate(state)


def _forked_session(ch_fd, msg):
    """A new session made from this one's state: it copies its dir; returns its channel."""
    ch = socket.socket(fileno=ch_fd)
    ok = True
    try:
        _copy_tree(_session_dir(msg["sid"]), _session_dir(msg["new_sid"]))
    except BaseException:
        ok = False  # e.g. the family's work dir is full: the fork has a fresh dir instead
        try:
            os.mkdir(_session_dir(msg["new_sid"]), 0o700)
        except OSError:
            pass
    _enter_session(msg["new_sid"])
    _send(ch, {"op": "hello", "copied": ok})
    return ch


def _copy_tree(src, dst):
    """Copy a session's dir for its fork: files, dirs and links as they are (no link followed)."""
    os.mkdir(dst, 0o700)
    with os.scandir(src) as entries:
        for entry in entries:
            target = os.path.join(dst, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir(follow_symlinks=False):
                _copy_tree(entry.path, target)
            elif entry.is_file(follow_symlinks=False):
                fin = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode & 0o777
                    fout = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
                    try:
                        while os.copy_file_range(fin, fout, 1 << 30):
                            pass
                    finally:
                        os.close(fout)
                finally:
                    os.close(fin)
            # FIFOs, sockets and devices are not copied


_retired_streams = []


def _fresh_stdio():
    """New std streams on fds 0-2: a lock a thread held in the old ones (say, stdout's, while it
    printed when the cell's fork happened) stays with the old objects."""
    import io

    # The old objects are kept, never freed here: freeing flushes them, and a flush would wait forever
    # for a lock that a thread of the session's process (which the fork did not copy) held.
    _retired_streams.append((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
    streams = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        streams.append(io.TextIOWrapper(buffered, encoding="utf-8", errors="strict" if fd == 0 else "backslashreplace",
                                        line_buffering=False))
    sys.stdin = sys.__stdin__ = streams[0]
    sys.stdout = sys.__stdout__ = streams[1]
    sys.stderr = sys.__stderr__ = streams[2]


def _cell_child(fds, msg, main, fresh_streams):
    """One cell, in a fork of the session's process. Once it ends by itself, this process is the
    session: returns its channel. `fresh_streams`: the session's process had other threads, which
    may hold the std streams' locks (the fork did not copy them), so the cell gets new streams."""
    import mmap

    setup_fd = fds[CallFd.SETUP]
    try:
        ch = socket.socket(fileno=fds[6])
        _send(ch, {"op": "started"})  # the supervisor learns our pid from the kernel (SO_PASSCRED)
        report = mmap.mmap(fds[CallFd.REPORT], os.fstat(fds[CallFd.REPORT]).st_size)
        code = _read_all(fds[CallFd.CODE])
        saved = [os.dup(0), os.dup(1), os.dup(2)]
        os.dup2(fds[CallFd.STDIN], 0)
        os.dup2(fds[CallFd.STDOUT], 1)
        os.dup2(fds[CallFd.STDERR], 2)
        for fd in fds[:6]:
            if fd != setup_fd:
                os.close(fd)
        # Soft limits only: the cell that ends normally is the session, and its next cell may need more.
        limits = {}
        for which, value in ((resource.RLIMIT_CPU, msg["cpu_s"]), (resource.RLIMIT_FSIZE, msg["fsize_bytes"]),
                             (resource.RLIMIT_NOFILE, msg["nofile"])):
            limits[which] = soft, hard = resource.getrlimit(which)
            resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))
        if fresh_streams:
            _fresh_stdio()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import linecache

        name = f"<cell {msg.get('n', '?')}>"
        source = code.decode("utf-8", "replace")
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        os.close(setup_fd)
    except BaseException as exc:
        _report_setup_error(setup_fd, exc)
        _hard_exit(SETUP_FAILED)
    global FILENAME
    FILENAME = name  # tracebacks and the error's line name the cell
    exit_code = 0
    try:
        _exec_displaying_last(code, main.__dict__, report)
    except SystemExit as exc:
        exit_code = _exit_code(exc)
    except BaseException as exc:
        exit_code = 1
        _report_uncaught(report, exc)
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
    try:
        _send(ch, {"op": "done", "exit_code": exit_code})
    except OSError:
        _hard_exit(0)
    return ch


def _alive(pid):
    """Whether process `pid` (a /proc entry's name) has not exited: a zombie has nothing left to kill."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class _Family:
    """The supervisor's account of its sessions: sid -> (pid, channel)."""

    def __init__(self, sock):
        self.sock = sock
        self.sessions = {}

    def session_pids(self):
        return {pid for pid, _ in self.sessions.values()}

    def kill_others(self, keep, once=False):
        """SIGKILL every process of the family but the supervisor and `keep` (again, until a look at
        /proc finds none alive: one may have forked meanwhile; `once`: one round); reap what is ours."""
        for attempt in range(1 if once else 200):
            victims = []
            for name in os.listdir("/proc"):
                if name.isdigit() and int(name) != 1 and int(name) not in keep and _alive(name):
                    victims.append(int(name))
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _reap_children()
            if attempt:
                time.sleep(0.001)

    def new_session(self, sid, make):
        """A session process: `make(ch_fd)` runs in a child (forked here or by a session) and says
        hello; returns its pid, or None."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        ok = make(theirs)
        theirs.close()
        if not ok:
            ours.close()
            return None
        ready, _, _ = select.select([ours], [], [], SESSION_REPLY_S * 5)
        if not ready:
            ours.close()
            return None
        try:
            data, pid = _sender_pid(ours)
        except OSError:
            data, pid = b"", None
        if not data or pid is None:
            ours.close()
            return None
        self.sessions[sid] = (pid, ours)
        return pid

    def cell(self, msg, fds):
        sid = msg.get("sid")
        seq = msg.get("seq")
        reply = {"op": "cell_done", "seq": seq, "kept": False, "wait_status": 0, "exit_code": None,
                 "timed_out": False, "killed": False, "wall_s": 0.0, "lost": False, "written": []}
        if sid not in self.sessions or len(fds) != 6:
            for fd in fds:
                os.close(fd)
            reply.update(lost=True, refused="no such session here")
            return reply
        pid, ch = self.sessions[sid]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        t0 = time.monotonic()
        files_before = _listing(_session_dir(sid))
        try:
            socket.send_fds(ch, [json.dumps(msg).encode()], [*fds, theirs.fileno()])
            sent = True
        except OSError:
            sent = False
        theirs.close()
        for fd in fds:
            os.close(fd)
        deadline = t0 + msg["wall_s"]
        cell_pid = None
        if sent:
            ready, _, _ = select.select([ours], [], [], max(0.0, deadline - time.monotonic()) + SESSION_REPLY_S)
            if ready:
                try:
                    data, cell_pid = _sender_pid(ours)
                    if not data:
                        cell_pid = None
                except OSError:
                    cell_pid = None
        if cell_pid is None:  # the session's process is gone or does not answer: the session is lost
            ours.close()
            self.end(sid)
            reply["lost"] = True
            return reply
        try:
            os.kill(pid, signal.SIGSTOP)  # the pre-cell process, threads and all, waits
        except ProcessLookupError:
            pass
        try:  # the worker makes the cell's processes the first the OOM killer takes
            _send(self.sock, {"op": "cell_started", "seq": seq})
        except OSError:
            pass
        try:
            cell_fd = os.pidfd_open(cell_pid)
        except OSError:
            cell_fd = None
        poller = select.poll()
        poller.register(ours, select.POLLIN)
        poller.register(self.sock, select.POLLIN)
        if cell_fd is not None:
            poller.register(cell_fd, select.POLLIN)
        done = None
        ended = False
        while done is None and not ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reply["timed_out"] = True
                break
            for fd, _ in poller.poll(max(1, int(remaining * 1000 + 0.999))):
                if fd == ours.fileno():
                    try:
                        data, sender = _sender_pid(ours)
                    except OSError:
                        data, sender = b"", None
                    if not data:
                        ended = True
                        break
                    if sender == cell_pid:
                        try:
                            got = json.loads(data)
                        except ValueError:
                            got = {}
                        if isinstance(got, dict) and got.get("op") == "done":
                            done = got
                            break
                elif fd == self.sock.fileno():
                    data = self.sock.recv(MAX_MSG)
                    if not data:
                        _hard_exit(0)
                    try:
                        op = json.loads(data).get("op")
                    except (ValueError, AttributeError):
                        op = None
                    if op == "kill":
                        reply["killed"] = True
                        ended = True
                        break
                    if op == "ping":
                        _send(self.sock, {"op": "pong"})
                elif fd == cell_fd:
                    ended = True
                    break
        reply["wall_s"] = time.monotonic() - t0
        if cell_fd is not None:
            os.close(cell_fd)
        if done is not None:  # the cell is the session now
            code = done.get("exit_code")
            reply.update(kept=True, exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None)
            ch.close()
            self.sessions[sid] = (cell_pid, ours)
            # SIGKILL to the pre-cell process and what the cell left: none of them runs an instruction
            # more. Making sure none is left (one may have forked meanwhile) waits until the reply is
            # sent (the supervisor's loop, before the next message).
            self.kill_others(self.session_pids(), once=True)
            return reply
        # Stopped by a limit, or it ended the interpreter: everything of the cell goes, the
        # pre-cell process is the session again.
        ours.close()
        self.kill_others(self.session_pids())
        # The worker lifts the cell's memory limit before the pre-cell process runs again.
        try:
            _send(self.sock, {"op": "cell_over", "seq": seq})
            if select.select([self.sock], [], [], SESSION_REPLY_S)[0]:
                self.sock.recv(MAX_MSG)  # "resume" (or anything: a late kill, whose cell is over)
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        ready, _, _ = select.select([ch], [], [], SESSION_REPLY_S)
        got = None
        if ready:
            try:
                got = json.loads(ch.recv(MAX_MSG) or b"null")
            except (OSError, ValueError):
                got = None
        if not isinstance(got, dict) or got.get("op") != "reaped" or not isinstance(got.get("wait_status"), int):
            self.end(sid)
            reply["lost"] = True
            return reply
        reply["wait_status"] = got["wait_status"]
        reply["written"] = _changed(files_before, _listing(_session_dir(sid)))
        return reply

    def fork(self, msg):
        sid, new_sid = msg.get("sid"), msg.get("new_sid")
        if sid not in self.sessions or new_sid in self.sessions:
            return {"op": "forked", "new_sid": new_sid, "ok": False}
        pid, ch = self.sessions[sid]

        def make(theirs):
            try:
                socket.send_fds(ch, [json.dumps({"op": "fork", "sid": sid, "new_sid": new_sid}).encode()],
                                [theirs.fileno()])
                return True
            except OSError:
                return False

        return {"op": "forked", "new_sid": new_sid, "ok": self.new_session(new_sid, make) is not None}

    def end(self, sid):
        pid, ch = self.sessions.pop(sid, (None, None))
        if ch is not None:
            ch.close()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap_children()
        for _, other in self.sessions.values():  # its parent may be one of them: it reaps it
            try:
                other.send(b'{"op":"reap"}')
            except OSError:
                pass
        path = _session_dir(sid)
        if os.path.lexists(path):
            _in_child("janitor", lambda: _wipe_tree(path), _config["cleanup_timeout_s"])


def _wipe_tree(path):
    _wipe(path)
    os.rmdir(path)


#: Entries of a session's dir listed before each cell, at most (past it, changes go unlisted).
LISTING_MAX = 5000


def _listing(path):
    """{relative path: (inode, size, mtime, ctime)} of what is under `path` (no link followed)."""
    entries = {}
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            entries[os.path.relpath(full, path)] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if len(entries) >= LISTING_MAX:
                return entries
    return entries


def _changed(before, after):
    """What a rolled-back cell did to its session's files (they are not restored): paths created or
    changed, and deleted ones marked so."""
    changed = sorted(p for p, st in after.items() if before.get(p) != st)
    changed += sorted(f"{p} (deleted)" for p in before if p not in after)
    return changed[:WRITTEN_MAX]


def _family_supervisor(sock, msg):
    """PID 1 of a family (never returns): set up its namespaces, drop to its uid, serve its sessions."""
    uid = msg["uid"]
    try:
        _mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
        _mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        opts = f"size={msg['workdir_bytes']},nr_inodes={msg['workdir_inodes']},mode=0700,uid={uid},gid={uid}"
        _mount(b"tmpfs", _config["workdir"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode())
        _loopback_up()
        resource.setrlimit(resource.RLIMIT_NOFILE, (msg["nofile"], msg["nofile"]))  # the zygote's is higher
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _set_dumpable(0)
        _install_abi_filter(msg.get("deny_filter"))
        _set_child_subreaper()
        os.chdir(_config["workdir"])
        for name in ZYGOTE_ONLY_ENV:
            os.environ.pop(name, None)
    except BaseException as exc:
        _log("family set-up failed:", type(exc).__name__, exc)
        _hard_exit(SETUP_FAILED)
    family = _Family(sock)
    # The worker moves us into the family's cgroup, then says go: the sessions start there.
    data = sock.recv(MAX_MSG)
    if not data or json.loads(data).get("op") != "go":
        _hard_exit(0)
    os.mkdir(_session_dir(0), 0o700)

    def first(theirs):
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                main = _prepare_session()
                _enter_session(0)
                ch = socket.socket(fileno=os.dup(theirs.fileno()))
                theirs.close()
                _send(ch, {"op": "hello"})
                _session_loop(ch, main)
            except BaseException as exc:
                _log("session start failed:", type(exc).__name__, exc)
            finally:
                _hard_exit(SETUP_FAILED)
        return True

    if family.new_session(0, first) is None:
        _send(sock, {"op": "ready", "ok": False})
        _hard_exit(0)
    _send(sock, {"op": "ready", "ok": True, "sid": 0})
    while True:
        ready, _, _ = select.select([sock], [], [], 1.0)
        _reap_children()
        if not ready:
            continue
        msg, fds = _next_request(sock)  # none: the worker is done with this family (the kernel ends it)
        op = msg.get("op")
        if op == "cell":
            reply = family.cell(msg, fds)
            _send(sock, reply)
            if reply.get("kept"):  # after the reply: until no process but the sessions' is left
                family.kill_others(family.session_pids())
            continue
        for fd in fds:
            os.close(fd)
        if op == "fork":
            _send(sock, family.fork(msg))
        elif op == "close":
            family.end(msg.get("sid"))
            _send(sock, {"op": "closed", "sid": msg.get("sid")})
        elif op == "ping":
            _send(sock, {"op": "pong"})


def _prepare_session():
    """The first session process's set-up: a fresh __main__, fresh streams on /dev/null."""
    main = _prepare()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    _keep_only({0, 1, 2, *_open_sockets()})
    return main


def _open_sockets():
    keep = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                keep.add(int(name))
        except OSError:
            pass
    return keep


def _create_family(ctl, msg, fds):
    """Fork a family's supervisor in new namespaces; send the worker a pidfd of it."""
    fid = msg.get("fid")
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        _send(ctl, {"op": "created", "fid": fid, "error": "expected one fd"})
        return None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            sock = socket.socket(fileno=fds[0])
            _keep_only({0, 1, 2, w, sock.fileno()})
            _unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID)
            sup = os.fork()
            if sup == 0:
                os.close(w)
                _family_supervisor(sock, msg)
            os.write(w, str(sup).encode())
        except BaseException as exc:
            _log("family fork failed:", type(exc).__name__, exc)
        _hard_exit(0)
    os.close(w)
    os.close(fds[0])
    data = b""
    while chunk := os.read(r, 32):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    if not data.isdigit():
        _send(ctl, {"op": "created", "fid": fid, "error": "the family's supervisor did not start"})
        return None
    sup = int(data)
    pidfd = os.pidfd_open(sup)
    socket.send_fds(ctl, [json.dumps({"op": "created", "fid": fid}).encode()], [pidfd])
    return sup, pidfd


def _serve_sessions(ctl):
    """A session jail's zygote: it forks families and reaps their supervisors (never returns)."""
    families = {}
    while True:
        ready, _, _ = select.select([ctl], [], [], 1.0)
        _reap_children()  # supervisors whose family ended (they were re-parented to us)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(ctl, MAX_MSG, 16)
        except OSError as exc:
            _log("control socket failed:", exc)
            os._exit(1)
        if not data:
            os._exit(0)
        msg = json.loads(data)
        op = msg.get("op")
        if op == "create":
            made = _create_family(ctl, msg, fds)
            if made is not None:
                families[msg.get("fid")] = made
            continue
        for fd in fds:
            os.close(fd)
        if op == "end":
            made = families.pop(msg.get("fid"), None)
            if made is not None:
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
            _send(ctl, {"op": "ended", "fid": msg.get("fid")})
        elif op == "ping":
            _send(ctl, {"op": "pong"})


# --- the zygote --------------------------------------------------------------------------------


def _kill_everything():
    """SIGKILL every process in the jail but ourselves, then reap them all."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reaped = _reap_children()
        if reaped is None:
            return
        if not reaped:
            time.sleep(0.0005)


def _wipe(top):
    """Delete everything under `top` (runs in a janitor child, never in the zygote).

    Holds one directory fd at a time (a 3,000-deep tree is deeper than PATH_MAX and than any fd
    limit), lists each directory once (wide trees stay linear), and never follows a link.
    """
    for name in os.listxattr(top):  # e.g. a default ACL, which would shape the next call's files
        os.removexattr(top, name)
    os.chmod(top, 0o700)
    cur = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    pending = os.listdir(cur)
    stack = []
    while True:
        while pending:
            name = pending.pop()
            st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=cur)
                continue
            os.chmod(name, 0o700, dir_fd=cur)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cur)
            os.close(cur)
            cur = nxt
            stack.append((name, pending))
            pending = os.listdir(cur)
        if not stack:
            os.close(cur)
            return
        name, pending = stack.pop()
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        os.rmdir(name, dir_fd=parent)
        cur = parent


def _untouched(baseline):
    workdir = _config["workdir"]
    return (_workdir_usage() == baseline and stat.S_IMODE(os.stat(workdir).st_mode) == 0o700
            and not os.listxattr(workdir))


def _in_child(name, work, timeout_s):
    """Run `work()` in a forked child (never in the zygote); True if it finished within
    `timeout_s` and did not fail. A child that overruns is killed with everything else."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work()
        except BaseException as exc:
            _log(f"{name}:", type(exc).__name__, exc)
            code = 1
        os._exit(code)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([pidfd], [], [], timeout_s)
    os.close(pidfd)
    if not ready:
        _kill_everything()
        return False
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


_workdir_times = None
_baseline = None


def _reset_workdir_times():
    """The work dir's own timestamps as at start: a call may set them (utime), and the wipe moves them."""
    try:
        os.utime(_config["workdir"], ns=_workdir_times)
    except (OSError, TypeError):
        pass


def _clean(baseline, timeout_s):
    """Make the work dir as it was at start; True if it is."""
    if _untouched(baseline):
        return True
    wiped = _in_child("janitor", lambda: _wipe(_config["workdir"]), timeout_s)
    return wiped and _workdir_usage() == baseline


_spare_child = None


def _make_spare():
    """Fork the next call's child now, while the worker is busy with the last result.

    This takes the fork off the next call's latency, but costs a little more CPU per call, so the
    worker asks for it (the "spare" flag of a call) only while no calls are queued.
    """
    global _spare_child
    if not _config.get("prefork"):
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            _spare(theirs)
        finally:
            _hard_exit(SETUP_FAILED)
    theirs.close()
    _spare_child = (pid, os.pidfd_open(pid), ours)


def _take_spare():
    """The waiting spare child, if it is still alive."""
    global _spare_child
    spare, _spare_child = _spare_child, None
    if spare is None:
        return None
    pid, pidfd, sock = spare
    if select.select([pidfd], [], [], 0)[0]:  # it exited: reap it, fork a fresh child instead
        os.waitpid(pid, 0)
        os.close(pidfd)
        sock.close()
        return None
    return spare


def _await_go(ctl, seq):
    """A freshly forked child waits while the worker raises its OOM score from outside (a child
    cannot, and may not lower it): say "forked", wait for "go"."""
    _send(ctl, {"op": "forked", "seq": seq})
    deadline = time.monotonic() + GO_TIMEOUT_S
    while (remaining := deadline - time.monotonic()) > 0:
        if not select.select([ctl], [], [], remaining)[0]:
            break
        try:
            data = ctl.recv(MAX_MSG)
        except OSError:
            data = b""
        if not data:  # the worker is gone
            os._exit(0)
        msg = json.loads(data)
        if msg.get("op") == "go" and msg.get("seq") == seq:
            return True
        if msg.get("op") == "ping":
            _send(ctl, {"op": "pong"})
        elif msg.get("op") == "kill":
            return False
    return False


def _run(ctl, data, msg, fds, baseline):
    seq = msg["seq"]
    if not CallFd.fits(msg, len(fds)):
        for fd in fds:
            os.close(fd)
        _send(ctl, {"op": "exited", "seq": seq, "refused": f"expected {CallFd.COUNTS} fds, got {len(fds)}"})
        _send(ctl, {"op": "ready", "seq": seq, "clean": True, "spare": _spare_child is not None})
        return
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Before the fork, the mark that the call may have started: the worker reads it only if this
    # zygote dies or hangs, to tell a call it can safely run elsewhere from one it must not rerun.
    os.pwrite(fds[CallFd.SETUP], b"\x01", REPORT_BYTES - 1)
    t0 = time.monotonic()
    spare = _take_spare()
    if spare is not None:
        pid, pidfd, sock = spare
        try:
            socket.send_fds(sock, [data], fds)
        except OSError:  # it died after all, before it got the call: fork a fresh child
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(pidfd)
            spare = None
        sock.close()
    if spare is None:
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)
                if os.read(go_r, 1) != b"g":  # not before the worker has raised its OOM score
                    _hard_exit(SETUP_FAILED)
                os.close(go_r)
                if msg.get("judge") in JUDGE_SERVED:
                    _judge_server(fds, msg, None)
                _child(fds, msg)
            finally:
                _hard_exit(SETUP_FAILED)  # _child never returns, even if the program patched os._exit
        os.close(go_r)
        pidfd = os.pidfd_open(pid)
        if _await_go(ctl, seq):
            os.write(go_w, b"g")
        os.close(go_w)  # without "go" the child reads EOF and exits before any of the call runs
    fetch = fds[CallFd.FETCH_LIST:]  # the fetch list and fetch-out memfds stay for the collector
    for fd in fds[:CallFd.FETCH_LIST]:
        os.close(fd)
    deadline = t0 + msg["wall_s"]
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(ctl, select.POLLIN)
    timed_out = killed = False
    ended = False
    while not ended:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(max(1, int(remaining * 1000 + 0.999))):
            if fd == pidfd:
                ended = True
            elif fd == ctl.fileno():
                try:
                    data = ctl.recv(MAX_MSG)
                except OSError:
                    data = b""
                if not data:  # the worker is gone: nobody will read a result
                    os._exit(0)
                op = json.loads(data).get("op")
                if op == "kill":
                    killed = True
                    os.kill(-1, signal.SIGKILL)
                elif op == "ping":
                    _send(ctl, {"op": "pong"})
    wall = time.monotonic() - t0
    if not ended:
        os.kill(-1, signal.SIGKILL)
    _, status, usage = os.wait4(pid, 0)
    os.close(pidfd)
    _kill_everything()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if fetch:
        if msg.get("fetch"):
            _in_child("collector", lambda: _fetch_files(fetch[0], fetch[1]), FETCH_TIMEOUT_S)
        for fd in fetch:
            os.close(fd)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    exited = {
        "op": "exited", "seq": seq, "wait_status": status, "wall_s": wall, "cpu_s": cpu,
        "maxrss_kb": usage.ru_maxrss, "timed_out": timed_out, "killed": killed,
    }
    _reset_workdir_times()
    # The spare (if any) is forked before "ready", which says so: the worker then knows exactly
    # how many processes the jail must hold.
    if _untouched(baseline):  # the common case: one message says both "exited" and "ready"
        if msg.get("spare"):
            _make_spare()
        exited.update(ready=True, clean=True, spare=_spare_child is not None)
        _send(ctl, exited)
    else:
        _send(ctl, exited)
        clean = _clean(baseline, _config["cleanup_timeout_s"])
        _reset_workdir_times()
        if clean and msg.get("spare"):
            _make_spare()
        _send(ctl, {"op": "ready", "seq": seq, "clean": clean, "spare": _spare_child is not None})


def main():
    global _config, _stdio
    _config = json.loads(sys.argv[1])
    if _config.get("sigpending") is not None:  # a per-user counter charged to host root: see jail.py
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (_config["sigpending"],) * 2)
    _install_abi_filter(_config.get("abi_filter"))
    _set_dumpable(0)
    _deaf_to_signals()
    ctl = socket.socket(fileno=_config.get("ctl_fd", CTL_FD))
    t0 = time.monotonic()
    errors = _preload(["mmap", "io", "types", "builtins", "linecache", "traceback", "atexit",
                       *_config["preload"]])
    _warm_up(_config.get("warmup"))
    _collect_generators()
    _stdio = _unused_stdio()
    gc.collect()
    huge = _compact_heap()
    gc.freeze()
    _deaf_to_signals()  # again: a preload or the warm-up may have installed a handler
    global _baseline, _workdir_times
    baseline = _baseline = _workdir_usage()
    st = os.stat(_config["workdir"])
    _workdir_times = (st.st_atime_ns, st.st_mtime_ns)
    _make_spare()  # none in a session jail (no prefork)
    _send(ctl, {"op": "hello", "spare": _spare_child is not None,
                "preload_s": time.monotonic() - t0, "preload_errors": errors,
                "python": sys.version.split()[0], "modules": len(sys.modules), "huge_bytes": huge})
    if _config.get("sessions"):
        _serve_sessions(ctl)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctl, MAX_MSG, 16)
            if not data:
                os._exit(0)  # the worker closed the socket: stop
            msg = json.loads(data)
            op = msg.get("op")
            if op == "run":
                _run(ctl, data, msg, fds, baseline)
            else:
                for fd in fds:
                    os.close(fd)
                if op == "ping":
                    _send(ctl, {"op": "pong"})
        except OSError as exc:  # the worker went away mid-call
            _log("control socket failed:", exc)
            os._exit(1)


if __name__ == "__main__":
    main()
