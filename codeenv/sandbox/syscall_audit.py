"""Regenerate an image's seccomp allowlist: run programs in audit mode, read what the kernel logged.

    codeenv image syscalls python-math                     # the built-in probes and the workloads
    codeenv image syscalls python-math --program my.py     # and programs of your own
    codeenv image syscalls python-math --write             # add what was missing to syscalls.txt

In audit mode (CODEENV_SECCOMP=audit) a call outside the allowlist is allowed and logged
(SECCOMP_RET_LOG): the kernel writes an audit record (type=1326) with the caller's host uid and the
call's number to its log. This reads the log (/dev/kmsg) for records of the pool's uids, so it
needs root and a kernel log it can read (in a container: the host's, or none).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from codeenv.errors import SandboxError
from codeenv.models import ExecRequest, Limits, LimitValues
from codeenv.settings import SandboxSettings

#: Programs that exercise what math tool calls use: the libraries, threads, processes, sockets, files.
PROBES: dict[str, str] = {
    "libraries": """
import numpy as np, scipy.linalg, scipy.optimize, sympy, networkx as nx, mpmath
x = sympy.symbols("x"); print(sympy.integrate(sympy.sin(x) ** 2, x), sympy.factorint(2**64 - 1))
print(np.linalg.eigvals(np.random.rand(40, 40)).shape, scipy.linalg.inv(np.eye(3)).sum())
print(scipy.optimize.minimize(lambda v: (v ** 2).sum(), [1, 2]).fun, nx.shortest_path_length(nx.path_graph(9), 0, 8))
print(mpmath.mp.dps, sympy.nsimplify(0.5), np.fft.fft(np.ones(8)).real.sum())
""",
    "threads and processes": """
import multiprocessing, subprocess, sys, threading, os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
def sq(v): return v * v
if __name__ == "__main__":
    threads = [threading.Thread(target=sum, args=(range(1000),)) for _ in range(4)]
    for thread in threads: thread.start()
    for thread in threads: thread.join()
    with ThreadPoolExecutor(4) as ex: print(sum(ex.map(sq, range(50))))
    for method in ("fork", "spawn", "forkserver"):  # builtins: the program's __main__ is not a file to import
        with multiprocessing.get_context(method).Pool(2) as pool:
            print(method, pool.map(abs, range(-4, 0)))
    with ProcessPoolExecutor(2) as ex:
        print(sum(ex.map(sq, range(8))))
    q = multiprocessing.Queue(); p = multiprocessing.Process(target=q.put, args=(5,)); p.start()
    print(q.get()); p.join()
    lock = multiprocessing.Lock(); lock.acquire(); lock.release()
    print(subprocess.run([sys.executable, "-c", "import numpy; print(1)"], capture_output=True, text=True).stdout)
    print(subprocess.check_output([sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read())"], input=b"x"))
    pid = os.fork()
    if pid == 0: os._exit(0)
    os.waitpid(pid, 0)
""",
    "sockets": """
import socket, os, asyncio, selectors
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
c = socket.create_connection(srv.getsockname()); s, _ = srv.accept(); c.sendall(b"x"); print(s.recv(1))
for sock in (c, s, srv): sock.close()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0)); u.sendto(b"y", u.getsockname())
print(u.recvfrom(9)); u.close()
try:
    v6 = socket.socket(socket.AF_INET6); v6.bind(("::1", 0)); v6.close()
except OSError as e: print("v6", e)
a, b = socket.socketpair(); a.send(b"z"); print(b.recv(1)); a.close(); b.close()
us = socket.socket(socket.AF_UNIX); us.bind("sock"); us.close(); os.unlink("sock")
async def main():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    r, w = await asyncio.open_connection(*server.sockets[0].getsockname()); w.close(); server.close()
asyncio.run(main())
""",
    "files, signals, time": """
import os, shutil, tempfile, mmap, signal, time, select, fcntl, resource, random, sqlite3, platform, uuid, zlib
import hashlib, json
d = tempfile.mkdtemp(); f = os.path.join(d, "f"); open(f, "w").write("a"); os.chmod(f, 0o600); os.utime(f, (1, 1))
os.rename(f, f + "2"); os.symlink(f + "2", f + "3"); os.readlink(f + "3"); os.link(f + "2", f + "4"); os.listdir(d)
os.truncate(f + "2", 0); shutil.copy(f + "4", f + "5"); os.mkfifo(os.path.join(d, "fifo")); shutil.rmtree(d)
m = mmap.mmap(-1, 4096); m.write(b"a"); m.close()
signal.signal(signal.SIGALRM, lambda *a: None); signal.setitimer(signal.ITIMER_REAL, 0.01); time.sleep(0.03)
r, w = os.pipe(); os.write(w, b"1"); select.select([r], [], [], 0); p = select.poll(); p.register(r); p.poll(0)
e = select.epoll(); e.register(r); e.poll(0); e.close(); fcntl.fcntl(r, fcntl.F_GETFL); os.close(r); os.close(w)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, os.urandom(4), random.random(), os.sched_getaffinity(0))
print(platform.platform(), uuid.uuid4(), sqlite3.connect(":memory:").execute("select 1").fetchone(), os.getloadavg())
print(time.time(), time.process_time(), time.perf_counter(), os.times(), os.cpu_count(), os.uname().sysname)
""",
}

AUDIT_RECORD = re.compile(r"type=1326 .*?\buid=(\d+)\b.*?\barch=([0-9a-f]+) syscall=(\d+)")


def syscall_names() -> dict[int, str]:
    """x86_64 system call numbers to names, from the kernel headers when this host has them."""
    names: dict[int, str] = {}
    for header in (Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), Path("/usr/include/asm/unistd_64.h")):
        if header.is_file():
            for match in re.finditer(r"#define __NR_(\w+) (\d+)", header.read_text()):
                names[int(match.group(2))] = match.group(1)
            break
    return names


#: Without auditd the kernel prints audit records through printk, at most printk_ratelimit_burst of
#: them every printk_ratelimit seconds: the audit lifts that limit while it runs, then puts it back.
RATELIMIT = Path("/proc/sys/kernel/printk_ratelimit")


class KernelLog:
    """The kernel log's records from now on (/dev/kmsg, read without blocking)."""

    def __init__(self) -> None:
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise SandboxError(f"cannot read the kernel log (/dev/kmsg): {exc.strerror}; the audit needs root "
                               "on the host (or a container allowed to read the host's kernel log)") from exc
        os.lseek(self.fd, 0, os.SEEK_END)
        self.ratelimit: str | None = None
        try:
            self.ratelimit = RATELIMIT.read_text()
            RATELIMIT.write_text("0")
        except OSError:
            pass  # records beyond the burst are dropped: run the audit again to see them

    def read(self) -> list[str]:
        records = []
        while True:
            try:
                records.append(os.read(self.fd, 8192).decode("utf-8", "replace"))
            except BlockingIOError:
                return records
            except OSError:  # EPIPE: records were overwritten while we read; go on with the rest
                continue

    def close(self) -> None:
        os.close(self.fd)
        if self.ratelimit is not None:
            RATELIMIT.write_text(self.ratelimit)


def logged_calls(records: Iterable[str], uids: range) -> Counter[int]:
    """System call numbers of the audit records made by processes of `uids`."""
    found: Counter[int] = Counter()
    for record in records:
        match = AUDIT_RECORD.search(record)
        if match and int(match.group(1)) in uids:
            found[int(match.group(3))] += 1
    return found


async def audit(settings: SandboxSettings, programs: dict[str, str]) -> tuple[Counter[int], dict[str, str]]:
    """Run `programs` in a one-slot pool in audit mode; the calls logged, and each program's status."""
    from codeenv.sandbox.pool import SlotPool

    settings = settings.model_copy(update={"seccomp": "audit", "slots": 1})
    log = KernelLog()
    statuses: dict[str, str] = {}
    try:
        async with SlotPool(settings) as pool:
            limits = LimitValues.model_validate({**settings.defaults.model_dump(), "wall_s": 60, "cpu_s": 60})
            for name, code in programs.items():
                result = await pool.run(ExecRequest(code=code, limits=Limits(**limits.model_dump())))
                statuses[name] = result.status if result.status == "ok" else f"{result.status}: {result.message or ''}"
            uids = range(pool.uid_base, pool.uid_base + len(pool.slots))
        await asyncio.sleep(0.2)  # the last records
        return logged_calls(log.read(), uids), statuses
    finally:
        log.close()


def workload_programs() -> dict[str, str]:
    """The calls of the shipped `codeenv bench` workloads, one program per distinct code."""
    programs: dict[str, str] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "bench" / "workloads").glob("*.jsonl")):
        if path.name.endswith(".expect.jsonl"):
            continue
        for number, line in enumerate(path.read_text().splitlines()[:50], 1):
            code = json.loads(line)["code"]
            programs.setdefault(code, f"{path.stem}:{number}")
    return {name: code for code, name in programs.items()}
