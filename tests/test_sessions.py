"""Live sessions (issue 21): state that persists, rollback without replay, forks, lifetimes, and
isolation between sessions and between a session and a call. Real jails, real processes."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from codeenv import ExecRequest, ExecResult, SandboxSettings, SlotPool
from codeenv.bench.services import Service
from codeenv.client import AsyncClient, Client, SessionLost
from codeenv.errors import InvalidRequest, SandboxError, SessionError, SessionErrorKind
from codeenv.models import SESSION_KEY_HEADER
from codeenv.queue.redis import RedisQueue
from codeenv.sandbox.inside.protocol import Cell
from codeenv.sandbox.sessions import FAMILIES_GROUP, Family, Session, SessionManager
from codeenv.sandbox.sizing import families_socket_memory_limit, socket_memory_limit
from codeenv.sandbox.uids import uids_in_use
from codeenv.settings import GatewaySettings
from tests.conftest import GatewayClient, Served, until
from tests.test_hardening import SOCKET_FLOOD

pytestmark = pytest.mark.jail


def manager(pool: SlotPool) -> SessionManager:
    assert pool.sessions is not None
    return pool.sessions


@contextlib.asynccontextmanager
async def new_session(m: SessionManager, profile: str) -> AsyncIterator[Session]:
    """A session of `profile`, deleted afterwards unless the test ended it."""
    s = await m.create(profile)
    try:
        yield s
    finally:
        if s.id in m.sessions:
            await m.delete(s.id)


async def cell(pool: SlotPool, session: Session | str, code: str, **limits: Any) -> ExecResult:
    sid = session if isinstance(session, str) else session.id
    return await pool.run(ExecRequest(code=code, session=sid, limits=limits, display_last=True))


def traces(m: SessionManager, session: Session) -> dict[str, Any]:
    """What of a session's family can be seen from outside: processes under its host uid, its cgroup."""
    uid = m.family_uid + session.family.uid_index
    cgroups = [d for d in m.tree.bases.values() if (d / FAMILIES_GROUP / f"family{session.family.fid}").exists()]
    return {"processes": [pid for u, pid in uids_in_use().items() if u == uid], "cgroups": cgroups}


#: A child process that outlives its cell (the image has no shell tools).
SLEEPER = "[sys.executable, '-c', 'import time; time.sleep(60)']"


async def cell_running(session: Session) -> None:
    """Until a cell of `session` runs: its process is in the session's group beside the pre-cell
    process, seen from outside."""
    group = session.family.groups[session.index]
    await until(lambda: len(group.procs()) > 1, "the cell started", 10)


async def gone(m: SessionManager, session: Session) -> None:
    await until(lambda: traces(m, session) == {"processes": [], "cgroups": []}, "the family's traces are gone", 10)


async def test_state_persists_and_values_come_back(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "math") as s:
        first = await cell(pool, s, "import math\nx = 41\ndef f(n):\n    return n + x")
        assert first.status == "ok" and first.value is None and first.execution_count == 1
        second = await cell(pool, s, "x += 1\nf(0)")
        assert second.status == "ok", second
        assert second.value == "42" and second.execution_count == 2 and second.rolled_back is False
        assert second.session == s.id
        files = await cell(pool, s, "open('notes.txt', 'w').write('kept')\nfh = open('notes.txt')")
        assert files.status == "ok"
        read = await cell(pool, s, "fh.read(), math.pi > 3")
        assert read.value == "('kept', True)"
        # Random state too: CPython reseeds `random` in a forked child, a session's cell must not.
        await cell(pool, s, "import random, numpy\nrandom.seed(1)\nnumpy.random.seed(1)")
        drawn = await cell(pool, s, "random.random(), numpy.random.random()")
        fresh = await cell(pool, s, "random.Random(1).random(), numpy.random.RandomState(1).random()")
        assert drawn.value == fresh.value


async def test_a_session_lives_through_more_cells_than_the_recursion_limit(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        limit = int((await cell(pool, s, "import sys\nn = 0\nsys.getrecursionlimit()")).value or "")
        for _ in range(limit + 100):
            result = await cell(pool, s, "n += 1")
            assert result.status == "ok", result
        assert (await cell(pool, s, "n")).value == str(limit + 100)


async def test_an_exception_keeps_the_effects_before_it(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        failed = await cell(pool, s, "y = 1\nprint('before')\n1 / 0\ny = 2")
        assert failed.status == "error" and not failed.rolled_back
        assert failed.error is not None and failed.error.type == "ZeroDivisionError" and failed.error.line == 3
        assert failed.stdout == "before\n" and 'File "<cell 1>", line 3' in failed.stderr
        assert "zygote" not in failed.stderr  # the traceback shows the cell, not the machinery
        assert (await cell(pool, s, "y")).value == "1"
        exited = await cell(pool, s, "y = 5\nraise SystemExit(3)")
        assert exited.status == "error" and exited.exit_code == 3 and not exited.rolled_back
        assert (await cell(pool, s, "y")).value == "5"


ROLLBACK_STATE = """
import numpy as np
def gen():
    yield from range(100)
it = gen()
next(it), next(it)
a = np.arange(6.0)
fd = open('log.txt', 'w')
n = 0
"""


@pytest.mark.parametrize("stop, limits, status", [
    ("n = 99\nnext(it)\na[:] = 0\nwhile True: pass", {"cpu_s": 1, "wall_s": 5}, "timeout"),
    ("n = 99\nnext(it)\na[:] = 0\nimport time\ntime.sleep(30)", {"wall_s": 1}, "timeout"),
    ("n = 99\nnext(it)\na[:] = 0\nhog = bytearray(400 << 20)\nhog[::4096] = b'x' * len(hog[::4096])",
     {"memory_mb": 128, "cpu_s": 20, "wall_s": 20}, "memory"),
    ("n = 99\nnext(it)\na[:] = 0\nhog = bytearray(64 << 20)\nhog[::4096] = b'x' * len(hog[::4096])",
     {"memory_mb": 1}, "memory"),  # a limit below what the cell's own fork needs
    ("n = 99\nnext(it)\na[:] = 0\nwhile True:\n    print('x' * 10000)", {"output_bytes": 10000}, "output_limit"),
    ("n = 99\nnext(it)\na[:] = 0\nimport os\nos._exit(7)", {}, "error"),
])
async def test_a_cell_stopped_by_a_limit_is_rolled_back(pool: SlotPool, stop: str, limits: dict[str, Any],
                                                        status: str) -> None:
    m = manager(pool)
    async with new_session(m, "math") as s:
        assert (await cell(pool, s, ROLLBACK_STATE)).status == "ok"
        stopped = await cell(pool, s, stop, **limits)
        assert stopped.status == status, (stopped.message, stopped)
        assert stopped.rolled_back is True and stopped.execution_count == 2
        after = await cell(pool, s, "fd.write('still open'); fd.flush()\nn, next(it), a.tolist()")
        assert after.status == "ok", after
        assert after.value == "(0, 2, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])"
        assert not after.rolled_back and after.execution_count == 3


async def test_the_oom_killer_takes_a_cell_before_the_session_it_came_from(pool: SlotPool) -> None:
    # A kept cell ran with the OOM killer's highest score and became the session: the next cell's
    # pre-cell process (it) must be back at the score it was born with, else the OOM killer may take
    # it and the session with it (its cell's own processes and it tied, seen as a flaky rollback).
    own = Path("/proc/self/oom_score_adj").read_text().strip()
    m = manager(pool)
    async with new_session(m, "light") as s:
        assert (await cell(pool, s, "x = 1")).status == "ok"
        scores = await cell(pool, s, "import os\n[open(f'/proc/{p}/oom_score_adj').read().strip()\n"
                                     " for p in (os.getpid(), os.getppid())]")
        assert scores.status == "ok", scores
        assert ast.literal_eval(scores.value or "") == ["1000", own]


async def test_files_a_rolled_back_cell_wrote_are_listed_and_remain(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        await cell(pool, s, "open('before.txt', 'w').write('1')")
        stopped = await cell(pool, s, "import os\nos.mkdir('d')\nopen('d/new.txt', 'w').write('2')\nwhile True: pass",
                             cpu_s=0.5)
        assert stopped.rolled_back and stopped.status == "timeout"
        assert sorted(stopped.written_files or []) == ["d", "d/new.txt"]
        listing = await cell(pool, s, "import os\nsorted(os.listdir('.')), open('d/new.txt').read()")
        assert listing.value == "(['before.txt', 'd'], '2')"


@pytest.mark.parametrize("before, cell_does, said, check, value", [
    ("import mmap\nm = mmap.mmap(-1, 8)\nm[:8] = b'original'", "m[:8] = b'ESCAPED!'",
     "1 shared writable memory mapping", "bytes(m[:8])", "b'ESCAPED!'"),
    ("import multiprocessing\nv = multiprocessing.Value('i', 1, lock=False)", "v.value = 99",
     "shared writable memory mapping", "v.value", "99"),
    ("import os\nf = os.open('data.txt', os.O_RDWR | os.O_CREAT)\nos.write(f, b'x' * 10)",
     "os.lseek(f, 5000, os.SEEK_SET)", "data.txt): its offset or flags as the cell left them (offset 5000, was 10)",
     "os.lseek(f, 0, os.SEEK_CUR)", "5000"),
    ("import os\nr, w = os.pipe()\nos.write(w, b'abc')", "os.read(r, 3)",
     "pipe:", "os.write(w, b'd')\nos.read(r, 4)", "b'd'"),
], ids=["mmap", "multiprocessing.Value", "file offset", "pipe"])
async def test_a_rollback_says_what_it_could_not_restore(pool: SlotPool, before: str, cell_does: str, said: str,
                                                         check: str, value: str) -> None:
    # Finding 11: a cell is a fork of its session's process, so it shares the session's shared
    # mappings and open file descriptions; a rollback cannot undo what it did through them.
    m = manager(pool)
    async with new_session(m, "light") as s:
        assert (await cell(pool, s, before)).status == "ok"
        stopped = await cell(pool, s, cell_does + "\nwhile True: pass", cpu_s=0.5)
        assert stopped.rolled_back and stopped.status == "timeout", stopped
        assert any(said in x for x in stopped.not_restored or []), stopped.not_restored
        assert (await cell(pool, s, check)).value == value  # as the result said: it stayed


async def test_a_rollback_that_could_restore_everything_says_so(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        assert (await cell(pool, s, "x = 1\nf = open('data.txt', 'w')")).status == "ok"
        stopped = await cell(pool, s, "x = 2\nwhile True: pass", cpu_s=0.5)
        assert stopped.rolled_back and stopped.not_restored == [] and stopped.written_files == [], stopped
        kept = await cell(pool, s, "x")
        assert kept.value == "1" and kept.not_restored is None and kept.written_files is None


SOCKETS = """import os
def sockets():
    found = []
    for fd in os.listdir('/proc/self/fd'):
        try:
            found += [fd] if os.readlink(f'/proc/self/fd/{fd}').startswith('socket:') else []
        except OSError:
            pass
    return len(found)
sockets()"""


async def test_a_cell_holds_no_socket_but_its_own_channel(pool: SlotPool) -> None:
    # The first session process kept the supervisor's end of its channel, and its cells and forks
    # with it: a fork could read its parent's messages to the supervisor, or send it cells.
    m = manager(pool)
    async with new_session(m, "light") as s:
        assert (await cell(pool, s, SOCKETS)).value == "1"
        child = await m.fork(s.id)
        assert (await cell(pool, child, SOCKETS)).value == "1"
        assert (await cell(pool, s, "sockets()")).value == "1"


async def test_a_fork_diverges_from_its_parent(pool: SlotPool) -> None:
    m = manager(pool)
    s = await m.create("light")
    try:
        await cell(pool, s, "xs = [1, 2]\nopen('shared.txt', 'w').write('parent')")
        child = await m.fork(s.id)
        assert child.id != s.id and child.cells == 1
        await cell(pool, child, "xs.append('child')\nopen('shared.txt', 'w').write('child')")
        await cell(pool, s, "xs.append('parent')")
        assert (await cell(pool, child, "xs, open('shared.txt').read()")).value == "([1, 2, 'child'], 'child')"
        assert (await cell(pool, s, "xs, open('shared.txt').read()")).value == "([1, 2, 'parent'], 'parent')"
        # Deleting the parent leaves the fork.
        await m.delete(s.id)
        assert (await cell(pool, child, "len(xs)")).value == "3"
    finally:
        for sid in (s.id, child.id):
            if sid in m.sessions:
                await m.delete(sid)


async def test_a_deleted_fork_leaves_no_process_in_its_family(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        forks = [await m.fork(s.id) for _ in range(3)]
        for f in forks:
            assert (await cell(pool, f, "1 + 1")).value == "2"
            await m.delete(f.id)
        # The supervisor, the session's process and this cell's: no fork, no zombie of one.
        seen = await cell(pool, s, "import os\nsorted(open(f'/proc/{p}/stat').read().split()[2] "
                                   "for p in os.listdir('/proc') if p.isdigit())")
        states = eval(seen.value or "")
        assert len(states) == 3 and "Z" not in states, seen


async def test_a_fork_asked_for_while_a_cell_runs_waits_for_it(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        running = asyncio.create_task(cell(pool, s, "import time\ntime.sleep(0.5)\nstate = 'after the cell'"))
        await cell_running(s)
        child = await m.fork(s.id)
        assert (await running).status == "ok"
        assert (await cell(pool, child, "state")).value == "'after the cell'"


async def test_cells_of_one_session_run_one_at_a_time_in_arrival_order(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        await cell(pool, s, "log = []")
        code = "import time\nlog.append(('start', {i}))\ntime.sleep(0.1)\nlog.append(('end', {i}))"
        results = await asyncio.gather(*(cell(pool, s, code.format(i=i)) for i in range(4)))
        assert all(r.status == "ok" for r in results)
        log = json.loads((await cell(pool, s, "import json\nprint(json.dumps(log))")).stdout)
        assert log == [[kind, i] for i in range(4) for kind in ("start", "end")]
        assert sorted(r.execution_count or 0 for r in results) == [2, 3, 4, 5]


async def test_a_retried_cell_id_runs_once(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        await cell(pool, s, "n = 0")
        request = ExecRequest(code="import time\ntime.sleep(0.2)\nn += 1\nn", session=s.id, cell_id="c-1",
                              display_last=True)
        first, second = await asyncio.gather(pool.run(request), pool.run(request))
        third = await pool.run(request)
        assert first.value == second.value == third.value == "1"
        assert first.execution_count == second.execution_count == 2
        assert (await cell(pool, s, "n")).value == "1"


async def test_a_cell_refused_by_admission_leaves_its_cell_id_free(pool: SlotPool) -> None:
    """A refused cell never ran: a retry with the same cell_id runs (it once waited for the refused
    one forever)."""
    m = manager(pool)
    async with new_session(m, "light") as s:
        too_big = ExecRequest(code="#" * (pool.settings.max_code_bytes + 1), session=s.id, cell_id="c-1")
        with pytest.raises(InvalidRequest, match="the limit is"):
            await pool.run(too_big)
        async with asyncio.timeout(30):
            retried = await pool.run(ExecRequest(code="1 + 1", session=s.id, cell_id="c-1", display_last=True))
        assert retried.status == "ok" and retried.value == "2", retried


async def test_a_lock_held_by_a_background_thread_does_not_deadlock_later_cells(pool: SlotPool) -> None:
    m = manager(pool)
    s = await m.create("light")
    try:
        # The thread spins once this cell is over (its prints then go to the session's /dev/null): this
        # cell's own output is what it prints before the cell ends, whatever the machine's speed.
        started = await cell(pool, s, """
import threading, sys
lock = threading.Lock()
over = threading.Event()
def spin():
    over.wait()
    while True:
        with lock:
            print('.' * 100, end='', flush=True)
        sys.stdout.write('')
threading.Thread(target=spin, daemon=True).start()
over.set()
""", output_bytes=1 << 24)
        assert started.status == "ok", started
        for i in range(5):
            later = await cell(pool, s, f"print('cell', {i})\nimport threading\nthreading.active_count()", wall_s=5)
            assert later.status == "ok" and later.stdout == f"cell {i}\n", later
            assert later.value == "1"  # the cell's process is a fork: the thread did not come along
    finally:
        await m.delete(s.id)


def family_cpu_s(session: Session) -> float:
    """CPU time the session's family has used so far, as its cgroup counts it."""
    used = session.family.cgroup.cpu_usage_ns()
    assert used is not None
    return used / 1e9


async def test_a_session_runs_nothing_between_cells(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        started = await cell(pool, s, """
import threading, time
stamps = []
def tick():
    while True:
        x = 0
        for _ in range(10**5):
            x += 1
        stamps.append(time.monotonic())
        del stamps[:-1000]
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.1)
""")
        assert started.status == "ok", started
        before, idle_from = family_cpu_s(s), time.monotonic()
        await asyncio.sleep(1.5)
        idle_to = time.monotonic()
        assert family_cpu_s(s) - before < 0.1, "the session's thread ran with no cell running"
        # The next cell's process is a fork made from the session's: it sees every stamp the thread
        # made, none of them while no cell ran (the clock is the host's: no time namespace).
        later = await cell(pool, s, f"len(stamps) > 10, [t for t in stamps if {idle_from} < t < {idle_to}]")
        assert later.status == "ok" and later.value == "(True, [])", later


async def test_a_session_whose_thread_spins_survives_being_stopped_and_resumed(pool: SlotPool) -> None:
    # Stopping a process and resuming it restarts its timed waits through restart_syscall (here: a
    # thread waiting for the GIL that the spinning one holds); without it glibc aborted the process.
    m = manager(pool)
    async with new_session(m, "light") as s:
        spin = ("import threading\ndef spin():\n    while True:\n        pass\n"
                "threading.Thread(target=spin, daemon=True).start()")
        assert (await cell(pool, s, spin)).status == "ok"
        for _ in range(3):
            stopped = await cell(pool, s, "while True:\n    pass", wall_s=0.5)
            assert stopped.status == "timeout" and stopped.rolled_back, stopped.message
            assert (await cell(pool, s, "21 * 2")).value == "42"


async def test_a_cell_that_announces_its_own_end_runs_no_further(pool: SlotPool) -> None:
    # Finding 7: it lifts its soft CPU limit, sends the cell's "done" on every socket it can find
    # and computes on; its answer may come early, but nothing of it runs after the answer.
    m = manager(pool)
    async with new_session(m, "light") as s:
        forged = await cell(pool, s, f"""
import gc, json, os, resource, socket, time
soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
for o in gc.get_objects():
    if isinstance(o, socket.socket) and o.family == socket.AF_UNIX:
        try:
            o.send(json.dumps({{"op": {Cell.DONE!r}, "exit_code": 0}}).encode())
        except OSError:
            pass
os.close(1)
os.close(2)
t0 = time.monotonic()
while time.monotonic() - t0 < 6:
    pass
""", wall_s=1, cpu_s=1)
        before = family_cpu_s(s)
        await asyncio.sleep(1.0)
        assert family_cpu_s(s) - before < 0.1, f"the cell ran on after its answer: {forged}"
        assert forged.cpu_s is not None and forged.cpu_s <= 1.5, forged


async def test_delete_leaves_no_process_cgroup_or_uid(pool: SlotPool) -> None:
    m = manager(pool)
    s = await m.create("light")
    setup = await cell(pool, s, f"import subprocess, sys\np = subprocess.Popen({SLEEPER})\n"
                                "open('big', 'wb').write(b'x' * 10**6)")
    assert setup.status == "ok", setup
    child = await m.fork(s.id)
    assert traces(m, s)["processes"] and traces(m, s)["cgroups"]
    await m.delete(s.id)
    assert traces(m, child)["processes"], "the fork lives on"
    await m.delete(child.id)
    await gone(m, s)
    with pytest.raises(SessionError) as lost:
        m.lookup(s.id)
    assert lost.value.kind is SessionErrorKind.ended and "deleted" in str(lost.value)


async def test_deleting_a_session_stops_its_running_cell(pool: SlotPool) -> None:
    m = manager(pool)
    s = await m.create("light")
    running = asyncio.create_task(cell(pool, s, "import time\ntime.sleep(30)", wall_s=60))
    await cell_running(s)
    t0 = asyncio.get_running_loop().time()
    await m.delete(s.id)
    result = await running
    assert result.status == "session_lost" and asyncio.get_running_loop().time() - t0 < 5, result
    await gone(m, s)


async def test_an_idle_session_expires(pool: SlotPool) -> None:
    m = manager(pool)
    s = await m.create("light", idle_ttl_s=0.5)
    await cell(pool, s, "x = 1")
    await until(lambda: s.id not in m.sessions, "the idle session expired", 10)
    await gone(m, s)
    result = await cell(pool, s, "x")
    assert result.status == "session_lost" and "idle" in (result.message or "")


async def test_the_least_recently_used_idle_session_is_evicted_under_memory_pressure(
        pool: SlotPool, monkeypatch: pytest.MonkeyPatch) -> None:
    m = manager(pool)
    old = await m.create("light")
    recent = await m.create("light")
    await cell(pool, recent, "x = 1")
    monkeypatch.setattr(m.settings, "session_min_available_mb", 1 << 30)  # more than any machine has
    with pytest.raises(SessionError) as refused:  # evicts every idle session, then: nothing left to evict
        await m.create("light")
    assert refused.value.kind is SessionErrorKind.full
    for s in (old, recent):
        await gone(m, s)
        assert "evicted" in str(pytest.raises(SessionError, m.lookup, s.id).value)


async def test_eviction_takes_only_the_sessions_of_the_client_that_needs_room(
        pool: SlotPool, monkeypatch: pytest.MonkeyPatch) -> None:
    m = manager(pool)
    alice, bob = b"a" * 32, b"b" * 32
    hers = await m.create("light", owner=alice)
    his = await m.create("light", owner=bob)
    try:
        monkeypatch.setattr(m.settings, "session_min_available_mb", 1 << 30)  # more than any machine has
        with pytest.raises(SessionError) as refused:  # bob's own idle session goes, then nothing of his is left
            await m.create("light", owner=bob)
        assert refused.value.kind is SessionErrorKind.full and "none of your sessions" in str(refused.value)
        await gone(m, his)
        assert m.lookup(hers.id, alice) is hers  # alice's is untouched
        assert (await pool.run(ExecRequest(code="1", session=hers.id))).status == "rejected"  # not b"" 's
    finally:
        monkeypatch.undo()
        if hers.id in m.sessions:
            await m.delete(hers.id, alice)


async def test_unknown_and_ended_ids_are_told_apart(pool: SlotPool) -> None:
    m = manager(pool)
    s = await m.create("light")
    await m.delete(s.id)
    never = await cell(pool, "no-such-session", "1")
    assert never.status == "rejected" and never.message is not None and never.message.startswith("no session")
    forged = s.id.rsplit(".", 1)[0] + ".AAAAAAAAAAAAAAAAAAAAAAAA"
    assert (await cell(pool, forged, "1")).status == "rejected"
    ended = await cell(pool, s.id, "1")
    assert ended.status == "session_lost" and not ended.started


async def test_a_restarted_worker_answers_its_old_sessions_lost(tmp_path: Path) -> None:
    settings = SandboxSettings(slots=1)
    async with SlotPool(settings) as first:
        s = await manager(first).create("light")
        assert (await cell(first, s, "x = 1")).status == "ok"
        family = s.family
        seen = traces(manager(first), s)
        assert seen["processes"]
    # The pool is closed: its families are gone with it.
    assert not [pid for u, pid in uids_in_use().items() if u == manager(first).family_uid + family.uid_index]
    async with SlotPool(settings) as second:
        result = await cell(second, s.id, "x")
        assert result.status == "session_lost" and "restarted" in (result.message or "")


KEEP_FLOODING = """
more = 0
for c in conns[::2]:
    while more < (512 << 20):
        try:
            more += c.send(chunk)
        except OSError:
            break
print(more >> 20)
"""


async def test_a_familys_socket_buffers_are_capped_across_its_cells(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        if m.tree.version == 1:  # set on every group of the family before its first process
            limits = [int((d / "memory.kmem.tcp.limit_in_bytes").read_text()) for d in (
                m.tree.bases["memory"] / FAMILIES_GROUP, *(Path(g.memory) for g in (  # type: ignore[attr-defined]
                    s.family.cgroup, s.family.main, s.family.groups[0])))]
            assert limits == [families_socket_memory_limit(m.settings)] + [socket_memory_limit(m.settings)] * 3
        first = await cell(pool, s, SOCKET_FLOOD, wall_s=30, memory_mb=128)
        assert first.status == "ok" and not first.rolled_back, first
        # The next cell finds the first one's sockets (and their buffers) and tries to queue more.
        second = await cell(pool, s, KEEP_FLOODING, wall_s=30, memory_mb=128)
        assert second.status == "ok", second
        queued_mb = int(first.stdout) + int(second.stdout)
    cap_mb = socket_memory_limit(m.settings) >> 20 if m.tree.version == 1 else m.settings.session_memory_mb
    assert queued_mb <= cap_mb + 16, (first.stdout, second.stdout, cap_mb)


# --- isolation ----------------------------------------------------------------------------------


async def test_a_session_cannot_reach_another_session(pool: SlotPool) -> None:
    m = manager(pool)
    a, b = await m.create("light"), await m.create("light")
    try:
        setup = await cell(pool, a, """
import os, socket, subprocess, sys
secret = open('secret.txt', 'w'); secret.write('a'); secret.flush()
srv = socket.socket(); srv.bind(('127.0.0.1', 45678)); srv.listen()
abstract = socket.socket(socket.AF_UNIX); abstract.bind('\\0codeenv-a'); abstract.listen()
child = subprocess.Popen(""" + SLEEPER + """)
os.getpid(), os.getuid(), os.getcwd()
""")
        assert setup.status == "ok", setup
        a_pid, a_uid, a_cwd = eval(setup.value or "")
        probe = await cell(pool, b, f"""
import os, socket, signal
seen = {{}}
seen['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
seen['uid'] = os.getuid()
seen['file'] = os.path.exists({a_cwd!r} + '/secret.txt')
try:
    socket.create_connection(('127.0.0.1', 45678), timeout=1); seen['tcp'] = 'connected'
except OSError as e:
    seen['tcp'] = type(e).__name__
try:
    s = socket.socket(socket.AF_UNIX); s.connect('\\0codeenv-a'); seen['abstract'] = 'connected'
except OSError as e:
    seen['abstract'] = type(e).__name__
seen['owners'] = sorted({{os.stat('/proc/' + p).st_uid for p in os.listdir('/proc') if p.isdigit()}})
seen['home'] = os.listdir(os.path.dirname(os.getcwd()))
seen
""")
        assert probe.status == "ok", probe
        seen = eval(probe.value or "")
        assert seen["uid"] != a_uid
        # Its own pid namespace: its supervisor, its session's process and the cell, all its own uid.
        # (A's processes have no pid here to signal: a pid names a process of this family only.)
        assert seen["pids"] == [1, 2, 3] and seen["owners"] == [seen["uid"]]
        assert a_pid in seen["pids"]  # the same number names another process in each family
        assert seen["file"] is False and seen["tcp"] == "ConnectionRefusedError"
        assert seen["abstract"] == "ConnectionRefusedError"
        assert seen["home"] == ["s0"]
        # A's own state is intact (its child process, as documented, ended with the cell that made it).
        intact = await cell(pool, a, "secret.write('b'); srv.fileno() > 0, child.poll() is not None")
        assert intact.value == "(True, True)"
    finally:
        await m.delete(a.id)
        await m.delete(b.id)


async def test_a_session_and_a_call_cannot_reach_each_other(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        setup = await cell(pool, s, "import socket, os\nsrv = socket.socket()\nsrv.bind(('127.0.0.1', 45679))\n"
                                    "srv.listen()\nos.getuid()")
        assert setup.status == "ok"
        call = await pool.run(ExecRequest(code="""
import os, socket
try:
    socket.create_connection(('127.0.0.1', 45679), timeout=1); print('connected')
except OSError as e:
    print(type(e).__name__)
print(sorted(os.stat('/proc/' + p).st_uid for p in os.listdir('/proc') if p.isdigit()))
""", profile="light"))
        assert call.stdout.splitlines()[0] == "ConnectionRefusedError"
        assert str(setup.value) not in call.stdout.splitlines()[1]


@pytest.mark.parametrize("code, status", [
    ("import os\nos.unshare(os.CLONE_NEWNET)", "killed"),
    ("import os\nos.unshare(os.CLONE_NEWUSER)", "killed"),
    ("import ctypes\nctypes.CDLL(None).syscall(56, 0x10000000 | 17, 0, 0, 0, 0)", "killed"),  # clone(NEWUSER)
    ("import ctypes\nctypes.CDLL(None).mount(b'none', b'/work', b'tmpfs', 0, None)", "killed"),
    ("import os\nos.setresuid(0, 0, 0)", "error"),
    ("import os\nos.setgroups([])", "error"),
])
async def test_a_session_cannot_use_what_set_up_its_family(pool: SlotPool, code: str, status: str) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        await cell(pool, s, "x = 1")
        result = await cell(pool, s, code)
        assert result.status == status, result
        if status == "error":
            assert result.error is not None and "Errno 38" in result.error.message  # ENOSYS, as in a call
        after = await cell(pool, s, "x")
        assert after.value == "1"


async def test_a_cell_that_kills_its_session_loses_only_its_own_family(pool: SlotPool) -> None:
    m = manager(pool)
    s, other = await m.create("light"), await m.create("light")
    try:
        await cell(pool, other, "x = 'other'")
        await cell(pool, s, "x = 'mine'")
        # kill(-1) reaches every process of its own family but itself: the stopped pre-cell process.
        # The cell ends by itself, so it is the session now.
        survived = await cell(pool, s, "import os, signal\nos.kill(-1, signal.SIGKILL)\nx")
        assert survived.status == "ok" and survived.value == "'mine'", survived
        # The same, then a limit: there is nothing left to roll back to, and the session says so.
        lost = await cell(pool, s, "import os, signal\nos.kill(-1, signal.SIGKILL)\nwhile True: pass", cpu_s=0.5)
        assert lost.status == "session_lost" and lost.started, lost
        assert (await cell(pool, s, "x")).status == "session_lost"
        assert (await cell(pool, other, "x")).value == "'other'"
    finally:
        for sid in (s.id, other.id):
            if sid in m.sessions:
                await m.delete(sid)


#: A cell that tries to reach every process of its family it can see: signal each (but its own
#: pre-cell process and the supervisor, PID 1, whom no signal reaches), read its memory and
#: environment, then kill(-1).
REACH_ALL = """
import os, signal
mine = {os.getpid(), os.getppid(), 1}
seen, signalled, opened = [], [], []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) not in mine:
        seen.append(int(p))
        try:
            os.kill(int(p), signal.SIGKILL); signalled.append(int(p))
        except OSError:
            pass
        for f in ('mem', 'environ', 'maps'):
            try:
                with open(f'/proc/{p}/{f}', 'rb') as fh:
                    if fh.read(1):  # a zombie's open, with nothing to read, is no reach
                        opened.append((p, f))
            except OSError:
                pass
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
(len(seen), signalled, opened)
"""


async def test_a_fork_reaches_no_process_of_its_family_but_its_own(pool: SlotPool) -> None:
    """Issue 34: under GRPO a rollout gains when its siblings' rewards fall. A fork that signals,
    reads or kills every process it can see leaves the session it came from and its sibling as
    they were."""
    m = manager(pool)
    async with new_session(m, "light") as s:
        await cell(pool, s, "x = 'parent'")
        attacker, sibling = await m.fork(s.id), await m.fork(s.id)
        await cell(pool, sibling, "x = 'sibling'")
        attack = await cell(pool, attacker, REACH_ALL)
        assert attack.status == "ok", attack
        seen, signalled, opened = ast.literal_eval(attack.value)
        assert seen >= 2 and signalled == [] and opened == [], attack.value  # it saw them, reached none
        assert (await cell(pool, s, "x")).value == "'parent'"
        assert (await cell(pool, sibling, "x")).value == "'sibling'"
        assert (await cell(pool, attacker, "x")).value == "'parent'"  # its kill(-1) took only its own


async def test_a_fork_sixteen_generations_deep_is_the_last(pool: SlotPool) -> None:
    m = manager(pool)
    async with new_session(m, "light") as s:
        await cell(pool, s, "x = 0")
        last = s
        for _ in range(16):
            last = await m.fork(last.id)
        assert (await cell(pool, last, "x")).value == "0"
        with pytest.raises(SessionError) as refused:
            await m.fork(last.id)
        assert refused.value.kind is SessionErrorKind.conflict and "16 generations" in str(refused.value)
        held = len(last.family.sessions), set(last.family.groups)
        with pytest.raises(SessionError) as refused:  # N at once: all or none
            await m.forks(last.id, count=3)
        assert "16 generations" in str(refused.value)
        assert (len(last.family.sessions), set(last.family.groups)) == held  # nothing kept, no group left
        assert (await cell(pool, last, "x + 1")).value == "1"


async def test_a_fork_the_kernel_will_not_keep_in_its_cgroup_ends_its_family(
        pool: SlotPool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork must not run without its own caps (on cgroup v1 in a user namespace the kernel refuses
    such moves): its family ends, saying why."""
    m = manager(pool)
    s = await m.create("light")
    other = await m.fork(s.id)
    try:
        await cell(pool, s, "x = 1")
        move = Family.move

        def refuse_forks(family: Family, pids: Any, to: Any) -> None:
            if to is not family.main and to is not family.groups.get(0) and pids:
                raise SandboxError("cannot move a session's process into its cgroup (Permission denied)")
            move(family, pids, to)

        monkeypatch.setattr(Family, "move", refuse_forks)
        with pytest.raises(SessionError) as lost:
            await m.fork(s.id)
        assert lost.value.kind is SessionErrorKind.ended and "could not be kept in its cgroup" in str(lost.value)
        assert "Permission denied" in str(lost.value)
        monkeypatch.undo()
        assert (await cell(pool, s, "x")).status == "session_lost"
        assert (await cell(pool, other, "x")).status == "session_lost"  # the whole family
        await gone(m, s)
    finally:
        for sid in (s.id, other.id):
            if sid in m.sessions:
                await m.delete(sid)


async def test_what_a_fork_keeps_counts_in_its_own_memory_cap(pool: SlotPool) -> None:
    """Issue 34: a fork that keeps as much memory as its cap allows leaves its parent and sibling
    their whole cap: each session of a family has a memory cap of its own."""
    m = manager(pool)
    cap_mb = m.settings.session_memory_mb  # the default: 1024
    grab = f"hog = b'x' * ({cap_mb - 128} << 20)\nlen(hog) >> 20"  # every page written: charged
    async with new_session(m, "light") as s:
        await cell(pool, s, "x = 'parent'")
        hog, sibling = await m.fork(s.id), await m.fork(s.id)
        kept = await cell(pool, hog, grab, memory_mb=cap_mb)
        assert kept.status == "ok" and kept.value == str(cap_mb - 128), kept
        over = await cell(pool, hog, "more = b'x' * (256 << 20)", memory_mb=cap_mb)  # past its own cap
        assert over.status == "memory" and over.rolled_back, over
        for other in (s, sibling):  # each may still take nearly its whole cap
            big = await cell(pool, other, grab, memory_mb=cap_mb)
            assert big.status == "ok" and big.value == str(cap_mb - 128), big
            assert (await cell(pool, other, "del hog\nx")).value == "'parent'"


# --- the API and the client ---------------------------------------------------------------------


#: A client's session key (the header every request about its sessions carries).
KEY = {SESSION_KEY_HEADER: "a-key-of-this-test-client"}


async def test_the_session_endpoints(gateway: GatewayClient) -> None:
    async with gateway(headers=KEY) as c:
        created = await c.post("/v1/sessions", json={"profile": "light", "limits": {"wall_s": 5}})
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        assert created.headers["location"] == f"/v1/sessions/{sid}"
        bare = await c.post("/v1/sessions")  # no body at all is fine
        assert bare.status_code == 201 and bare.json()["profile"] == "math"
        # An empty body sent as JSON (what `requests.post(url, headers=...)` sends) is no options too.
        as_json = {"content-type": "application/json"}
        empty = await c.post("/v1/sessions", content=b"", headers=as_json)
        assert empty.status_code == 201 and empty.json()["profile"] == "math", empty.text
        no_code = await c.post(f"/v1/sessions/{sid}/execute", content=b"", headers=as_json)
        assert no_code.status_code == 422 and "code" in no_code.text  # {} to the cell: it names what is missing
        assert (await c.post("/v1/execute", content=b"", headers=as_json)).status_code == 400
        ran = await c.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 6\nx * 7"})
        assert ran.status_code == 200 and ran.json()["value"] == "42" and ran.json()["execution_count"] == 1
        rolled = await c.post(f"/v1/sessions/{sid}/execute", json={"code": "x = 0\nwhile True: pass",
                                                                   "limits": {"cpu_s": 0.5}})
        assert rolled.json()["status"] == "timeout" and rolled.json()["rolled_back"] is True
        forked = await c.post(f"/v1/sessions/{sid}/fork")
        assert forked.status_code == 201
        fid = forked.json()["session_id"]
        batch = await c.post("/v1/execute/batch", json={"requests": [
            {"code": "x", "session": sid, "display_last": True},
            {"code": "x + 1", "session": fid, "display_last": True},
            {"code": "print('a plain call')"},
            {"code": "x", "session": "nope"},
        ]})
        results = batch.json()["results"]
        assert [r["status"] for r in results] == ["ok", "ok", "ok", "rejected"]
        assert [r["value"] for r in results[:2]] == ["6", "7"]
        listing = (await c.get("/v1/sessions")).json()["sessions"]
        assert {sid, fid} <= {s["session_id"] for s in listing}
        assert all(s["family_memory_bytes"] > 0 for s in listing)
        assert (await c.get(f"/v1/sessions/{sid}")).json()["cells"] == 3
        assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 204
        assert (await c.post(f"/v1/sessions/{sid}/execute", json={"code": "1"})).status_code == 410
        assert (await c.post("/v1/sessions/never/execute", json={"code": "1"})).status_code == 404
        assert (await c.delete(f"/v1/sessions/{sid}")).status_code == 410
        assert (await c.post(f"/v1/sessions/{sid}/fork")).status_code == 410
        bad = await c.post(f"/v1/sessions/{fid}/execute", json={"code": "1", "files": {"a": ""}})
        assert bad.status_code == 422
        over = await c.post("/v1/sessions", json={"limits": {"wall_s": 10**6}})
        assert over.status_code == 422 and "wall_s" in over.text
        for s in (fid, bare.json()["session_id"], empty.json()["session_id"]):
            assert (await c.delete(f"/v1/sessions/{s}")).status_code == 204


#: Ids no worker made: a non-ASCII MAC, digits int() would take (Arabic-Indic, "0x", "_", spaces),
#: other lengths and shapes, a NUL.
MALFORMED_IDS = ["1a.1.\u00e9", "1a.1.\u00e9" * 3, "\u0661\u0662.1.AAAAAAAAAAAAAAAAAAAAAAAA",
                 "0x1a.1.AAAAAAAAAAAAAAAAAAAAAAAA", "1_a.1.AAAAAAAAAAAAAAAAAAAAAAAA", " 1a.1.AAAAAAAAAAAAAAAAAAAAAAAA",
                 "1a.1.AAAAAAAAAAAAAAAAAAAAAAA=", "1a.1.2.3", "1a..", "a..b", "\x00", "f" * 150 + ".1.x", "1a.1.\udcff"]


async def test_a_malformed_session_id_is_a_404_everywhere(pool: SlotPool, served: Served) -> None:
    async with served() as url, httpx.AsyncClient(base_url=url, headers=KEY) as c:
        for sid in MALFORMED_IDS:
            path = "/v1/sessions/" + quote(sid.encode("utf-8", "surrogatepass"), safe="")
            for method, suffix, body in (("GET", "", None), ("DELETE", "", None), ("POST", "/fork", None),
                                         ("POST", "/execute", {"code": "1"})):
                got = await c.request(method, path + suffix, json=body)
                assert got.status_code == 404, (sid, method, suffix, got.text)
            if "\udcff" in sid:
                continue  # not valid UTF-8: JSON cannot carry it
            one = await c.post("/v1/execute", json={"code": "1", "session": sid})
            assert one.status_code == 404 and "no session" in one.text, (sid, one.text)
            batch = await c.post("/v1/execute/batch", json={"requests": [{"code": "1", "session": sid}]})
            [result] = batch.json()["results"]
            assert result["status"] == "rejected" and result["message"].startswith("no session"), (sid, result)
    for sid in MALFORMED_IDS[:-1]:  # and through the pool itself (a lone surrogate is no Text)
        r = await cell(pool, sid, "1")
        assert r.status == "rejected" and (r.message or "").startswith("no session"), (sid, r)


async def test_sessions_need_the_token_when_one_is_set(gateway: GatewayClient) -> None:
    async with gateway(token="sesame-sesame-sesame", headers=KEY) as c:
        assert (await c.post("/v1/sessions", json={})).status_code == 401
        assert (await c.get("/v1/sessions")).status_code == 401
        token = {"authorization": "Bearer sesame-sesame-sesame"}
        created = await c.post("/v1/sessions", json={"profile": "light"}, headers=token)
        sid = created.json()["session_id"]
        assert (await c.post(f"/v1/sessions/{sid}/execute", json={"code": "1"})).status_code == 401
        assert (await c.delete(f"/v1/sessions/{sid}", headers=token)).status_code == 204


@pytest.mark.redis
async def test_with_redis_and_no_worker_a_session_cannot_start_and_says_why(redis_server: Service,
                                                                           gateway: GatewayClient) -> None:
    """The Redis queue routes sessions (tests/test_session_routing.py); with no worker alive a new one
    is a 503, and an id of no live worker answers as a session that ended or never existed."""
    settings = {"redis_url": redis_server.url, "redis_prefix": uuid.uuid4().hex}
    queue = RedisQueue(GatewaySettings(slots=2, **settings))
    await queue.start()
    try:
        async with gateway(queue=queue, **settings) as client:
            created = await client.post("/v1/sessions", json={})
            assert created.status_code == 503 and "no worker is alive" in created.text, created.text
            assert (await client.get("/v1/sessions")).json() == {"sessions": [], "snapshots": []}
            gone = await client.post(f"/v1/sessions/{'a' * 12}.1.1.{'A' * 24}/execute", json={"code": "1"})
            assert gone.status_code == 410 and gone.json()["status"] == "session_lost", gone.text
            assert (await client.post("/v1/sessions/x/execute", json={"code": "1"})).status_code == 404
            assert (await client.delete(f"/v1/sessions/{'a' * 12}.1.1.{'A' * 24}")).status_code == 410
            assert [p for p in (await client.get("/openapi.json")).json()["paths"] if "sessions" in p]
    finally:
        await queue.close()


async def test_the_client_runs_cells_micro_batched(served: Served) -> None:
    async with served() as url, AsyncClient(url) as client:
        async with client.session(profile="light") as s:
            await s.run("import random\nrandom.seed(7)\nstate = [random.random()]")
            branches = [await s.fork() for _ in range(3)]
            before = client.requests_sent
            results = await asyncio.gather(*(b.run("state.append(random.random())\nlen(state), state[-1]")
                                             for b in branches), client.run("print('a call')"))
            assert client.requests_sent - before <= 2  # the cells and the call went out together
            values = {r.value for r in results[:3]}
            assert len(values) == 1 and results[3].stdout == "a call\n"  # same state, same draw
            for b in branches:
                await b.close()
        with pytest.raises(SessionLost) as lost:
            await s.run("1")
        assert lost.value.cells == 1 and lost.value.status_code == 410


async def test_a_lost_session_raises_or_replays_its_kept_cells(served: Served) -> None:
    """A session that ended under the client (here deleted by another client with its key, as a dead
    worker would end it) raises SessionLost with the cells it had run; with replay_on_loss its kept
    cells (not the rolled-back one) run again in a new session, then the cell that found it lost. A
    fork replays its parent's cells, then its own."""
    async with served() as url, AsyncClient(url) as client, httpx.AsyncClient(
            base_url=url, headers={"x-codeenv-session-key": client.session_key}) as other:
        plain = await client.session(profile="light")
        await plain.run("x = 1")
        await other.delete(f"/v1/sessions/{plain.id}")
        with pytest.raises(SessionLost) as lost:
            await plain.run("x")
        assert lost.value.cells == 1 and "ended after 1 cells" in str(lost.value)

        async with client.session(profile="light", replay_on_loss=True) as s:
            await s.run("x = [1]")
            assert (await s.run("x.append(2); 1 / 0")).status == "error"  # kept: an exception keeps state
            assert (await s.run("x.append(3); import time; time.sleep(9)", limits={"wall_s": 0.5})).rolled_back
            first = s.id
            await other.delete(f"/v1/sessions/{first}")
            replayed = await s.run("x")
            assert replayed.value == "[1, 2]" and s.id != first and s.replays == 1
            async with s.fork() as f:
                await f.run("x.append(4)")
                await other.delete(f"/v1/sessions/{f.id}")
                assert (await f.run("x")).value == "[1, 2, 4]" and f.replays == 1
            assert (await s.run("x")).value == "[1, 2]"


async def test_a_fork_opened_in_a_with_block_is_closed_after_it(served: Served) -> None:
    """`async with s.fork() as f:` (and `with s.fork() as f:` blocking) ends the fork with its block,
    as `client.session()` does; a fork left open would live until its idle TTL."""
    async with served() as url, AsyncClient(url) as client:
        async with client.session(profile="light") as s:
            await s.run("x = 1")
            async with s.fork() as f:
                assert (await f.run("x + 1")).value == "2"
            assert f.closed
            with pytest.raises(SessionLost):
                await f.run("x")
            kept = await s.fork()  # awaited: the caller closes it
            assert (await kept.run("x")).value == "1"
            await kept.close()

        def blocking() -> tuple[str | None, str, str]:
            with Client(url) as sync, sync.session(profile="light") as t:
                t.run("y = 5")
                with t.fork() as g:
                    value = g.run("y * 2").value
                try:
                    g.run("y")
                    after = "ran"
                except SessionLost:
                    after = "lost"
                return value, after, t.run("y").status

        assert await asyncio.to_thread(blocking) == ("10", "lost", "ok")
