"""The jail shows nothing of the host (its seccomp policy: tests/test_hardening.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import codeenv
from tests.conftest import Runner

pytestmark = pytest.mark.jail


async def test_no_host_secrets(run: Runner, tmp_path: Path) -> None:
    secret = tmp_path / "root-only"
    secret.write_text("host secret")
    os.chmod(secret, 0o600)
    code = (
        "import os\n"
        f"for p in ['/etc/shadow', {str(secret)!r}, '/proc/1/environ', {codeenv.__file__!r},\n"
        "          '/root/.bashrc', '/var/lib/codeenv', '/sys/fs/cgroup', '/proc/1/mem']:\n"
        "    try:\n"
        "        open(p, 'rb').read(10); print('READ', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
    )
    r = await run(code)
    assert r.status == "ok" and "READ" not in r.stdout and r.stdout.count("denied") == 8


async def test_root_listing_is_the_image(run: Runner) -> None:
    r = await run("import os\nprint(sorted(os.listdir('/')))")
    assert json.loads(r.stdout.replace("'", '"')) == sorted(
        ["dev", "etc", "lib", "lib64", "proc", "tmp", "usr", "work"])


async def test_cannot_write_outside_the_work_dir(run: Runner) -> None:
    code = (
        "for p in ['/x', '/etc/passwd', '/usr/local/lib/python3.12/os.py', '/proc/sys/kernel/hostname',\n"
        "          '/lib64/ld-linux-x86-64.so.2', '/usr/lib/codeenv/codeenv_inside/calls.py']:\n"
        "    try:\n"
        "        open(p, 'a').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )
    r = await run(code)
    assert "WROTE" not in r.stdout and r.stdout.count("refused") == 6


async def test_no_network(run: Runner) -> None:
    code = (
        "import socket\n"
        "for target in [('127.0.0.1', 6379), ('10.0.0.1', 80), ('8.8.8.8', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(target, timeout=1); print('CONNECTED', target)\n"
        "    except OSError as e:\n"
        "        print('no route', e.errno)\n"
        "try:\n"
        "    socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
        "except OSError as e:\n"
        "    print('no dns')\n"
    )
    r = await run(code, wall_s=10)
    assert r.status == "ok"
    assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout and "no dns" in r.stdout


async def test_environment_shows_nothing_of_the_host(run: Runner) -> None:
    r = await run("import os, json\nprint(json.dumps(dict(os.environ)))")
    env = json.loads(r.stdout)
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                        "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                        "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "LC_CTYPE"}
    for value in env.values():
        assert "/root" not in value and "codeenv" not in value.lower()


async def test_runs_as_an_unprivileged_user(run: Runner) -> None:
    r = await run("import os\nprint(os.getuid(), os.getgid(), os.geteuid())\n"
                  "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    uid, gid, euid, cap_eff = r.stdout.split()
    assert (uid, gid, euid) == ("1000", "1000", "1000") and int(cap_eff, 16) == 0


async def test_slots_have_distinct_host_uids(pool: codeenv.SlotPool) -> None:
    uids = set()
    for slot in pool.slots:
        for z in slot.zygotes.values():
            uids.add((slot.index, os.stat(f"/proc/{z.zygote_pid}").st_uid))
    assert len({u for _, u in uids}) == len(pool.slots)
    assert all(u >= 100_000 for _, u in uids)
