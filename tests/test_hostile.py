"""Hostile programs get a verdict, and the next call on the same slot still works."""

from __future__ import annotations

import resource

import pytest

from codeenv import SlotPool
from tests.conftest import Runner

pytestmark = pytest.mark.jail


@pytest.fixture
def restarts(pool: SlotPool) -> RestartCounter:
    return RestartCounter(pool)


class RestartCounter:
    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.before = pool.restarts

    @property
    def delta(self) -> int:
        return self.pool.restarts - self.before


async def test_infinite_loop(run: Runner, restarts: RestartCounter) -> None:
    r = await run("while True:\n    pass", slot=0, wall_s=1)
    assert r.status == "timeout" and r.limit in ("wall", "cpu") and r.started
    assert 0.9 < r.wall_s < 2.5
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_sleep_past_the_wall_limit_with_signals_blocked(run: Runner, restarts: RestartCounter) -> None:
    code = "import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, range(1, 65))\ntime.sleep(60)"
    r = await run(code, slot=0, wall_s=1)
    assert r.status == "timeout" and r.limit == "wall"
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_cpu_limit_fires_before_wall(run: Runner, restarts: RestartCounter) -> None:
    code = (
        "import threading\n"
        "def burn():\n    while True: pass\n"
        "for _ in range(4): threading.Thread(target=burn).start()\n"
    )
    r = await run(code, slot=1, wall_s=5, cpu_s=1)
    assert r.status == "timeout" and r.limit == "cpu"
    assert r.cpu_s >= 0.9
    await run.healthy_after(1)
    assert restarts.delta == 0


async def test_child_closes_its_streams_and_keeps_running(run: Runner, restarts: RestartCounter) -> None:
    code = (
        "import os, time\n"
        "print('parent says hi', flush=True)\n"
        "if os.fork() == 0:\n"
        "    os.close(1); os.close(2)\n"
        "    while True: time.sleep(0.01)\n"
    )
    r = await run(code, slot=0, wall_s=5)
    assert r.status == "ok" and r.stdout == "parent says hi\n"
    assert r.wall_s < 2  # the parent's exit ends the call; the orphan is killed
    r = await run("import os, time\nos.close(1); os.close(2)\nwhile True: time.sleep(0.01)", slot=0, wall_s=1)
    assert r.status == "timeout"
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_sigstop_self(run: Runner, restarts: RestartCounter) -> None:
    r = await run("import os, signal\nprint('stopping', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)",
                  slot=1, wall_s=1)
    assert r.status == "timeout" and r.stdout == "stopping\n"
    await run.healthy_after(1)
    assert restarts.delta == 0


async def test_unread_stdin_while_printing(run: Runner, restarts: RestartCounter) -> None:
    r = await run("import sys\nsys.stdout.write('x' * 1_000_000)", stdin="y" * 10_000_000,
                  slot=0, output_bytes=2_000_000)
    assert r.status == "ok" and len(r.stdout) == 1_000_000 and not r.stdout_truncated
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_control_bytes_do_not_multiply_the_answer(run: Runner, restarts: RestartCounter) -> None:
    """100 KB of \\x01 under a 128 KiB cap fits as bytes but is 600 KB as JSON: cut to the cap."""
    r = await run("import sys\nsys.stdout.write('\\x01' * 100_000)\nprint('end', file=sys.stderr)",
                  slot=0, output_bytes=128 << 10)
    assert r.status == "ok" and r.stdout_truncated and not r.stderr_truncated and r.stderr == "end\n"
    assert len(r.model_dump_json(include={"stdout"}).encode()) <= (128 << 10) + 20
    assert r.stdout == "\x01" * len(r.stdout) and len(r.stdout) > 20_000
    assert restarts.delta == 0


@pytest.mark.parametrize("code", [
    "x = bytearray(2 * 1024**3)",
    "b = []\nwhile True:\n    b.append(bytearray(10 * 1024**2))",
    "import numpy as np\na = np.ones(400 * 1024**2 // 8 * 2)",
])  # `'a' * 2**62` fails at once with MemoryError, no OOM event: `error` (tests/test_hardening.py)
async def test_memory_bombs(run: Runner, restarts: RestartCounter, code: str) -> None:
    r = await run(code, slot=1, memory_mb=256, wall_s=10)
    assert r.status == "memory" and r.limit == "memory", r
    await run.healthy_after(1, profile="math")
    await run.healthy_after(1)
    assert restarts.delta == 0


async def test_memory_bomb_across_processes(run: Runner, restarts: RestartCounter) -> None:
    code = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        x = bytearray(64 * 1024**2)\n"
        "        for i in range(0, len(x), 4096): x[i] = 1\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "for pid in pids: os.waitpid(pid, 0)\n"
    )
    r = await run(code, slot=0, memory_mb=256, wall_s=10)
    assert r.status == "memory" and r.limit == "memory", r
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_fork_bomb(run: Runner, restarts: RestartCounter) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = await run(code, slot=1, wall_s=2)
    assert r.status in ("timeout", "error", "killed") and r.limit is not None
    await run.healthy_after(1)
    assert restarts.delta == 0


async def test_thread_bomb(run: Runner, restarts: RestartCounter) -> None:
    code = (
        "import threading, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        threading.Thread(target=time.sleep, args=(100,), daemon=True).start(); n += 1\n"
        "except RuntimeError as e:\n"
        "    print('stopped at', n, e)\n"
    )
    r = await run(code, slot=0, wall_s=5)
    assert r.status == "ok" and r.stdout.startswith("stopped at") and r.limit == "pids"
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_huge_stdout_is_output_limit_and_bounded(run: Runner, restarts: RestartCounter) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = await run("import sys\nchunk = 'z' * 65536\nfor _ in range(1600):\n    sys.stdout.write(chunk)",
                  slot=1, wall_s=10)
    assert r.status == "output_limit" and r.limit == "output" and r.stdout_truncated
    assert len(r.stdout.encode()) == 64 * 1024
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50_000  # KB
    await run.healthy_after(1)
    assert restarts.delta == 0


async def test_huge_stderr_is_output_limit(run: Runner) -> None:
    r = await run("import sys\nwhile True:\n    sys.stderr.write('e' * 10000)", slot=0, wall_s=10)
    assert r.status == "output_limit" and r.stderr_truncated and not r.stdout_truncated


async def test_invalid_utf8_and_nul_bytes(run: Runner, restarts: RestartCounter) -> None:
    r = await run("import sys\nsys.stdout.buffer.write(b'ok\\x00\\xff\\xfe\\xc3(end')\n"
                  "sys.stderr.buffer.write(b'\\x80\\x00')", slot=0)
    assert r.status == "ok"
    assert r.stdout == "ok\x00\ufffd\ufffd\ufffd(end"
    assert r.stderr == "\ufffd\x00"
    assert restarts.delta == 0


async def test_fake_traceback_with_exit_zero_is_ok(run: Runner) -> None:
    code = ("import sys\nsys.stderr.write('Traceback (most recent call last):\\n  File \"x\", line 1\\n"
            "MemoryError\\n')\nprint('fine')")
    r = await run(code, slot=1)
    assert r.status == "ok" and r.error is None and r.limit is None


async def test_fake_memory_error_text_with_exit_one_is_an_error(run: Runner) -> None:
    r = await run("import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)", slot=1)
    assert r.status == "error" and r.error is None


async def test_file_size_limit(run: Runner, restarts: RestartCounter) -> None:
    r = await run("open('big', 'wb').write(b'x' * (3 * 1024**2))", slot=0, file_size_mb=1)
    assert r.status == "error" and r.limit == "file_size"
    await run.healthy_after(0)
    assert restarts.delta == 0


async def test_work_dir_is_capped(run: Runner, restarts: RestartCounter) -> None:
    code = ("try:\n    with open('fill', 'wb') as f:\n        for _ in range(1000): f.write(b'x' * 1024**2)\n"
            "except OSError as e:\n    print(e.errno)")
    r = await run(code, slot=1, file_size_mb=1024, wall_s=20, memory_mb=2048)
    assert r.status == "ok" and r.stdout == "28\n"  # ENOSPC
    await run.healthy_after(1)
    assert restarts.delta == 0


async def test_one_call_uses_at_most_its_cpu_share(run: Runner) -> None:
    code = (
        "import threading, time\n"
        "end = time.monotonic() + 1.5\n"
        "def burn():\n    while time.monotonic() < end: pass\n"
        "ts = [threading.Thread(target=burn) for _ in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
    )
    r = await run(code, slot=0, wall_s=10)
    assert r.status == "ok"
    assert r.cpu_s < 1.5 * 1.2 + 0.2  # one core's worth (cpus_per_call = 1), not four


async def test_patched_exit_and_streams_do_not_confuse_the_runner(run: Runner, restarts: RestartCounter) -> None:
    code = (
        "import os, sys, atexit\n"
        "print('bye', flush=True)\n"
        "os._exit = lambda code: None\n"
        "sys.exit = None\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "sys.stdout = None\n"
    )
    r = await run(code, slot=1, wall_s=5)
    assert r.status == "ok" and r.stdout == "bye\n" and r.wall_s < 2, r
    await run.healthy_after(1)
    assert restarts.delta == 0
