"""The physical limit of a workload on this machine: what no sandbox can beat.

Each program runs in a child forked from a warm interpreter that has already imported what the
program's zygote profile preloads (the built image's interpreter and packages, no jail), one
program at a time. The child's CPU time from fork to exit (user + system, from ``wait4``) is the
program's irreducible cost; their sum divided by the cores is the shortest time the whole workload
can take, and calls / that time is the limit on throughput. A program that runs past its timeout
is killed there, as a sandbox would kill it, and counts the CPU it used until then.

The same run records each program's outcome and stdout, which is how a workload's expected
outputs are written (``codeenv bench --limit --write-expect FILE``).

A code workload's submission counts the CPU time of all its tests, each run as such a child: its
outcome is ``ok`` and its stdout ``PASSED/TOTAL`` (outputs compared as the bench compares them).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from codeenv.bench.apis import CODE_COMPARE
from codeenv.bench.baseline import host_python_env
from codeenv.bench.workload import Call
from codeenv.compare import same_output
from codeenv.errors import BenchError, WorkloadError
from codeenv.sandbox.image import ensure_image
from codeenv.sandbox.routing import choose_profile
from codeenv.settings import SandboxSettings

DEFAULT_TIMEOUT_S = 10.0

# Runs in the image's interpreter: preload, warm up, then fork one child per program read from stdin.
_WARM = r"""
import importlib, io, json, os, select, signal, sys, tempfile, time, traceback
spec = json.loads(sys.argv[1])
for name in spec["preload"]:
    importlib.import_module(name)
if spec["warmup"]:
    exec(spec["warmup"], {"__name__": "__warmup__"})
channel = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_WRONLY)
for line in sys.stdin:
    job = json.loads(line)
    fin, fout = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    fin.write(job["stdin"].encode()); fin.flush(); fin.seek(0)
    pid = os.fork()
    if pid == 0:
        os.dup2(fin.fileno(), 0); os.dup2(fout.fileno(), 1); os.dup2(devnull, 2)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=False)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False))
        status = 0
        try:
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        try:
            sys.stdout.flush()
        except BaseException:
            status = status or 1
        os._exit(status)
    pidfd = os.pidfd_open(pid)
    t0 = time.perf_counter()
    timed_out = not select.select([pidfd], [], [], job["timeout"])[0]
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, wstatus, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    os.close(pidfd)
    fout.seek(0)
    out = fout.read(1 << 20).decode(errors="replace")
    fin.close(); fout.close()
    code = os.waitstatus_to_exitcode(wstatus)
    status = "timeout" if timed_out else ("ok" if code == 0 else "error")
    channel.write(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": wall,
                              "status": status, "stdout": out}) + "\n")
    channel.flush()
"""


@dataclass
class LimitReport:
    calls: int
    cores: int
    cpu_s: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    stdouts: list[str] = field(default_factory=list)
    profiles: list[str] = field(default_factory=list)

    @property
    def total_cpu_s(self) -> float:
        return sum(self.cpu_s)

    @property
    def limit_per_s(self) -> float:
        """Calls per second if every core did nothing but the programs' own work."""
        return self.calls / (self.total_cpu_s / self.cores) if self.total_cpu_s > 0 else float("inf")

    def summary(self) -> dict[str, object]:
        return {"calls": self.calls, "cores": self.cores, "total_cpu_s": round(self.total_cpu_s, 4),
                "mean_cpu_ms": round(1000 * self.total_cpu_s / max(1, self.calls), 3),
                "limit_calls_per_s": round(self.limit_per_s, 3)}

    def expectations(self) -> list[dict[str, str]]:
        return [{"status": s} if s == "timeout" else {"status": s, "stdout": o}
                for s, o in zip(self.statuses, self.stdouts, strict=True)]


def _run(proc: subprocess.Popen[str], name: str, code: str, stdin: str, timeout: float) -> dict[str, Any]:
    """One program in the warm interpreter `proc`: its CPU time, status and stdout."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"code": code, "stdin": stdin, "timeout": timeout}) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise BenchError(f"the warm {name} interpreter died (exit {proc.wait()})")
    result: dict[str, Any] = json.loads(line)
    return result


def cores() -> int:
    return len(os.sched_getaffinity(0))


def measure_limit(calls: list[Call], settings: SandboxSettings | None = None,
                  progress: Callable[[int], None] | None = None) -> LimitReport:
    """Run every program once, in order, in a fork of a warm interpreter of its profile."""
    settings = settings or SandboxSettings(slots=1)
    image = ensure_image(settings)
    python, env = host_python_env(image)
    report = LimitReport(calls=len(calls), cores=cores())
    warm: dict[str, subprocess.Popen[str]] = {}
    try:
        for i, call in enumerate(calls):
            if call.language != "python":
                raise WorkloadError(f"call {i + 1} is {call.language}: the physical limit runs Python programs only "
                                    "(leave --limit out for a workload with C++)")
            profile = choose_profile(call.code.encode(errors="surrogatepass"), image.spec.profiles)
            proc = warm.get(profile.name)
            if proc is None:
                spec = json.dumps({"preload": profile.preload, "warmup": profile.warmup})
                proc = warm[profile.name] = subprocess.Popen(
                    [python, "-c", _WARM, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                    text=True, cwd="/tmp")
            assert proc.stdin is not None and proc.stdout is not None

            timeout = call.timeout or DEFAULT_TIMEOUT_S
            if call.tests is None:
                result = _run(proc, profile.name, call.code, call.stdin, timeout)
            else:
                runs = [(_run(proc, profile.name, call.code, t.stdin, timeout), t.expected_stdout) for t in call.tests]
                passed = sum(r["status"] == "ok" and same_output(r["stdout"], expected, CODE_COMPARE, 1e-6)
                             for r, expected in runs)
                result = {"cpu_s": sum(r["cpu_s"] for r, _ in runs), "status": "ok",
                          "stdout": f"{passed}/{len(runs)}"}
            report.cpu_s.append(result["cpu_s"])
            report.statuses.append(result["status"])
            report.stdouts.append(result["stdout"])
            report.profiles.append(profile.name)
            if progress:
                progress(i + 1)
    finally:
        for proc in warm.values():
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
    return report
