"""Per-user kernel quotas of the host (issue 31): nsjail makes each jail's user namespace as host root,
and the kernel charges per-user counters up the chain of namespaces to root's own, which every root
process on the host shares. A call or a session that tries to exhaust one is held to a small share
(or refused the call outright), while the test process, root on the host, uses the same counter
and is never refused.

The hostile program caps its own attempts (20 inotify instances of root's 128, 2,000 queued signals
and timers), so that a regression fails the test without exhausting the host's counters."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import json
import os
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from codeenv import ExecRequest, ExecResult, SlotPool
from codeenv.sandbox.jail import JAIL_SIGPENDING
from codeenv.sandbox.sessions import Session, SessionManager
from tests.conftest import wait_until_running

pytestmark = pytest.mark.jail

ENOSYS, EAGAIN, EPERM = errno.ENOSYS, errno.EAGAIN, errno.EPERM

#: Tries to take each counter, with its attempts capped; reports what it got as JSON. With `hold`,
#: it then announces itself (a file in its work dir) and keeps what it took for a while.
HOSTILE = """
import ctypes, json, os, resource, signal, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
got = {"limits": {name: resource.getrlimit(getattr(resource, "RLIMIT_" + name))
                  for name in ("SIGPENDING", "MSGQUEUE", "MEMLOCK")}}

def attempts(name, n, make):
    count = 0
    for _ in range(n):
        if make() < 0:
            got[name + "_errno"] = ctypes.get_errno()
            break
        count += 1
    got[name] = count

attempts("inotify", 20, lambda: libc.syscall(294, 0))                    # inotify_init1
attempts("inotify_watch", 200, lambda: libc.syscall(254, 0, b"/", 0xfff))  # inotify_add_watch
attempts("fanotify", 50, lambda: libc.syscall(300, 0x200, 0))             # fanotify_init(FAN_REPORT_FID)
attempts("keys", 50, lambda: libc.syscall(248, b"user", b"k", b"v", 1, -2))  # add_key
attempts("mq", 50, lambda: libc.syscall(240, b"/q", 0o100, 0o600, None))   # mq_open
buf = ctypes.create_string_buffer(4096)
attempts("mlock", 1, lambda: libc.mlock(buf, 4096))
timers = []

def timer():
    t = ctypes.c_void_p()
    rc = libc.syscall(222, 1, None, ctypes.byref(t))                       # timer_create
    timers.append(t)
    return rc

attempts("timers", 1000, timer)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})

# sigqueue (kill() of a real-time signal past the limit succeeds without queueing: nothing to count)
attempts("signals", 2000, lambda: libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)))
print(json.dumps(got))
if HOLD:
    open("running", "w").close()
    time.sleep(HOLD)
"""


def hostile(hold_s: float = 0) -> str:
    return f"HOLD = {hold_s}\n{HOSTILE}"


def check_held_to_a_share(result: ExecResult) -> dict[str, Any]:
    assert result.status == "ok", result
    got: dict[str, Any] = json.loads(result.stdout.splitlines()[0])
    assert got["limits"]["SIGPENDING"] == [JAIL_SIGPENDING] * 2
    assert got["limits"]["MSGQUEUE"] == [0, 0] and got["limits"]["MEMLOCK"] == [0, 0]
    for refused in ("inotify", "inotify_watch", "fanotify", "keys", "mq"):
        assert (got[refused], got[f"{refused}_errno"]) == (0, ENOSYS), (refused, got)
    assert (got["mlock"], got["mlock_errno"]) == (0, EPERM), got
    # Queued signals and POSIX timers share RLIMIT_SIGPENDING: a small share, then EAGAIN.
    assert got["timers"] + got["signals"] <= JAIL_SIGPENDING, got
    assert got.get("timers_errno", EAGAIN) == EAGAIN and got["signals_errno"] == EAGAIN, got
    return got


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.syscall.restype = ctypes.c_long


def host_root_uses_every_counter() -> None:
    """The test process (host root) takes one of each counter the jail tried to exhaust, and gives it back."""
    assert os.geteuid() == 0
    fd = _libc.syscall(294, os.O_CLOEXEC)  # inotify_init1
    assert fd >= 0, f"host root's inotify_init1 failed: {os.strerror(ctypes.get_errno())}"
    try:
        wd = _libc.syscall(254, fd, b"/", 0x100)  # inotify_add_watch(IN_CREATE)
        assert wd >= 0, f"host root's inotify_add_watch failed: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(fd)
    timer = ctypes.c_void_p()
    assert _libc.syscall(222, 1, None, ctypes.byref(timer)) == 0, \
        f"host root's timer_create failed: {os.strerror(ctypes.get_errno())}"
    _libc.syscall(226, timer)  # timer_delete
    # A queued real-time signal, to this thread only (blocked here, then taken back).
    sig = signal.SIGRTMIN + 3
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    try:
        signal.pthread_kill(threading.get_ident(), sig)
        assert signal.sigtimedwait([sig], 1) is not None, "host root's queued signal was not delivered"
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    queued, limit = _sigq()
    assert queued < limit // 2, f"host root has {queued} of its {limit} signals queued"


def _sigq() -> tuple[int, int]:
    """Queued signals of this process's user, and their limit (SigQ of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("SigQ:"):
                count, limit = line.split()[1].split("/")
                return int(count), int(limit)
    raise AssertionError("no SigQ in /proc/self/status")


async def test_a_call_is_held_to_a_small_share_of_host_roots_counters(pool: SlotPool) -> None:
    zygote = pool.slots[0].zygotes["light"]
    task = asyncio.create_task(pool.run(ExecRequest(code=hostile(hold_s=3), profile="light", limits={"wall_s": 20}),
                                        slot_index=0))
    await wait_until_running(zygote)
    host_root_uses_every_counter()  # while the call holds what it took
    assert check_held_to_a_share(await task)["timers"] > 0
    again = await pool.run(ExecRequest(code="print('next')", profile="light"), slot_index=0)
    assert again.stdout == "next\n"


@pytest_asyncio.fixture
async def session(pool: SlotPool) -> AsyncIterator[tuple[SessionManager, Session]]:
    m = pool.sessions
    assert m is not None
    s = await m.create("light")
    try:
        yield m, s
    finally:
        if s.id in m.sessions:
            await m.delete(s.id)


async def test_a_session_is_held_to_a_small_share_of_host_roots_counters(
        pool: SlotPool, session: tuple[SessionManager, Session]) -> None:
    _, s = session
    first = await pool.run(ExecRequest(code=hostile(), session=s.id, limits={"wall_s": 20}))
    got = check_held_to_a_share(first)
    assert got["timers"] > 0 and not first.rolled_back
    # The session keeps its timers and pending signals between cells; host root is not refused.
    host_root_uses_every_counter()
    more = await pool.run(ExecRequest(code=hostile(), session=s.id, limits={"wall_s": 20}))
    again = check_held_to_a_share(more)
    assert again["timers"] + again["signals"] == 0, (got, again)  # the family's share is still taken
    host_root_uses_every_counter()
    # A fork of it shares its family's uid, and so its share.
    assert pool.sessions is not None
    child = await pool.sessions.fork(s.id)
    forked = await pool.run(ExecRequest(code=hostile(), session=child.id, limits={"wall_s": 20}))
    assert check_held_to_a_share(forked)["signals"] == 0
    host_root_uses_every_counter()


HONEST = """
import asyncio, multiprocessing, signal, subprocess, sys, threading, time
signal.signal(signal.SIGALRM, lambda *_: None); signal.setitimer(signal.ITIMER_REAL, 0.01); time.sleep(0.05)
t = threading.Timer(0.01, lambda: None); t.start(); t.join()
async def main():
    await asyncio.sleep(0.01)
    return sum(await asyncio.gather(*(asyncio.sleep(0.001, result=i) for i in range(50))))
print(asyncio.run(main()))
with multiprocessing.get_context("fork").Pool(2) as p:
    print(sum(p.map(abs, range(-10, 10))))
print(subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout.strip())
"""


async def test_honest_programs_still_work_under_those_limits(pool: SlotPool,
                                                             session: tuple[SessionManager, Session]) -> None:
    _, s = session
    for request in (ExecRequest(code=HONEST, limits={"wall_s": 20}),
                    ExecRequest(code=HONEST, session=s.id, limits={"wall_s": 20})):
        r = await pool.run(request)
        assert r.status == "ok" and r.stdout.split() == ["1225", "100", "7"], r


async def test_a_familys_stopped_sessions_take_none_of_its_share(
        pool: SlotPool, session: tuple[SessionManager, Session]) -> None:
    """Idle sessions are stopped between cells; a stop signal queued to one already stopped (or to a
    pre-cell process still running) would count against the family's RLIMIT_SIGPENDING."""
    m, s = session
    forks = [await m.fork(s.id) for _ in range(4)]
    for one in (s, *forks, s):
        assert (await pool.run(ExecRequest(code="x = 1", session=one.id))).status == "ok"
    got = check_held_to_a_share(await pool.run(ExecRequest(code=hostile(), session=s.id, limits={"wall_s": 20})))
    assert got["timers"] + got["signals"] == JAIL_SIGPENDING, got
