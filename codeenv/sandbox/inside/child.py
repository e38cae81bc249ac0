"""A program's process: prepared ahead of its call (the spare), set up in named steps, then the
program run, its outcome reported and the interpreter's exit done by hand.

Every kind of child (a call's, a judged submission's, a test's, a cell's) builds its set-up with
one `Setup`: whatever fails before user code is reported in the setup memfd and the child exits
SETUP_FAILED, so the worker tells our failure from the program's.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

from . import workdir
from .proc import hard_exit, keep_only
from .protocol import JUDGE_FUNCTION_SINGLE, REPORT_BYTES, SETUP_FAILED, CallFd, frame

TYPE_CHECKING = False
if TYPE_CHECKING:
    import io
    import mmap
    import random
    import types
    from collections.abc import Callable
    from typing import Any, Literal, NoReturn

#: The program's file name in tracebacks and in an error's line (a cell's is "<cell N>").
FILENAME = "main.py"
#: Environment the zygote's interpreter start-up needs but a program should not inherit.
ZYGOTE_ONLY_ENV = ("PYTHONMALLOC", "GLIBC_TUNABLES")
#: Characters of a displayed value kept (its JSON, \\u-escaped, must fit the report memfd).
VALUE_CHARS = 8192
#: Frames of this package, skipped at the top of a program's traceback.
_HERE = os.path.dirname(os.path.abspath(__file__))


class Preloaded:
    """What the zygote made once for every child: the work dir's path, unused std streams, and the
    random generators created at import time (every child reseeds them: invariant 5)."""

    def __init__(self, workdir_path: str) -> None:
        self.workdir = workdir_path
        self.stdio: tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper] | None = None
        self.random_instances: list[random.Random] = []
        self.numpy_states: list[Any] = []

    def collect_generators(self) -> None:
        import gc
        import random

        np_random_state = None
        if "numpy.random" in sys.modules:
            np_random_state = sys.modules["numpy.random"].RandomState
        for obj in gc.get_objects():
            if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
                if obj is not random._inst:  # random reseeds its own instance after every fork
                    self.random_instances.append(obj)
            elif np_random_state is not None and isinstance(obj, np_random_state):
                self.numpy_states.append(obj)

    def make_stdio(self) -> None:
        """Std streams on fds 0-2 as a fresh interpreter makes them, built once and never used here.

        Each child gets its own copy with the fork and points fds 0-2 at its call's files: fresh
        streams without paying for three wrappers per call.
        """
        import io

        def text(fd: int, mode: Literal["r", "w"], old: Any) -> io.TextIOWrapper:
            raw = io.FileIO(fd, mode, closefd=False)
            buffered: io.BufferedReader | io.BufferedWriter = (
                io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
            return io.TextIOWrapper(
                buffered, encoding=old.encoding, errors=old.errors,
                line_buffering=old.line_buffering, write_through=old.write_through,
            )

        self.stdio = text(0, "r", sys.__stdin__), text(1, "w", sys.__stdout__), text(2, "w", sys.__stderr__)


def prepare(pre: Preloaded) -> types.ModuleType:
    """The part of a child's set-up that needs no call: a spare child does it before one arrives."""
    import builtins
    import types

    os.setsid()
    # SIGPIPE and SIGXFSZ are already ignored, as CPython does at start-up; see proc.deaf_to_signals.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    # Stays non-dumpable, as forked from the zygote: no core dump, no /proc entries others may open
    # (the seccomp policy kills a call that makes itself dumpable again).
    os.chdir(pre.workdir)
    for name in ZYGOTE_ONLY_ENV:
        os.environ.pop(name, None)
    assert pre.stdio is not None
    sys.stdin = sys.__stdin__ = pre.stdio[0]  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = pre.stdio[1]  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = pre.stdio[2]  # type: ignore[misc]
    for rng in pre.random_instances:
        rng.seed()
    if pre.numpy_states:
        # 128 bits from the kernel; seed(None) would build a SeedSequence (10x slower).
        words = sys.modules["numpy"].frombuffer(os.urandom(16), dtype="uint32")
        for state in pre.numpy_states:
            state.seed(words)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = [FILENAME]
    sys.path[0] = pre.workdir
    return main


class Setup:
    """A child's set-up before user code, as named steps (as nsjail's containProc): used as
    ``with Setup(fds) as s: ...``. A step that fails is reported in the setup memfd and the child
    exits SETUP_FAILED; after the last step the setup memfd is closed, and only then user code runs."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds
        self.setup_fd = fds[CallFd.SETUP]

    def __enter__(self) -> Setup:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> Literal[False]:
        if exc is None:
            os.close(self.setup_fd)
            return False
        report_setup_error(self.setup_fd, exc)
        hard_exit(SETUP_FAILED)

    def open_report(self) -> mmap.mmap:
        import mmap

        fd = self.fds[CallFd.REPORT]
        return mmap.mmap(fd, os.fstat(fd).st_size)

    def read(self, which: int) -> bytes:
        return workdir.read_all(self.fds[which])

    def write_files(self, top: str) -> None:
        if len(self.fds) > CallFd.FILES_IN:
            workdir.write_files(top, self.fds[CallFd.FILES_IN])

    def install_stdio(self, stdin_fd: int | None = None) -> None:
        os.dup2(self.fds[CallFd.STDIN] if stdin_fd is None else stdin_fd, 0)
        os.dup2(self.fds[CallFd.STDOUT], 1)
        os.dup2(self.fds[CallFd.STDERR], 2)

    def keep_only(self, *extra: int) -> None:
        """Every fd above 2 goes (the control socket included) but the setup memfd and `extra`."""
        keep_only({0, 1, 2, self.setup_fd, *extra})

    def limit(self, msg: dict[str, Any], cpu_slack: int) -> None:
        """The call's limits, soft and hard (the hard CPU limit `cpu_slack` seconds later)."""
        cpu = msg["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + cpu_slack))
        resource.setrlimit(resource.RLIMIT_FSIZE, (msg["fsize_bytes"],) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (msg["nofile"],) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def limit_cpu_below_hard(self, cpu_s: int) -> None:
        """A test's CPU limit: no higher than its submission's process's hard limit."""
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (min(cpu_s, hard), hard))

    def limit_soft(self, msg: dict[str, Any]) -> dict[int, tuple[int, int]]:
        """A cell's limits, soft only (the cell that ends normally is the session, and its next
        cell may need more); returns the limits before, to put back."""
        before = {}
        for which, value in ((resource.RLIMIT_CPU, msg["cpu_s"]), (resource.RLIMIT_FSIZE, msg["fsize_bytes"]),
                             (resource.RLIMIT_NOFILE, msg["nofile"])):
            before[which] = soft, hard = resource.getrlimit(which)
            resource.setrlimit(which, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))
        return before

    def register_source(self, name: str, code: bytes) -> None:
        """The program's source where tracebacks look for it."""
        import linecache

        source = code.decode("utf-8", "replace")
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)


def report_setup_error(setup_fd: int, exc: BaseException) -> None:
    # The setup memfd is closed before user code runs, so only a real setup failure (never the
    # program) can report one: the worker turns it into internal_error.
    try:
        os.pwrite(setup_fd, frame({"setup_error": f"{type(exc).__name__}: {exc}"[:2000]}, REPORT_BYTES - 1), 0)
    except BaseException:
        pass


def write_report(report: mmap.mmap, obj: object) -> None:
    data = frame(obj, len(report))
    report[: len(data)] = data


def exception_report(exc: BaseException, filename: str = FILENAME) -> dict[str, Any]:
    line = None
    if isinstance(exc, SyntaxError) and exc.filename == filename:
        line = exc.lineno
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            line = tb.tb_lineno
        tb = tb.tb_next
    try:
        message = str(exc)
    except BaseException:
        message = "<exception str() failed>"
    return {"type": type(exc).__name__, "message": message[:4000], "line": line}


def exit_code(exc: SystemExit) -> int:
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


def finalize(code: int) -> int:
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


def report_uncaught(report: mmap.mmap | None, exc: BaseException, filename: str) -> None:
    """An uncaught exception of the program: in the report (type, message, line) and on stderr, as
    the interpreter prints it (through the program's own excepthook, if it set one)."""
    try:
        assert report is not None
        write_report(report, {"error": exception_report(exc, filename)})
    except BaseException:
        pass
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == _HERE:  # e.g. run()'s
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


def exec_displaying_last(code: bytes, namespace: dict[str, Any], report: mmap.mmap, filename: str) -> None:
    """Run `code`; if its last top-level statement is an expression, report that value's repr as
    Jupyter shows it (nothing for None)."""
    import ast

    tree = ast.parse(code, filename)
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr):
        tree.body.pop()
    else:
        last = None
    exec(compile(tree, filename, "exec", dont_inherit=True), namespace)
    if last is None:
        return
    value = eval(compile(ast.Expression(last.value), filename, "eval", dont_inherit=True), namespace)
    if value is not None:
        write_report(report, {"value": repr(value)[:VALUE_CHARS]})


def call_function(namespace: dict[str, Any], fn_name: str, args: list[Any]) -> Any:
    """fn_name(*args): a method of a LeetCode-style `class Solution`, or a plain function."""
    solution = namespace.get("Solution")
    if isinstance(solution, type) and hasattr(solution, fn_name):
        return getattr(solution(), fn_name)(*args)
    fn = namespace.get(fn_name)
    if fn is None:
        raise NameError(f"name {fn_name!r} is not defined")
    return fn(*args)


def report_value(report: mmap.mmap, value: object) -> None:
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


def run(program: Callable[[], None], report: mmap.mmap | None, filename: str = FILENAME) -> int:
    """Run the program: its exit status, as the interpreter would give it (before `finalize`)."""
    status = 0
    try:
        program()
    except SystemExit as exc:
        status = exit_code(exc)
    except BaseException as exc:
        status = 1
        report_uncaught(report, exc, filename)
    return status


def exec_binary(binary_fd: int, stack_bytes: int) -> NoReturn:
    """Replace this process with the compiled program in the memfd `binary_fd`, its stack limit raised
    to `stack_bytes` (judges run C++ with the stack as large as the memory: deep recursion needs it),
    no fd beyond stdio, and its signals as a fresh process has them (CPython ignores SIGPIPE and SIGXFSZ, and an exec
    keeps what is ignored); never returns (126 if the kernel refuses the exec, with why on stderr)."""
    try:
        raise_stack(stack_bytes)
        for fd in os.listdir("/proc/self/fd"):  # the binary's memfd too: an ELF execs from a closing fd
            if int(fd) > 2:
                try:
                    os.set_inheritable(int(fd), False)
                except OSError:  # listdir's own, closed by now
                    pass
        for sig in signal.valid_signals():
            if sig not in UNCATCHABLE and signal.getsignal(sig) is signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.execve(binary_fd, ["solution"], dict(os.environ))
    except OSError as exc:
        try:
            os.write(2, f"the compiled program could not start: {exc}\n".encode())
        except OSError:
            pass
    hard_exit(126)


UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


def raise_stack(stack_bytes: int) -> None:
    """The stack's soft limit at `stack_bytes`, as far as the hard limit lets it (a compiled program
    inherits it: judges give C++ a stack as large as its memory)."""
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    resource.setrlimit(resource.RLIMIT_STACK, (stack_bytes if hard == resource.RLIM_INFINITY
                                               else min(stack_bytes, hard), hard))


def run_binary(fds: list[int], limits: dict[str, Any], pre: Preloaded, main: types.ModuleType | None) -> NoReturn:
    """A call's child that runs a compiled program with the call's stdin (and files); never returns."""
    with Setup(fds) as setup:
        if main is None:  # a child forked on demand: its session, work dir and environment as a spare's
            prepare(pre)
        binary_fd = fds[CallFd.CODE]
        setup.write_files(pre.workdir)
        setup.install_stdio()
        setup.keep_only(binary_fd)
        setup.limit(limits, cpu_slack=1)
    exec_binary(binary_fd, limits["stack_bytes"])


def run_call(fds: list[int], limits: dict[str, Any], pre: Preloaded, main: types.ModuleType | None) -> None:
    """A call's child (`main`: as a spare prepared it); never returns."""
    if limits.get("binary"):
        run_binary(fds, limits, pre, main)
    fn_name: str | None = None
    args: Any = None
    stdin_fd = None
    with Setup(fds) as setup:
        if main is None:
            main = prepare(pre)
        report = setup.open_report()
        code = setup.read(CallFd.CODE)
        if limits.get("judge") == JUDGE_FUNCTION_SINGLE:
            fn_name, args = limits["fn_name"], json.loads(setup.read(CallFd.STDIN) or b"[]")
            stdin_fd = os.open("/dev/null", os.O_RDONLY)  # a function-call test has no input
        setup.write_files(pre.workdir)
        setup.install_stdio(stdin_fd)
        setup.keep_only()
        setup.limit(limits, cpu_slack=1)
        setup.register_source(FILENAME, code)
    del setup, fds
    namespace = main.__dict__

    def program() -> None:
        if limits.get("display_last"):
            exec_displaying_last(code, namespace, report, FILENAME)
        else:
            exec(compile(code, FILENAME, "exec", dont_inherit=True), namespace)
        if fn_name is not None:
            report_value(report, call_function(namespace, fn_name, args))

    hard_exit(finalize(run(program, report)))
