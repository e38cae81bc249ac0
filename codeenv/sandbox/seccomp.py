"""The jails' seccomp policy: an allowlist per image; calls that reach host-wide state kill the call.

Three parts, in the order a call's system call meets them (the first rule that matches decides):

1. **Killed** (`KILLED`, `KILLED_WHEN`): calls that reach pools or state of the whole host that no
   cgroup limits, or that would undo the jail: legacy AIO contexts, the kernel log, SysV
   IPC, io_uring, userfaultfd, bpf, perf events, mounts, new namespaces (unshare, setns, clone
   with a namespace flag), modify_ldt, personality other than the default, making a process
   dumpable again. The call ends with SIGSYS.
2. **Refused** (`REFUSED_WHEN`): allowed calls with arguments that would reach another process or
   the host: a socket family other than AF_UNIX, AF_INET and AF_INET6 (EAFNOSUPPORT, before the
   kernel loads or parses that family), a socket type other than stream or datagram
   (ESOCKTNOSUPPORT) or a protocol other than TCP or UDP (EPROTONOSUPPORT), limits, priorities or
   CPU affinity of another process, inode flags (`chattr`) of the work dir (EPERM); and, whatever
   their arguments, the calls of `NEVER_ALLOWED` (ENOSYS): clone3, inotify, fanotify and keyrings.
3. **Allowed**: the image's list (``sandbox_images/NAME/syscalls.txt``; images without one use
   python-math's). Anything else answers ENOSYS, the errno on which glibc falls back (clone3 to
   clone, faccessat2 to faccessat, close_range to a loop).

Calls through another ABI never get this far: the zygote installs a second filter (`abi_filter`,
raw BPF) that kills any call made with the x32 bit set in its number or through the 32-bit entry,
so that no number can bypass a rule by its x32 alias. Both filters apply (the stricter wins).

``CODEENV_SECCOMP=audit`` logs (SECCOMP_RET_LOG) instead of ENOSYS, so that the kernel log names
what an image's programs need (``codeenv image syscalls``); ``legacy`` is the denylist that came
before, for A/B measurements.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from codeenv.errors import ImageError
from codeenv.sandbox.image import search_dirs

#: Killed whatever their arguments.
KILLED = (
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    "syslog",
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl",
    "msgget", "msgsnd", "msgrcv", "msgctl",
    "modify_ldt", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "bpf",
    "perf_event_open", "mount", "umount", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig",
    "fspick", "move_mount", "open_tree", "mount_setattr", "unshare", "setns",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "quotactl",
)
#: ENOSYS on purpose, whatever an allowlist says (and in audit mode too): clone3 passes its flags in
#: memory, where seccomp cannot see a namespace flag (glibc falls back to clone, whose flags it
#: checks). The others draw on per-user kernel quotas that the kernel charges, up the chain of user
#: namespaces, to the uid that created the jail's namespace: host root, whose inotify instances and
#: watches, fanotify groups and marks, and keys (maxkeys, maxbytes) every root process on the host
#: shares. No tool call needs them; programs that probe for them (watchdog, keyring) fall back.
NEVER_ALLOWED = ("clone3", "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
                 "fanotify_init", "fanotify_mark", "add_key", "request_key", "keyctl")
#: 0x7e020000 = CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET; 0xffffffff asks
#: personality() for the current one; PR_SET_DUMPABLE is 4.
KILLED_WHEN = (
    "clone(flags) { (flags & 0x7e020000) != 0 }",
    "personality(persona) { persona != 0 && persona != 0xffffffff }",
    "prctl(option, value) { option == 4 && value != 0 }",
)
#: A socket's type without its flags (SOCK_NONBLOCK 0x800, SOCK_CLOEXEC 0x80000; the mask also drops
#: the upper half of the register, which the kernel ignores): STREAM 1, DGRAM 2, SEQPACKET 5.
_TYPE = "(type & 0xfff7f7ff)"
#: EPERM (1), EPROTONOSUPPORT (93), ESOCKTNOSUPPORT (94) or EAFNOSUPPORT (97) for these arguments.
#: Sockets: families AF_UNIX, AF_INET and AF_INET6; types STREAM and DGRAM (SEQPACKET too on AF_UNIX,
#: which the zygote's own channels use); protocols 0, IPPROTO_TCP (6) and IPPROTO_UDP (17) only, so
#: that the kernel never loads or parses a rarely used protocol (UDP-Lite, SCTP, DCCP, L2TP, SMC, raw,
#: ping) for a jail. ioctl: FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR.
REFUSED_WHEN = {
    97: ("socket(family, type, protocol) { family != 1 && family != 2 && family != 10 }",
         "socketpair(family, type, protocol) { family != 1 }"),
    94: (f"socket(family, type, protocol) {{ {_TYPE} != 1 && {_TYPE} != 2 && ({_TYPE} != 5 || family != 1) }}",
         f"socketpair(family, type, protocol) {{ {_TYPE} != 1 && {_TYPE} != 2 && {_TYPE} != 5 }}"),
    93: ("socket(family, type, protocol) { protocol != 0 && protocol != 6 && protocol != 17 }",
         "socketpair(family, type, protocol) { protocol != 0 }"),
    1: ("prlimit64(pid) { pid != 0 }", "sched_setaffinity(pid) { pid != 0 }",
        "sched_setscheduler(pid) { pid != 0 }", "sched_setparam(pid) { pid != 0 }",
        "sched_setattr(pid) { pid != 0 }", "setpriority(which, who) { which != 0 || who != 0 }",
        "ioprio_set(which, who) { which != 1 || who != 0 }",
        "ioctl(fd, request) { request == 0x40086602 || request == 0x401c5820 }"),
}

#: The denylist before the allowlist (CODEENV_SECCOMP=legacy), kept for A/B measurements.
LEGACY_POLICY = """
POLICY codeenv {
  ERRNO(1) {
    ptrace, process_vm_readv, process_vm_writev, pidfd_getfd, process_madvise, kcmp,
    mount, umount, pivot_root, chroot, unshare, setns,
    fsopen, fsmount, fsconfig, fspick, move_mount, open_tree, mount_setattr,
    bpf, perf_event_open, userfaultfd,
    keyctl, add_key, request_key,
    kexec_load, kexec_file_load, init_module, finit_module, delete_module,
    open_by_handle_at, reboot, swapon, swapoff,
    settimeofday, clock_settime, clock_adjtime, adjtimex,
    shmget, shmat, shmctl, shmdt, semget, semop, semtimedop, semctl,
    msgget, msgsnd, msgrcv, msgctl,
    mq_open, mq_unlink, mq_timedsend, mq_timedreceive, mq_notify, mq_getsetattr
  },
  ERRNO(38) { io_uring_setup, io_uring_enter, io_uring_register, clone3 },
  ERRNO(1) { clone { (clone_flags & 0x7e020000) != 0 } },
  ERRNO(1) {
    prlimit64 { pid != 0 }, sched_setaffinity { pid != 0 }, sched_setscheduler { pid != 0 },
    sched_setparam { pid != 0 }, sched_setattr { pid != 0 },
    setpriority { which != 0 || who != 0 }, ioprio_set { which != 1 || who != 0 }
  },
  ERRNO(97) { socket { family == 16 || family == 17 || family == 40 } }
}
USE codeenv DEFAULT ALLOW
"""

MODES = ("allowlist", "audit", "legacy")
ENOSYS = 38


def syscalls_file(image_name: str) -> Path:
    """The allowlist of image `image_name`: its own syscalls.txt, else python-math's (ImageError if
    neither is found where image declarations are: $CODEENV_IMAGE_PATH, then the shipped ones)."""
    for name in (image_name, "python-math"):
        for directory in search_dirs():
            candidate = directory / name / "syscalls.txt"
            if candidate.is_file():
                return candidate
    looked = ", ".join(str(d) for d in search_dirs())
    raise ImageError(f"no seccomp allowlist for image {image_name}: put a syscalls.txt next to its image.toml "
                     f"(looked in {looked})")


def read_allowlist(path: Path) -> list[str]:
    names = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not re.fullmatch(r"[a-z][a-z0-9_]*|SYSCALL\[\d+\]", name):
            raise ImageError(f"{path}:{number}: {name!r} is not a system call name (or SYSCALL[number])")
        if name in KILLED or name in NEVER_ALLOWED:
            raise ImageError(f"{path}:{number}: {name} may not be allowed (codeenv.sandbox.seccomp refuses it)")
        names.append(name)
    return sorted(set(names))


#: Allowed in every jail whatever the image's list says: the kernel's own way back into a call that a
#: stop (SIGSTOP, then SIGCONT) or a signal interrupted. Without it a timed futex wait (a thread
#: waiting for the GIL) answers ENOSYS after a stop, and glibc aborts the process.
ALWAYS_ALLOWED = ("restart_syscall",)

#: What a session jail's zygote and its families' supervisors need on top of a call jail's list, to
#: give each family its namespaces, mounts and uid. Each supervisor stacks `family_filter` before any
#: session process exists, so no user code can make these calls (they kill it, or answer ENOSYS).
SESSION_SETUP = ("unshare", "mount", "setresuid", "setresgid", "setgroups")
#: landlock_create_ruleset and landlock_restrict_self (the same numbers on every architecture): a
#: session's fork enters a Landlock domain of its own (`inside.proc.enter_own_domain`). A cell may
#: make them too: they can only restrict the caller.
LANDLOCK = ("SYSCALL[444]", "SYSCALL[446]")
#: What a call jail's zygote needs on top of the image's list: a fresh network namespace (unshare)
#: after a call used the network, and its own mount of /proc (mount, umount2: Kafel's "umount") for
#: the pid counter; its children drop the capabilities these need (capset: with none left, it can
#: only drop). Every child stacks `family_filter` before anything else, so no call can make the others.
CALL_SETUP = ("unshare", "mount", "umount", "capset")


def policy(mode: str, allowed: list[str], sessions: bool = False, calls: bool = False) -> str:
    """The Kafel policy of a jail in `mode` with the image's `allowed` calls (of a session jail:
    with SESSION_SETUP and LANDLOCK allowed too; of a call jail whose zygote keeps capabilities: CALL_SETUP)."""
    if mode == "legacy":
        return LEGACY_POLICY
    if mode not in MODES:
        raise ValueError(f"unknown seccomp mode {mode!r}; choose from {', '.join(MODES)}")
    killed: tuple[str, ...] = KILLED
    allowed = sorted({*allowed, *ALWAYS_ALLOWED})
    for setup, wanted in ((SESSION_SETUP + LANDLOCK, sessions), (CALL_SETUP, calls)):
        if wanted:
            killed = tuple(name for name in killed if name not in setup)
            allowed = sorted({*allowed, *setup})
    lines = ["POLICY codeenv_killed {", f"  KILL_PROCESS {{ {', '.join(killed)} }},",
             f"  KILL_PROCESS {{ {', '.join(KILLED_WHEN)} }}", "}", "POLICY codeenv_refused {"]
    refused = {**REFUSED_WHEN, ENOSYS: NEVER_ALLOWED}
    lines.append(",\n".join(f"  ERRNO({errno}) {{ {', '.join(rules)} }}" for errno, rules in refused.items()))
    lines += ["}", "POLICY codeenv_allowed {", f"  ALLOW {{ {', '.join(allowed)} }}", "}"]
    default = "LOG" if mode == "audit" else f"ERRNO({ENOSYS})"
    lines.append(f"USE codeenv_killed, USE codeenv_refused, USE codeenv_allowed DEFAULT {default}")
    return "\n".join(lines) + "\n"


# --- the ABI filter, installed by the zygote -------------------------------------------------------

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000


def abi_filter(arch: int) -> bytes:
    """A classic BPF program (struct sock_filter[]) that kills a call made through any ABI but the
    native one of `arch`: another audit arch (the 32-bit entry), or on x86_64 the x32 bit."""

    def insn(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    ld_w_abs, jeq_k, jset_k, ret_k = 0x20, 0x15, 0x45, 0x06
    program = [
        insn(ld_w_abs, 0, 0, 4),                     # A = seccomp_data.arch
        insn(jeq_k, 1, 0, arch),                     # native? skip the kill
        insn(ret_k, 0, 0, SECCOMP_RET_KILL_PROCESS),
        insn(ld_w_abs, 0, 0, 0),                     # A = seccomp_data.nr
    ]
    if arch == AUDIT_ARCH_X86_64:
        program += [insn(jset_k, 0, 1, X32_SYSCALL_BIT), insn(ret_k, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    program.append(insn(ret_k, 0, 0, SECCOMP_RET_ALLOW))
    return b"".join(program)


#: Numbers of the calls a family's filter refuses: (killed, ENOSYS), per audit arch.
FAMILY_DENIED = {
    # unshare, mount, umount2, setns, pivot_root, chroot | setuid, setgid, setreuid, setregid,
    # setresuid, setresgid, setgroups, setfsuid, setfsgid
    AUDIT_ARCH_X86_64: ((272, 165, 166, 308, 155, 161), (105, 106, 113, 114, 117, 119, 116, 122, 123)),
    AUDIT_ARCH_AARCH64: ((97, 40, 39, 268, 41, 51), (146, 144, 145, 143, 147, 149, 159, 151, 152)),
}


def family_filter(arch: int) -> bytes:
    """A classic BPF program a family's supervisor stacks on the session jail's policy once it has
    set the family up: the calls that only the set-up needed kill (namespaces, mounts) or answer
    ENOSYS (uid and gid changes), as in a call jail. Foreign ABIs are killed as by `abi_filter`."""

    def insn(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    ld_w_abs, jeq_k, jset_k, ret_k = 0x20, 0x15, 0x45, 0x06
    killed, enosys = FAMILY_DENIED[arch]
    program = [insn(ld_w_abs, 0, 0, 4), insn(jeq_k, 1, 0, arch), insn(ret_k, 0, 0, SECCOMP_RET_KILL_PROCESS),
               insn(ld_w_abs, 0, 0, 0)]
    if arch == AUDIT_ARCH_X86_64:
        program += [insn(jset_k, 0, 1, X32_SYSCALL_BIT), insn(ret_k, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    numbers = [*killed, *enosys]
    # One comparison per number; a match jumps to the kill or the ENOSYS return at the end.
    for i, nr in enumerate(numbers):
        left = len(numbers) - i - 1  # comparisons after this one
        target = left + 1 + (0 if nr in killed else 1)  # past the ALLOW: 1 = KILL, 2 = ENOSYS
        program.append(insn(jeq_k, target, 0, nr))
    program += [insn(ret_k, 0, 0, SECCOMP_RET_ALLOW), insn(ret_k, 0, 0, SECCOMP_RET_KILL_PROCESS),
                insn(ret_k, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]
    return b"".join(program)
