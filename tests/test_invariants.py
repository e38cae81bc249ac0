"""The invariants that make a reused jail safe (shared/DESIGN.md), checked with hostile calls."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from codeenv import SlotPool
from tests.conftest import Runner

pytestmark = pytest.mark.jail

# Scans the child's own readable memory for HEAD immediately followed by TAIL. The two halves are
# separate literals, so the joined token exists in memory only if an earlier call left it there.
MEMORY_SCAN = """
import ctypes, re
head, tail = {head!r}.encode(), {tail!r}.encode()
found = 0
# Read in place (ctypes): the child is non-dumpable, so /proc/self/mem is not open to it.
with open('/proc/self/maps') as maps:
    for line in maps:
        m = re.match(r'([0-9a-f]+)-([0-9a-f]+) (r)', line)
        if not m or '[vvar]' in line or '[vsyscall]' in line or '[vvar_vclock]' in line:
            continue
        start, end = int(m.group(1), 16), int(m.group(2), 16)
        data = ctypes.string_at(start, end - start)
        i = data.find(head)
        while i >= 0:
            if data[i + len(head):i + len(head) + len(tail)] == tail:
                found += 1
            i = data.find(head, i + 1)
print('found', found)
"""


@pytest.mark.parametrize("profile", ["light", "math"])
async def test_no_request_bytes_survive_in_memory(run: Runner, profile: str) -> None:
    head, tail = secrets.token_hex(12), secrets.token_hex(12)
    token = head + tail
    first = await run(f"import sys\nsecret = {token!r}\nprint(sys.stdin.read() + secret)",
                      stdin=token, slot=0, profile=profile)
    assert first.stdout == token * 2 + "\n"
    second = await run(MEMORY_SCAN.format(head=head, tail=tail), slot=0, profile=profile, wall_s=30)
    assert second.status == "ok", second
    assert second.stdout == "found 0\n"


async def test_child_cannot_reach_pid_1(run: Runner) -> None:
    code = (
        "import os, glob\n"
        "for p in ['/proc/1/mem', '/proc/1/environ', '/proc/1/cmdline.x', '/proc/1/maps']:\n"
        "    try:\n"
        "        open(p, 'rb').read(1); print('OPENED', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p)\n"
        "try:\n"
        "    print('fds', os.listdir('/proc/1/fd'))\n"
        "except OSError:\n"
        "    print('denied fds')\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, b'x'); print('WROTE', fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('own fds', sorted(int(f) for f in os.listdir('/proc/self/fd')))\n"
    )
    r = await run(code)
    assert "OPENED" not in r.stdout and "WROTE" not in r.stdout and "denied fds" in r.stdout
    assert r.stdout.splitlines()[-1] == "own fds [0, 1, 2, 3]"  # 3 is listdir's own fd


async def test_signals_to_pid_1_parent_and_everyone_change_nothing(run: Runner, pool: SlotPool) -> None:
    before = pool.restarts
    code = (
        "import os, signal\n"
        "sent = 0\n"
        "for sig in range(1, 65):\n"
        "    if sig in (signal.SIGKILL, signal.SIGSTOP):\n"
        "        pass\n"
        "    for target in (1, os.getppid(), -1):\n"
        "        try:\n"
        "            os.kill(target, sig); sent += 1\n"
        "        except OSError:\n"
        "            pass\n"
        "print('sent', sent)\n"
    )
    for profile in ("light", "math"):
        r = await run(code, slot=1, profile=profile)
        assert r.status == "ok" and r.stdout.startswith("sent"), r
        await run.healthy_after(1, profile=profile)
    assert pool.restarts == before


TRACES = r"""
import os, socket, subprocess, sys, time
# a 3,000-deep tree
os.makedirs('deep', exist_ok=True)
fd = os.open('deep', os.O_RDONLY)
for _ in range(3000):
    os.mkdir('d', dir_fd=fd)
    nxt = os.open('d', os.O_RDONLY, dir_fd=fd); os.close(fd); fd = nxt
os.close(fd)
# 100k files
os.mkdir('wide')
for i in range(100_000):
    os.close(os.open(f'wide/{i}', os.O_CREAT | os.O_WRONLY))
# an unreadable directory, a FIFO, a socket file
os.makedirs('locked/inner'); open('locked/inner/f', 'w').write('x'); os.chmod('locked', 0)
os.mkfifo('fifo')
s = socket.socket(socket.AF_UNIX); s.bind('sock')
# POSIX shared memory and a semaphore
from multiprocessing import shared_memory
shm = shared_memory.SharedMemory(name='codeenv_test', create=True, size=4096)
import _multiprocessing
sem = _multiprocessing.SemLock(1, 1, 1, '/codeenv_sem', False)
# a daemonized double fork that outlives the call
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            open('/tmp/daemon-was-here', 'w').write(str(time.time())); time.sleep(0.05)
    os._exit(0)
time.sleep(0.2)
os.chmod('/work', 0)
print('left traces')
"""

CHECK = r"""
import os
print(repr((sorted(os.listdir('/work')), sorted(p for p in os.listdir('/proc') if p.isdigit()))))
"""


async def test_nothing_survives_into_the_next_call(run: Runner, pool: SlotPool) -> None:
    before = pool.restarts
    r = await run(TRACES, slot=0, wall_s=60)
    assert r.status == "ok" and r.stdout == "left traces\n", r
    check = await run(CHECK, slot=0)
    assert check.status == "ok", check
    listing, pids = eval(check.stdout)  # noqa: S307 - our own output
    assert listing == [] and len(pids) == 2  # the zygote (1) and this call's process
    assert pool.restarts == before


async def test_tampered_builtins_and_modules_are_pristine_next_time(run: Runner) -> None:
    for profile in ("light", "math"):
        tamper = (
            "import builtins, math, sys, os, random\n"
            "builtins.print = None\nbuiltins.len = lambda x: 42\nmath.pi = 3\n"
            "random.random = lambda: 0.5\nsys.modules['json'] = None\nos.environ['POISON'] = '1'\n"
            "sys.path.insert(0, '/nowhere')\n"
        )
        await run(tamper, slot=1, profile=profile)
        r = await run("import math, json, os, random, sys\n"
                      "print(len([1]), math.pi, random.random() != 0.5, 'POISON' in os.environ,\n"
                      "      '/nowhere' in sys.path, json.dumps(1))", slot=1, profile=profile)
        assert r.stdout == "1 3.141592653589793 True False False 1\n", r


async def test_fork_bomb_in_one_slot_does_not_starve_another(run: Runner) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    neighbour = (
        "import threading, os, time\n"
        "time.sleep(0.5)\n"
        "ts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(16)]\n"
        "[t.start() for t in ts]\n"
        "pids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(0.2); os._exit(0)\n"
        "    pids.append(pid)\n"
        "[os.waitpid(p, 0) for p in pids]; [t.join() for t in ts]\n"
        "print('neighbour fine')\n"
    )
    bomb_result, ok = await asyncio.gather(run(bomb, slot=0, wall_s=3), run(neighbour, slot=1, wall_s=10))
    assert ok.status == "ok" and ok.stdout == "neighbour fine\n", ok
    assert bomb_result.status != "ok"
    await run.healthy_after(0)


async def test_child_cannot_change_the_zygotes_limits_or_scheduling(run: Runner, pool: SlotPool) -> None:
    before = pool.restarts
    code = (
        "import os, resource\n"
        "attempts = {\n"
        "    'prlimit': lambda: resource.prlimit(1, resource.RLIMIT_NOFILE, (5, 5)),\n"
        "    'prlimit_as': lambda: resource.prlimit(os.getppid(), resource.RLIMIT_AS, (1 << 20, 1 << 20)),\n"
        "    'setpriority': lambda: os.setpriority(os.PRIO_PROCESS, 1, 19),\n"
        "    'setpriority_user': lambda: os.setpriority(os.PRIO_USER, 0, 19),\n"
        "    'affinity': lambda: os.sched_setaffinity(1, {0}),\n"
        "    'scheduler': lambda: os.sched_setscheduler(1, os.SCHED_IDLE, os.sched_param(0)),\n"
        "}\n"
        "for name, attempt in attempts.items():\n"
        "    try:\n"
        "        attempt(); print('CHANGED', name)\n"
        "    except OSError:\n"
        "        print('refused', name)\n"
        "os.nice(5)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))\n"
        "print('own limits ok')\n"
    )
    for profile in ("light", "math"):
        r = await run(code, slot=0, profile=profile)
        assert "CHANGED" not in r.stdout and r.stdout.endswith("own limits ok\n"), r
        r = await run("import os\nprint(os.getpriority(os.PRIO_PROCESS, 0), len(os.sched_getaffinity(0)) >= 1)",
                      slot=0, profile=profile)
        assert r.stdout == "0 True\n"
    assert pool.restarts == before


FORGE_REPORT = r"""
import sys, json
frame = sys._getframe(0)
while frame and 'report' not in frame.f_locals:
    frame = frame.f_back
report = frame.f_locals['report']
data = json.dumps(dict(setup_error="forged")).encode() if MODE == 'setup' else b'[' * 30000
report[:4] = len(data).to_bytes(4, 'little')
report[4:4 + len(data)] = data
print('scribbled')
"""


@pytest.mark.parametrize("mode", ["setup", "deep"])
async def test_scribbling_on_the_report_cannot_forge_the_status(run: Runner, mode: str) -> None:
    r = await run(f"MODE = {mode!r}\n" + FORGE_REPORT)
    assert r.status == "ok" and r.stdout == "scribbled\n", r


async def test_default_acl_on_the_work_dir_does_not_survive(run: Runner, pool: SlotPool) -> None:
    code = (
        "import os, struct\n"
        "# a default ACL: user::---, group::---, other::--- (xattr format version 2)\n"
        "entry = lambda tag, perm: struct.pack('<HHI', tag, perm, 0xFFFFFFFF)\n"
        "acl = struct.pack('<I', 2) + entry(1, 0) + entry(4, 0) + entry(32, 0)\n"
        "try:\n"
        "    os.setxattr('/work', 'system.posix_acl_default', acl)\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print(os.listxattr('/work'))\n"
    )
    r = await run(code, slot=1)
    # Extended attributes cannot be set at all (ENOSYS: outside the seccomp allowlist); the worker
    # would wipe them anyway.
    assert r.status == "ok" and r.stdout == "refused 38\n[]\n", r
    r = await run("open('f', 'w').write('x')\nprint(open('f').read(), __import__('os').listxattr('/work'))", slot=1)
    assert r.stdout == "x []\n", r


async def test_wide_trees_of_directories_are_wiped_quickly(run: Runner, pool: SlotPool) -> None:
    before = pool.restarts
    r = await run("import os\nfor i in range(20000):\n    os.mkdir(f'd{i}')\nos.makedirs('a/b/c')", slot=0, wall_s=30)
    assert r.status == "ok"
    r = await asyncio.wait_for(run("import os\nprint(os.listdir('.'))", slot=0), 20)
    assert r.stdout == "[]\n"
    assert pool.restarts == before
