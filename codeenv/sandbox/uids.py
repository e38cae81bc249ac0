"""Host uid blocks: every process that starts jails claims a block of host uids no other one holds.

Slot i of a pool runs as host uid ``block.base + i``. Two pools on one host must never share a uid
(RLIMIT_NPROC and signal permissions are per uid), so each pool claims a block for itself:

    block = claim_for(settings)
    ...
    block.release()   # or let the process exit: the kernel drops the lock, even on SIGKILL

A block is held by an flock(2) on one file per block in a host-wide directory
(``CODEENV_UID_LOCK_DIR``, by default /run/codeenv/uid-blocks). The lock belongs to the open file,
not to the file: it goes away with the process that holds it, so a block of a process that died is
free for the next one without anyone cleaning up. Containers on one host share the directory
through a volume (docs/deploy.md). A block is ``BLOCK`` uids wide: the most slots a pool may have,
with room for per-session uids.

``CODEENV_UID_BASE`` overrides all this: the pool then runs at that base and claims nothing (and
still refuses uids that a live process holds, `check_uids_free`, or that this user namespace does
not map, `check_uids_mapped`).

"Host uid" means a uid of the user namespace the worker runs in. On a host that is the initial
namespace, whose uids are all mapped. In a Kubernetes pod with ``hostUsers: false`` it is the pod's
own namespace, which maps 65,536 uids (0..65535) to a range of the node's that no other pod shares:
there blocks are carved out of those uids (`range_start`), narrower than ``BLOCK`` if need be
(`UidBlock.size`), never reaching the overflow uid (65534, what unmapped owners show as).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from codeenv.errors import SandboxError

if TYPE_CHECKING:
    from codeenv.settings import SandboxSettings

#: Host uids per block: 1024 slots (SandboxSettings.slots' bound) and room for per-session uids.
BLOCK = 1 << 16
#: The highest host uid a jail may be mapped to (2**32 - 1 is "no uid").
LAST_UID = 2**32 - 2
#: In a namespace too narrow for a block (a pod's), blocks are whole chunks of this many uids.
CHUNK = 1024
#: Where blocks start by default: far above login users, system users and subuid ranges.
DEFAULT_RANGE_START = 1_500_000_000
#: The lowest uid a jail may run as on a host (in the initial user namespace): below it live login
#: and system users, whose processes could signal or trace a jail's, and the other way round.
HOST_MIN_UID = 100_000
#: A block's layout from its base: slots at 0..1023, session jails' roots (one per profile) from
#: SESSION_ROOT_UIDS, checkers (one per slot, the 512 first slots' own; beyond, shared) from
#: CHECKER_UIDS, session families (one uid each, up to sessions_max) from FAMILY_UIDS.
SESSION_ROOT_UIDS = 1024
CHECKER_UIDS = 1536
FAMILY_UIDS = 2048


def uids_needed(settings: SandboxSettings) -> int:
    """How many uids from its base a pool of these settings may run processes as."""
    return FAMILY_UIDS + settings.sessions_max


def mapped_extents(id_map: Path = Path("/proc/self/uid_map")) -> list[range]:
    """The ids an id map (uid_map, gid_map) of this process's user namespace maps, in its own numbers,
    adjacent extents merged (the initial namespace: all of 0..2**32-2)."""
    extents = sorted((range(int(inside), int(inside) + int(count))
                      for inside, _outside, count in (line.split() for line in id_map.read_text().splitlines())),
                     key=lambda extent: extent.start)
    merged: list[range] = []
    for extent in extents:
        if merged and extent.start <= merged[-1].stop:
            merged[-1] = range(merged[-1].start, max(merged[-1].stop, extent.stop))
        else:
            merged.append(extent)
    return merged


def mapped_ids() -> list[range]:
    """The ids this process's user namespace maps both as uids and as gids (a slot runs as uid and
    gid ``base + i``)."""
    uids, gids = mapped_extents(), mapped_extents(Path("/proc/self/gid_map"))
    both = [range(max(u.start, g.start), min(u.stop, g.stop)) for u in uids for g in gids]
    return sorted((extent for extent in both if extent), key=lambda extent: extent.start)


def in_user_namespace() -> bool:
    """Whether this process runs in a user namespace that maps fewer uids than the host has."""
    return mapped_extents() != [range(0, LAST_UID + 1)]


def overflow_ids() -> tuple[int, ...]:
    """The uid and gid that stand for an owner this namespace cannot map (65534 unless changed)."""
    ids = []
    for name in ("overflowuid", "overflowgid"):
        try:
            ids.append(int(Path("/proc/sys/kernel", name).read_text()))
        except (OSError, ValueError):
            ids.append(65534)
    return tuple(ids)


def mapped_run(base: int, mapped: list[range], overflow: tuple[int, ...]) -> int:
    """How many ids from `base` on are mapped, one after another, before an overflow id."""
    for extent in mapped:
        if base in extent:
            stop = min([extent.stop, LAST_UID + 1, *(o for o in overflow if o >= base)])
            return max(0, stop - base)
    return 0


def range_start(configured: int | None, mapped: list[range] | None = None) -> int:
    """Where blocks start: CODEENV_UID_RANGE_START, else `DEFAULT_RANGE_START` where this namespace
    maps it, else (a pod's 65,536 uids) the upper half of the namespace's largest extent of uids."""
    if configured is not None:
        return configured
    mapped = mapped_ids() if mapped is None else mapped
    if any(DEFAULT_RANGE_START in extent for extent in mapped) or not mapped:
        return DEFAULT_RANGE_START
    largest = max(mapped, key=len)
    return largest.start + len(largest) // 2


def _maps_text() -> str:
    texts = []
    for name in ("uid_map", "gid_map"):
        try:
            lines = Path("/proc/self", name).read_text().splitlines()
            texts.append(f"{name}: " + "; ".join(" ".join(line.split()) for line in lines))
        except OSError:
            texts.append(f"{name}: unreadable")
    return ", ".join(texts)


@dataclass
class UidBlock:
    """A claimed block: host uids ``base .. base + size - 1``, held while `fd` is open."""

    base: int
    path: Path
    fd: int | None
    #: Uids from `base` that the pool may use: ``BLOCK``, or fewer where this namespace maps fewer.
    size: int = BLOCK
    #: The locks of the block's other chunks (a narrow namespace's blocks are chunks: `claim_block`).
    more: list[int] = field(default_factory=list)

    def release(self) -> None:
        for fd in self.more:
            os.close(fd)
        self.more = []
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor of the open file drops the flock
            self.fd = None

    @property
    def held(self) -> bool:
        return self.fd is not None


def uids_in_use() -> dict[int, int]:
    """Host uid -> a pid running as it, for every live (not exited, not zombie) process."""
    used: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            uid = entry.stat().st_uid
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):  # a process being reaped holds nothing
            used.setdefault(uid, int(entry.name))
    return used


def check_user_namespace(settings: SandboxSettings) -> None:
    """SandboxError when CODEENV_REQUIRE_USER_NAMESPACE is set and this process is in none."""
    if settings.require_user_namespace and not in_user_namespace():
        raise SandboxError("CODEENV_REQUIRE_USER_NAMESPACE is set, but this worker runs in the host's user namespace, "
                           "with the host's capabilities: in Kubernetes, hostUsers: false was dropped (enable the "
                           "UserNamespacesSupport feature gate, or run Kubernetes 1.33 or later); elsewhere unset it")


def check_low_uids(first: int, setting: str) -> None:
    """SandboxError for uids below `HOST_MIN_UID` on a host (a pod's own namespace may use them)."""
    if first < HOST_MIN_UID and not in_user_namespace():
        raise SandboxError(f"{setting}={first} would run jails as uids that login and system users have on this "
                           f"host: use {HOST_MIN_UID:,} or more (uids below are for a worker in a user namespace "
                           "of its own, such as a Kubernetes pod's)")


def check_uids_mapped(uid_base: int, count: int, *, mapped: list[range] | None = None) -> None:
    """SandboxError when this user namespace does not map all of ``uid_base .. uid_base + count - 1``
    (or when they are a host's users' uids: `check_low_uids`)."""
    check_low_uids(uid_base, "CODEENV_UID_BASE")
    if mapped_run(uid_base, mapped_ids() if mapped is None else mapped, overflow_ids()) < count:
        raise SandboxError(
            f"host uids {uid_base}..{uid_base + count - 1} are not all mapped in this user namespace "
            f"({_maps_text()}; the overflow id {overflow_ids()[0]} cannot be used): set CODEENV_UID_BASE to "
            "mapped uids, or unset it to have a block carved out of them"
        )


def check_uids_free(uid_base: int, count: int, used: dict[int, int] | None = None) -> None:
    """SandboxError when a live process runs as one of the host uids ``uid_base .. uid_base + count - 1``."""
    used = uids_in_use() if used is None else used
    for uid in sorted(used):
        if uid_base <= uid < uid_base + count:
            raise SandboxError(
                f"host uid {uid} (slot uids {uid_base}..{uid_base + count - 1}) is in use by pid {used[uid]}, "
                "probably another codeenv worker: unset CODEENV_UID_BASE to have a free block claimed, "
                "or give each worker on the host its own base"
            )


def _lock_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        raise SandboxError(f"cannot create the uid lock directory {directory}: {exc.strerror}; set "
                           "CODEENV_UID_LOCK_DIR to a writable directory every worker on this host shares") from exc


def claim_for(settings: SandboxSettings) -> UidBlock:
    """The block a pool of these settings runs in: `claim_block` from `range_start`, wide enough
    for `uids_needed`."""
    if settings.uid_range_start is not None:
        check_low_uids(settings.uid_range_start, "CODEENV_UID_RANGE_START")
    return claim_block(settings.uid_lock_dir, range_start(settings.uid_range_start), need=uids_needed(settings))


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on `path`, or None when another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise SandboxError(f"cannot open the uid lock {path}: {exc.strerror}; set CODEENV_UID_LOCK_DIR "
                           "to a writable directory that every worker on this host shares") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SandboxError(f"cannot lock the uid lock {path}: {exc.strerror}") from exc
        return None
    return fd


def _lock_all(paths: list[Path]) -> list[int] | None:
    """Locks on all of `paths`, or None (and none held) when another process holds one."""
    fds: list[int] = []
    try:
        for path in paths:
            fd = _try_lock(path)
            if fd is None:
                break
            fds.append(fd)
        else:
            return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in fds:
        os.close(fd)
    return None


def claim_block(lock_dir: Path, start: int, *, need: int = 1, block: int = BLOCK,
                mapped: list[range] | None = None) -> UidBlock:
    """Claim the first block from `start` that no process holds a lock on and no live process uses,
    of which this user namespace (or `mapped`) maps at least `need` uids.

    Where the namespace maps fewer than `block` uids from `start` (a pod's 65,536), blocks are whole
    `CHUNK`s instead, `need` rounded up, each chunk with a lock of its own: so a worker, `codeenv
    doctor` and `codeenv run` in one pod each get uids of their own, whatever `need` each has.

    SandboxError when every block is taken or too narrow, or the directory cannot be used.
    """
    _lock_dir(lock_dir)
    used = uids_in_use()
    mapped, overflow = mapped_ids() if mapped is None else mapped, overflow_ids()
    run = mapped_run(start, mapped, overflow)
    if run < block:
        stride = CHUNK
        width = -(-need // CHUNK) * CHUNK
        sized = ((base, min(width, start + run - base)) for base in range(start, start + run - need + 1, CHUNK))
    else:
        stride = width = block
        sized = ((base, min(block, mapped_run(base, mapped, overflow)))
                 for base in range(start, LAST_UID + 2 - block, block))
    tried = locked = live = 0
    for base, size in sized:
        if size < need:
            continue
        tried += 1
        paths = [lock_dir / f"uid-block-{chunk}.lock" for chunk in range(base, base + size, stride)]
        fds = _lock_all(paths)
        if fds is None:
            locked += 1
            continue
        try:
            check_uids_free(base, size, used)
        except SandboxError:
            for fd in fds:  # a process outside codeenv's locks (or a dying jail) still runs there
                os.close(fd)
            live += 1
            continue
        with contextlib.suppress(OSError):  # who holds it, for a reader of the directory
            os.ftruncate(fds[0], 0)
            os.pwrite(fds[0], f"{os.getpid()}\n".encode(), 0)
        return UidBlock(base, paths[0], fds[0], size, fds[1:])
    if not tried:
        raise SandboxError(
            f"no block of {need} host uids from {start} is mapped in this user namespace ({_maps_text()}): set "
            f"CODEENV_UID_RANGE_START to where it maps {need} uids and gids in a row below the overflow id "
            f"{overflow[0]}, or lower CODEENV_SESSIONS_MAX (a pool needs {FAMILY_UIDS} + sessions_max)")
    raise SandboxError(f"no free block of host uids: all {tried} blocks of {width} uids from {start} that "
                       f"this namespace maps are held ({locked} by other codeenv processes' locks, {live} by live "
                       "processes outside them); stop a worker or lower CODEENV_UID_RANGE_START")
