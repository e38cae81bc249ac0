"""The jail shows nothing of the host and refuses what the seccomp policy names."""

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
        "          '/lib64/ld-linux-x86-64.so.2', '/usr/lib/codeenv/zygote.py']:\n"
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


SECCOMP_CASES = {
    "ptrace": "libc.ptrace(16, 1, 0, 0)",
    "process_vm_readv": "libc.syscall(310, 1, 0, 0, 0, 0, 0)",
    "process_vm_writev": "libc.syscall(311, 1, 0, 0, 0, 0, 0)",
    "pidfd_getfd": "libc.syscall(438, 0, 0, 0)",
    "mount": "libc.mount(b'none', b'/work', b'tmpfs', 0, None)",
    "umount2": "libc.umount2(b'/proc', 0)",
    "pivot_root": "libc.syscall(155, b'/work', b'/work')",
    "unshare": "libc.unshare(0x20000)",
    "unshare_user": "libc.unshare(0x10000000)",
    "setns": "libc.setns(0, 0)",
    "clone_newpid": "libc.syscall(56, 0x20000000 | 17, 0, 0, 0, 0)",
    "clone3": "libc.syscall(435, 0, 0)",
    "bpf": "libc.syscall(321, 0, 0, 0)",
    "perf_event_open": "libc.syscall(298, 0, 0, -1, -1, 0)",
    "userfaultfd": "libc.syscall(323, 0)",
    "io_uring_setup": "libc.syscall(425, 1, 0)",
    "keyctl": "libc.syscall(250, 0, 0, 0, 0, 0)",
    "add_key": "libc.syscall(248, b'user', b'k', b'v', 1, -2)",
    "request_key": "libc.syscall(249, b'user', b'k', 0, 0)",
    "kexec_load": "libc.syscall(246, 0, 0, 0, 0)",
    "init_module": "libc.syscall(175, 0, 0, b'')",
    "finit_module": "libc.syscall(313, 0, b'', 0)",
    "open_by_handle_at": "libc.syscall(304, 0, 0, 0)",
    "reboot": "libc.syscall(169, 0, 0, 0, 0)",
    "swapon": "libc.swapon(b'swapfile', 0)",
    "settimeofday": "libc.syscall(164, 0, 0)",
    "clock_settime": "libc.syscall(227, 0, 0)",
    "shmget": "libc.shmget(0, 4096, 0o1600)",
    "semget": "libc.semget(0, 1, 0o1600)",
    "msgget": "libc.msgget(0, 0o1600)",
    "mq_open": "libc.syscall(240, b'q', 0o100, 0o600, 0)",
    "netlink": "socket.socket(16, socket.SOCK_RAW, 0)",
    "packet": "socket.socket(17, socket.SOCK_RAW, 0)",
    "vsock": "socket.socket(40, socket.SOCK_STREAM, 0)",
}


@pytest.mark.parametrize("name", sorted(SECCOMP_CASES))
async def test_seccomp_refuses(run: Runner, name: str) -> None:
    code = (
        "import ctypes, socket\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "try:\n"
        f"    rc = {SECCOMP_CASES[name]}\n"
        "    print('rc', rc, ctypes.get_errno())\n"
        "except OSError as e:\n"
        "    print('rc', -1, e.errno)\n"
    )
    r = await run(code)
    assert r.status == "ok", r
    _, rc, errno = r.stdout.split()
    assert int(rc) == -1 and int(errno) in (1, 38, 97), r.stdout  # EPERM, ENOSYS, EAFNOSUPPORT


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
