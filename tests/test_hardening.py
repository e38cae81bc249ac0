"""The jail's hardening (issue: nothing a call does reaches the host's shared pools, its zygote, its
verdict or the next call): the seccomp allowlist, the ABI filter, socket families, the verdict,
OOM scores, socket buffers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.sandbox import seccomp
from codeenv.sandbox.cgroups import CgroupLayout
from codeenv.sandbox.sizing import families_socket_memory_limit, socket_memory_limit
from codeenv.sandbox.syscall_audit import PROBES, logged_calls
from tests.conftest import Runner

SIGSYS = 31

CALL = """
import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
try:
    rc = {call}
    print('rc', rc, ctypes.get_errno())
except OSError as e:
    print('rc', -1, e.errno)
"""

#: Calls that reach host-wide state or would undo the jail: the call ends with SIGSYS.
KILLED = {
    "io_setup (legacy AIO)": "libc.syscall(206, 1, ctypes.byref(ctypes.c_ulong(0)))",
    "syslog": "libc.syscall(103, 10, 0, 0)",
    "shmget": "libc.syscall(29, 0, 4096, 0o1600)",
    "semget": "libc.syscall(64, 0, 1, 0o1600)",
    "msgget": "libc.syscall(68, 0, 0o1600)",
    "modify_ldt": "libc.syscall(154, 0, 0, 0)",
    "io_uring_setup": "libc.syscall(425, 1, 0)",
    "userfaultfd": "libc.syscall(323, 0)",
    "bpf": "libc.syscall(321, 0, 0, 0)",
    "perf_event_open": "libc.syscall(298, 0, 0, -1, -1, 0)",
    "mount": "libc.syscall(165, b'none', b'/work', b'tmpfs', 0, 0)",
    "unshare(CLONE_NEWNS)": "libc.syscall(272, 0x20000)",
    "setns": "libc.syscall(308, 0, 0)",
    "clone with CLONE_NEWNET": "libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0)",
    "personality(READ_IMPLIES_EXEC)": "libc.syscall(135, 0x0400000)",
    "prctl(PR_SET_DUMPABLE, 1)": "libc.syscall(157, 4, 1, 0, 0, 0)",
    "ptrace": "libc.syscall(101, 16, 1, 0, 0)",
    "process_vm_readv": "libc.syscall(310, 1, 0, 0, 0, 0, 0)",
    "process_vm_writev": "libc.syscall(311, 1, 0, 0, 0, 0, 0)",
    "pidfd_getfd": "libc.syscall(438, 0, 0, 0)",
    "umount2": "libc.syscall(166, b'/proc', 0)",
    "pivot_root": "libc.syscall(155, b'/work', b'/work')",
    "unshare(CLONE_NEWUSER)": "libc.syscall(272, 0x10000000)",
    "unshare(CLONE_NEWNET), which the zygote may call": "libc.syscall(272, 0x40000000)",
    "clone with CLONE_NEWPID": "libc.syscall(56, 0x20000000 | 17, 0, 0, 0, 0)",
    "semop": "libc.syscall(65, 0, 0, 0)",
    "io_submit": "libc.syscall(209, 0, 0, 0)",
    "kexec_load": "libc.syscall(246, 0, 0, 0, 0)",
    "init_module": "libc.syscall(175, 0, 0, b'')",
    "finit_module": "libc.syscall(313, 0, b'', 0)",
    "reboot": "libc.syscall(169, 0, 0, 0, 0)",
    "swapon": "libc.syscall(167, b'swapfile', 0)",
    "getpid through the x32 ABI": "libc.syscall(39 | 0x40000000)",
    "socket through the x32 ABI": "libc.syscall(41 | 0x40000000, 2, 1, 0)",
}

#: Outside the allowlist (ENOSYS: glibc falls back where it can), or refused for their arguments.
REFUSED = {
    "setxattr": ("libc.syscall(188, b'/work', b'user.x', b'1', 1, 0)", 38),
    "clone3": ("libc.syscall(435, 0, 0)", 38),
    "mq_open": ("libc.syscall(240, b'q', 0o100, 0o600, 0)", 38),
    "sync": ("libc.syscall(162)", 38),
    "open_by_handle_at": ("libc.syscall(304, 0, 0, 0)", 38),
    "settimeofday": ("libc.syscall(164, 0, 0)", 38),
    "clock_settime": ("libc.syscall(227, 0, 0)", 38),
    "removexattr": ("libc.syscall(197, b'/work', b'user.x')", 38),
    "fanotify_init": ("libc.syscall(300, 0, 0)", 38),
    "fanotify_mark": ("libc.syscall(301, 0, 0, 0, 0, 0)", 38),
    "inotify_init1": ("libc.syscall(294, 0)", 38),
    "inotify_init": ("libc.syscall(253)", 38),
    "inotify_add_watch": ("libc.syscall(254, 0, b'/', 0xfff)", 38),
    "keyctl": ("libc.syscall(250, 0, 0, 0, 0, 0)", 38),
    "add_key": ("libc.syscall(248, b'user', b'k', b'v', 1, -2)", 38),
    "request_key": ("libc.syscall(249, b'user', b'k', 0, 0)", 38),
    "process_madvise": ("libc.syscall(440, 0, 0, 0, 0, 0)", 38),
    "AF_NETLINK": ("socket.socket(16, socket.SOCK_RAW, 0)", 97),
    "AF_PACKET": ("socket.socket(17, socket.SOCK_RAW, 0)", 97),
    "AF_VSOCK": ("socket.socket(40, socket.SOCK_STREAM, 0)", 97),
    "AF_ALG": ("socket.socket(38, socket.SOCK_SEQPACKET, 0)", 97),
    "AF_KEY": ("socket.socket(15, socket.SOCK_RAW, 2)", 97),
    "AF_BLUETOOTH": ("socket.socket(31, socket.SOCK_STREAM, 0)", 97),
    "IPPROTO_UDPLITE": ("socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 136)", 93),
    "IPPROTO_UDPLITE on AF_INET6": ("socket.socket(socket.AF_INET6, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 136)", 93),
    "IPPROTO_SCTP": ("socket.socket(socket.AF_INET, socket.SOCK_STREAM, 132)", 93),
    "ping socket (IPPROTO_ICMP)": ("socket.socket(socket.AF_INET, socket.SOCK_DGRAM, 1)", 93),
    "SOCK_RAW": ("socket.socket(socket.AF_INET, socket.SOCK_RAW, 255)", 94),
    "SOCK_SEQPACKET (SCTP)": ("socket.socket(socket.AF_INET, socket.SOCK_SEQPACKET, 0)", 94),
    "SOCK_DCCP": ("socket.socket(socket.AF_INET, 6, 0)", 94),
    "socketpair with a protocol": ("socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM, 1)", 93),
    "prlimit64 of another process": ("libc.syscall(302, 1, 7, 0, 0)", 1),
    "chattr (FS_IOC_SETFLAGS)": ("libc.syscall(16, open('f', 'w').fileno(), 0x40086602, "
                                 "ctypes.byref(ctypes.c_long(0x10)))", 1),
}


@pytest.mark.jail
@pytest.mark.parametrize("name", sorted(KILLED))
async def test_calls_that_reach_the_host_end_the_call(run: Runner, name: str) -> None:
    r = await run(CALL.format(call=KILLED[name]))
    assert r.status == "killed" and r.signal == SIGSYS and "rc" not in r.stdout, r


@pytest.mark.jail
async def test_the_32_bit_entry_ends_the_call(run: Runner) -> None:
    # getpid through `int 0x80` (the i386 ABI), from machine code in an executable page.
    code = (
        "import ctypes, mmap\n"
        "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "page.write(bytes.fromhex('b814000000cd80c3'))  # mov eax, 20; int 0x80; ret\n"
        "address = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
        "print('rc', ctypes.CFUNCTYPE(ctypes.c_int)(address)())\n"
    )
    r = await run(code)
    # SIGSYS from the ABI filter; a kernel without 32-bit emulation faults (SIGSEGV) before it.
    assert r.status == "killed" and r.signal in (SIGSYS, 11) and "rc" not in r.stdout, r


@pytest.mark.jail
@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_calls_outside_the_allowlist_are_refused(run: Runner, name: str) -> None:
    call, expected = REFUSED[name]
    r = await run(CALL.format(call=call))
    assert r.status == "ok", r
    _, rc, errno = r.stdout.split()
    assert (int(rc), int(errno)) == (-1, expected), r.stdout


@pytest.mark.jail
async def test_tcp_udp_and_unix_sockets_still_work(run: Runner) -> None:
    code = (
        "import socket\n"
        "for proto in (0, socket.IPPROTO_TCP):\n"
        "    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC, proto)\n"
        "    server.bind(('127.0.0.1', 0)); server.listen()\n"
        "    client = socket.create_connection(server.getsockname())\n"
        "    peer, _ = server.accept(); client.sendall(b'tcp'); print(peer.recv(3).decode())\n"
        "for proto in (0, socket.IPPROTO_UDP):\n"
        "    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK, proto)\n"
        "    a.bind(('127.0.0.1', 0)); a.setblocking(True)\n"
        "    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, proto); b.sendto(b'udp', a.getsockname())\n"
        "    print(a.recv(3).decode())\n"
        "for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET):\n"
        "    x, y = socket.socketpair(socket.AF_UNIX, kind); x.send(b'unix'); print(y.recv(4).decode())\n"
    )
    r = await run(code)
    assert r.status == "ok" and r.stdout.split() == ["tcp", "tcp", "udp", "udp", "unix", "unix", "unix"], r


@pytest.mark.jail
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PROBES))
async def test_what_calls_use_still_works(run: Runner, name: str) -> None:
    r = await run(PROBES[name], wall_s=60, cpu_s=60)
    assert r.status == "ok", (r.stderr[-2000:], r.message)


@pytest.mark.unit
def test_the_policy_is_data_and_compiles_in_every_mode() -> None:
    allowed = seccomp.read_allowlist(seccomp.syscalls_file("python-math"))
    assert "read" in allowed and "clone3" not in allowed and not set(allowed) & set(seccomp.KILLED)
    text = seccomp.policy("allowlist", allowed)
    assert text.rstrip().endswith("DEFAULT ERRNO(38)")
    assert seccomp.policy("audit", allowed).rstrip().endswith("DEFAULT LOG")
    assert seccomp.syscalls_file("an-image-without-its-own") == seccomp.syscalls_file("python-math")


@pytest.mark.unit
@pytest.mark.parametrize("name", ["clone3", "io_setup", "ptrace", "inotify_init1", "keyctl"])
def test_an_allowlist_cannot_allow_what_the_policy_refuses(tmp_path: Path, name: str) -> None:
    from codeenv.errors import ImageError

    (tmp_path / "syscalls.txt").write_text(f"read\n{name}  # added by hand\n")
    with pytest.raises(ImageError, match=f"{name} may not be allowed"):
        seccomp.read_allowlist(tmp_path / "syscalls.txt")


@pytest.mark.unit
def test_audit_records_are_read_for_the_pools_uids() -> None:
    records = [
        '5,1,2,-;audit: type=1326 audit(1.2:3): auid=4294967295 uid=1500000001 gid=1500000001 ses=4294967295 '
        'subj=unconfined pid=9 comm="python3" exe="/usr/local/bin/python3.12" sig=0 arch=c000003e syscall=188 '
        'compat=0 ip=0x7f code=0x7ffc0000',
        '5,2,3,-;audit: type=1326 audit(1.2:4): auid=4294967295 uid=1000 gid=1000 ses=1 pid=10 comm="x" '
        'exe="/x" sig=0 arch=c000003e syscall=1 compat=0 ip=0x1 code=0x7ffc0000',
    ]
    assert logged_calls(records, range(1_500_000_000, 1_500_000_002)) == {188: 1}


# --- the verdict comes from the kernel and the worker, never from what the program can write -------

FORGED_REPORT = """
import sys
frame = sys._getframe()
while frame is not None and "report" not in frame.f_locals:  # up to the zygote's child set-up
    frame = frame.f_back
frame.f_globals["write_report"](frame.f_locals["report"], {"error": {"type": "MemoryError", "message": "forged",
                                                                      "line": 1}})
print("exits 0")
"""


@pytest.mark.jail
async def test_a_forged_report_changes_no_verdict(run: Runner) -> None:
    r = await run(FORGED_REPORT)
    assert (r.status, r.exit_code, r.limit, r.stdout) == ("ok", 0, None, "exits 0\n"), r


@pytest.mark.jail
async def test_a_memory_error_without_an_oom_event_is_an_error(run: Runner) -> None:
    r = await run("x = [0] * (1 << 62)")  # refused by the allocator at once: the kernel never runs out
    assert (r.status, r.limit) == ("error", None), r
    assert r.error is not None and r.error.type == "MemoryError"


# --- the OOM killer never prefers the zygote -------------------------------------------------------


@pytest.mark.jail
async def test_a_calls_processes_have_the_highest_oom_score_and_cannot_lower_it(run: Runner) -> None:
    code = (
        "import subprocess, sys\n"
        "print(open('/proc/self/oom_score_adj').read().strip())\n"
        "print(subprocess.run([sys.executable, '-c', 'print(open(\\'/proc/self/oom_score_adj\\').read().strip())'],\n"
        "                     capture_output=True, text=True).stdout.strip())\n"
        "try:\n"
        "    open('/proc/self/oom_score_adj', 'w').write('-1000')\n"
        "    print('lowered')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    r = await run(code)
    lines = r.stdout.split()
    assert r.status == "ok" and lines[:2] == ["1000", "1000"] and lines[2] == "refused", r


@pytest.mark.jail
@pytest.mark.slow
@pytest.mark.parametrize("prefork", [True, False])
async def test_interpreters_over_the_limit_lose_to_the_oom_killer_not_the_zygote(prefork: bool) -> None:
    settings = SandboxSettings(slots=1, prefork=prefork)
    async with SlotPool(settings) as pool:
        zygote = pool.slots[0].zygotes["scientific"]  # the largest zygote: the OOM killer's favourite
        before = zygote.zygote_pid
        # The call becomes a fresh small interpreter (exec) that starts 30 more: the zygote, with
        # numpy and scipy loaded, is then by far the largest process of the cgroup.
        spawn = ("import subprocess, sys\n"
                 "procs = [subprocess.Popen([sys.executable, '-c', 'x = bytearray(8 << 20); import time; "
                 "time.sleep(3)']) for _ in range(30)]\n"
                 "print(sorted(p.wait() for p in procs))\n")
        code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {spawn!r}])\n"
        r = await pool.run(ExecRequest(code=code, profile="scientific", limits={"memory_mb": 128, "wall_s": 30,
                                                                            "processes": 64}))
        assert r.status == "memory", r
        assert Path(f"/proc/{before}").exists() and not zygote.dead  # noqa: ASYNC240 (procfs)
        assert (await pool.run(ExecRequest(code="print('next')", profile="scientific"))).stdout == "next\n"
        assert zygote.zygote_pid == before and pool.restarts == 0


# --- kernel memory a call uses counts against a limit ----------------------------------------------

SOCKET_FLOOD = """
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(256)
queued, conns, chunk = 0, [], b"x" * 65536
for _ in range(100):  # each connection: a send buffer and the peer's receive buffer, never read
    c = socket.create_connection(srv.getsockname()); s, _ = srv.accept()
    c.setblocking(False); conns += [c, s]
    while queued < (512 << 20):
        try:
            queued += c.send(chunk)
        except OSError:
            break
    if queued >= (512 << 20):
        break
print(queued >> 20)
"""


@pytest.mark.jail
async def test_socket_buffers_a_call_queues_are_capped(run: Runner, pool: SlotPool) -> None:
    layout = CgroupLayout.detect(pool.settings.cgroup_root)
    r = await run(SOCKET_FLOOD, wall_s=30)
    assert r.status == "ok", r
    cap_mb = socket_memory_limit(pool.settings) >> 20
    # v1: the jail's TCP limit; v2: the memory limit (socket buffers are charged to memory.current).
    limit_mb = cap_mb if layout.version == 1 else pool.settings.defaults.memory_mb
    assert int(r.stdout) <= limit_mb + 16, (r.stdout, limit_mb)


@pytest.mark.unit
def test_all_slots_socket_buffers_stay_below_half_the_hosts_tcp_pressure(tmp_path: Path) -> None:
    tcp_mem = tmp_path / "tcp_mem"
    tcp_mem.write_text("1000 25600 40000\n")  # pressure at 25,600 pages: 100 MiB
    settings = SandboxSettings(slots=4, socket_memory_mb=64)
    assert socket_memory_limit(settings, tcp_mem) * 4 <= 50 << 20
    assert socket_memory_limit(SandboxSettings(slots=1, socket_memory_mb=8), tcp_mem) == 8 << 20
    assert socket_memory_limit(settings, tmp_path / "missing") == 64 << 20
    # Session families together: a quarter of the pressure, on top of the slots' half.
    assert families_socket_memory_limit(settings, tcp_mem) == 25 << 20
    assert families_socket_memory_limit(SandboxSettings(sessions_max=1, socket_memory_mb=8), tcp_mem) == 8 << 20


# --- nothing of a call survives into the next call in the same slot -------------------------------


@pytest.mark.jail
async def test_work_dir_timestamps_a_call_sets_do_not_survive(run: Runner, pool: SlotPool) -> None:
    before = pool.restarts
    r = await run("import os\nos.utime('/work', (1, 1))\nprint(os.stat('/work').st_mtime)", slot=0)
    assert r.stdout == "1.0\n", r
    r = await run("import os\nst = os.stat('/work')\nprint(st.st_mtime != 1, st.st_atime != 1)", slot=0)
    assert r.stdout == "True True\n", r
    assert pool.restarts == before  # reset by the zygote, checked from outside: no recycle needed


NETWORK_TRACES = """
import socket
print(open('/proc/net/snmp').read().split('Tcp:')[2].split()[4:6])  # ActiveOpens, PassiveOpens
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
srv.bind(("127.0.0.1", 40000)); srv.listen()
c = socket.create_connection(("127.0.0.1", 40000)); s, _ = srv.accept()
c.close(); s.close(); srv.close()  # the connection closed first by the client: TIME_WAIT on its side
print(open('/proc/net/sockstat').read().split('tw ')[1].split()[0])
"""


@pytest.mark.jail
async def test_a_call_holds_no_capability(run: Runner, pool: SlotPool) -> None:
    # The zygote keeps CAP_SYS_ADMIN and CAP_NET_ADMIN in the jail's user namespace (a fresh network
    # namespace, the pid counter); every child it forks drops them before anything else.
    r = await run("for line in open('/proc/self/status'):\n"
                  "    if line.startswith(('CapInh', 'CapPrm', 'CapEff', 'CapAmb')):\n"
                  "        print(line.split()[1])", slot=0)
    assert r.stdout.split() == ["0000000000000000"] * 4, r
    zygote = pool.slots[0].zygotes["math"]
    status = Path(f"/proc/{zygote.zygote_pid}/status").read_text()
    caps = dict(line.split(":\t", 1) for line in status.splitlines() if line.startswith("Cap"))
    assert int(caps["CapEff"], 16) == (1 << 21) | (1 << 12), caps  # CAP_SYS_ADMIN, CAP_NET_ADMIN


#: Forks `n` children, then one more; prints its own pid and the last child's.
FORKS = """import os
for _ in range({n} + 1):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.wait()
print(os.getpid(), pid)"""


@pytest.mark.jail
async def test_each_call_starts_from_the_same_pids(run: Runner, pool: SlotPool) -> None:
    # Finding 14: the pid counter carried about 15 bits from a call to the next on its slot.
    start = pool.restarts
    quiet = await run(FORKS.format(n=0), slot=0)
    assert quiet.status == "ok", quiet
    busy = await run(FORKS.format(n=300), slot=0)
    assert busy.status == "ok" and int(busy.stdout.split()[0]) == int(quiet.stdout.split()[0]), (quiet, busy)
    after = await run(FORKS.format(n=0), slot=0)
    assert after.stdout == quiet.stdout, (quiet, after)  # not the 300 more it would have been
    assert pool.restarts == start


#: Makes `n` files (and with `churn`, makes and removes one that many times), then one more; prints
#: that one's inode number.
INODES = """import os
for i in range({n}):
    open(f"f{{i}}", "w").close()
    if {churn}:
        os.remove(f"f{{i}}")
open("probe", "w").close()
print(os.stat("probe").st_ino)"""


@pytest.mark.jail
@pytest.mark.parametrize("churn", [False, True], ids=["kept", "removed"])
async def test_each_call_starts_from_the_same_inode_numbers(run: Runner, pool: SlotPool, churn: bool) -> None:
    # Finding 14: the work dir's inode counter carried about 15 bits from a call to the next. Files
    # made and removed again leave the dir's usage as it was, but not its counter.
    start = pool.restarts
    quiet = await run(INODES.format(n=0, churn=False), slot=1)
    busy = await run(INODES.format(n=500, churn=churn), slot=1)
    assert busy.status == "ok" and int(busy.stdout) > int(quiet.stdout) + 400, (quiet, busy)
    after = await run(INODES.format(n=0, churn=False), slot=1)
    assert after.stdout == quiet.stdout, (quiet, after)
    listed = await run("import os\nprint(os.listdir('.'))", slot=1)  # a listing moves the dir's atime only
    assert listed.stdout == "[]\n", listed
    assert (await run(INODES.format(n=0, churn=False), slot=1)).stdout == quiet.stdout
    assert pool.restarts == start


@pytest.mark.jail
async def test_a_call_that_used_the_network_leaves_the_next_a_fresh_namespace(run: Runner, pool: SlotPool) -> None:
    start = pool.restarts
    first = await run(NETWORK_TRACES, slot=1)
    assert first.status == "ok" and first.stdout.splitlines()[0] == "['0', '0']", first
    second = await run(NETWORK_TRACES, slot=1)  # the same port binds again; no counter of the first call
    assert second.status == "ok" and second.stdout == first.stdout, (first, second)
    third = await run(NETWORK_TRACES, slot=1)
    assert third.stdout == first.stdout, third
    assert pool.restarts == start  # a fresh network namespace from the same zygote each time


@pytest.mark.jail
async def test_the_zygote_catches_no_signal(pool: SlotPool) -> None:
    for slot in pool.slots:
        for zygote in slot.zygotes.values():
            status = Path(f"/proc/{zygote.zygote_pid}/status").read_text()  # noqa: ASYNC240 (procfs)
            caught = next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1]
            assert int(caught, 16) == 0, (zygote.name, caught)


#: Takes an exclusive lock on an image file (the standard library's os.py) and keeps it a while.
LOCK_NB = "import fcntl, os\nf = open(os.__file__, 'rb')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
HOLD_IMAGE_LOCK = LOCK_NB + "import time\ntime.sleep(4)\nprint('held')"
TRY_IMAGE_LOCK = f"try:\n    exec({LOCK_NB!r})\n    print('free')\nexcept BlockingIOError:\n    print('taken')"


@pytest.mark.jail
async def test_a_lock_on_an_image_file_is_seen_by_no_other_jail(run: Runner, pool: SlotPool) -> None:
    """Finding 12: every jail bind-mounted the same image directory, so a lock one took on an image
    file (a read-only fd is enough) was held for every other: a channel between tenants. Each jail
    now has an overlay of the image of its own."""
    holder = asyncio.create_task(run(HOLD_IMAGE_LOCK, slot=0))
    await asyncio.sleep(1.5)
    assert (await run(TRY_IMAGE_LOCK, slot=1)).stdout == "free\n"
    assert (await holder).stdout == "held\n"
    assert pool.sessions is not None
    session = await pool.sessions.create("light")
    try:
        kept = await pool.run(ExecRequest(code=LOCK_NB, session=session.id))
        assert kept.status == "ok", kept
        assert (await run(TRY_IMAGE_LOCK, slot=0)).stdout == "free\n"  # the session holds it still
    finally:
        await pool.sessions.delete(session.id)
