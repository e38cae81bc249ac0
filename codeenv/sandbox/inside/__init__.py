"""The zygote: PID 1 of a jail. It preloads modules once, then forks a child per call (or, in a
session jail, a family per session and its forks).

Runs inside the jail under the image's interpreter, so it imports nothing but the standard library
and this package. The worker copies this directory into the jail and starts it as
``python3 -s -B -c "from <package> import main; main()" CONFIG_JSON``, with the package's parent
first on sys.path and a SOCK_SEQPACKET control socket on fd CTL_FD whose other end the worker holds.

Invariants it keeps (shared/DESIGN.md):

1. It never holds request bytes: a call arrives as limits (numbers) plus file descriptors (code and
   stdin memfds, stdout/stderr pipes, report and setup memfds) that it passes to the child unread.
2. The child cannot reach it: it is non-dumpable, keeps no signal handler (so the kernel drops its
   children's signals), and hands the child fds 0-2 only.
3. Nothing of a call survives: after each call it kills every other process in the jail, reaps them,
   and mounts a fresh tmpfs on the work dir if the call changed it (or, where it cannot, has a
   short-lived janitor child wipe it); before each fork it sets the pid counter back.

Modules: `protocol` (every channel, shared with the worker), `proc` (process primitives), `child`
(a program's process), `workdir` (files), and one per program: `calls`, `judge`, `sessions`.
"""

from __future__ import annotations

import gc
import json
import resource
import socket
import sys
import time

from . import proc
from .calls import CallZygote
from .child import Preloaded
from .protocol import CTL_FD, Ctl
from .sessions import serve_sessions
from .workdir import Workdir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

#: Modules every child uses, imported before the profile's preload list.
BASE_PRELOAD = ("mmap", "io", "types", "builtins", "linecache", "traceback", "atexit")

#: Compiled and run once in the zygote before it freezes its heap, so every child finds the
#: compiler's and interpreter's lazily-built structures ready instead of building (and copying) them.
WARMUP = """
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


def _preload(modules: list[str]) -> dict[str, str]:
    errors = {}
    for name in modules:
        try:
            __import__(name)
        except BaseException as exc:  # a broken preload must not kill the zygote
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _warm_up(extra: str | None) -> None:
    for source in (WARMUP, extra or ""):
        for _ in range(2):
            try:
                exec(compile(source, "<warmup>", "exec", dont_inherit=True), {"__name__": "__warmup__"})
            except BaseException as exc:
                proc.log("warm-up failed:", type(exc).__name__, exc)
                break


#: The stack limit of the zygote and of what it forks, but compiled programs.
ZYGOTE_STACK = 8 << 20


def main() -> NoReturn:
    config = json.loads(sys.argv[1])
    if config.get("sigpending") is not None:  # a per-user counter charged to host root: see jail.py
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (config["sigpending"],) * 2)
    # The jail's stack limit is unlimited so that a compiled program's test may raise it (to its
    # memory limit); everything else keeps the usual 8 MB.
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    resource.setrlimit(resource.RLIMIT_STACK, (ZYGOTE_STACK if hard == resource.RLIM_INFINITY
                                               else min(ZYGOTE_STACK, hard), hard))
    proc.install_abi_filter(config.get("abi_filter"))
    if config.get("drop_caps"):  # a call jail's zygote keeps capabilities; its children do not
        proc.children_drop_caps(config.get("child_filter"))
    proc.set_dumpable(0)
    proc.deaf_to_signals()
    ctl = socket.socket(fileno=config.get("ctl_fd", CTL_FD))
    t0 = time.monotonic()
    errors = _preload([*BASE_PRELOAD, *config["preload"]])
    _warm_up(config.get("warmup"))
    pre = Preloaded(config["workdir"])
    pre.collect_generators()
    pre.make_stdio()
    gc.collect()
    # Not in a session family: there a cell's fork touches fewer pages, so a cell limit of 1 MB is
    # accepted where it was refused, and the OOM killer then took the pre-cell process instead of the
    # cell (a score's weight is the group's limit, a few hundred pages here, while the two processes
    # map nearly the same pages; lowering the pre-cell's score below the worker's needs
    # CAP_SYS_RESOURCE, which a worker in a container may lack). Before the heap is compacted: its
    # trim gives back what the pass used.
    immortal = 0 if config.get("sessions") else proc.immortalize()
    huge = proc.compact_heap()
    gc.freeze()
    proc.deaf_to_signals()  # again: a preload or the warm-up may have installed a handler
    workdir = Workdir(config["workdir"], config.get("workdir_tmpfs"))
    workdir.record_baseline()
    if config.get("proc_mount"):
        try:
            proc.hold_pid_counter(config["proc_mount"])
        except OSError as exc:  # e.g. the legacy policy: calls' pids then follow the last call's
            proc.log("the pid counter cannot be held:", exc)
    zygote = CallZygote(ctl, pre, workdir, config["cleanup_timeout_s"], bool(config.get("prefork")))
    zygote.make_spare()  # none in a session jail (no prefork)
    proc.send(ctl, {"op": Ctl.HELLO, "spare": zygote.spare is not None,
                    "preload_s": time.monotonic() - t0, "preload_errors": errors,
                    "python": sys.version.split()[0], "modules": len(sys.modules), "huge_bytes": huge,
                    "immortal": immortal})
    if config.get("sessions"):
        serve_sessions(ctl, pre, config["cleanup_timeout_s"])
    zygote.serve()
