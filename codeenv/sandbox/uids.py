"""Host uid blocks: every process that starts jails claims a block of host uids no other one holds.

Slot i of a pool runs as host uid ``block.base + i``. Two pools on one host must never share a uid
(RLIMIT_NPROC and signal permissions are per uid), so each pool claims a block for itself:

    block = claim_block(settings.uid_lock_dir, settings.uid_range_start)
    ...
    block.release()   # or let the process exit: the kernel drops the lock, even on SIGKILL

A block is held by an flock(2) on one file per block in a host-wide directory
(``CODEENV_UID_LOCK_DIR``, by default /run/codeenv/uid-blocks). The lock belongs to the open file,
not to the file: it goes away with the process that holds it, so a block of a process that died is
free for the next one without anyone cleaning up. Containers on one host share the directory
through a volume (docs/deploy.md). A block is ``BLOCK`` uids wide: the most slots a pool may have,
with room for per-session uids.

``CODEENV_UID_BASE`` overrides all this: the pool then runs at that base and claims nothing (and
still refuses uids that a live process holds: `check_uids_free`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from codeenv.errors import SandboxError

#: Host uids per block: 1024 slots (SandboxSettings.slots' bound) and room for per-session uids.
BLOCK = 1 << 16
#: The highest host uid a jail may be mapped to (2**32 - 1 is "no uid").
LAST_UID = 2**32 - 2


@dataclass
class UidBlock:
    """A claimed block: host uids ``base .. base + BLOCK - 1``, held while `fd` is open."""

    base: int
    path: Path
    fd: int | None

    def release(self) -> None:
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


def claim_block(lock_dir: Path, start: int, *, block: int = BLOCK) -> UidBlock:
    """Claim the first block from `start` that no process holds a lock on and no live process uses.

    SandboxError when every block is taken or the directory cannot be used.
    """
    _lock_dir(lock_dir)
    used = uids_in_use()
    blocks = max(0, (LAST_UID + 1 - start) // block)
    busy = 0
    for i in range(blocks):
        base = start + i * block
        path = lock_dir / f"uid-block-{base}.lock"
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
            busy += 1
            continue
        try:
            check_uids_free(base, block, used)
        except SandboxError:
            os.close(fd)  # a process outside codeenv's locks (or a dying jail) still runs there
            busy += 1
            continue
        with contextlib.suppress(OSError):  # who holds it, for a reader of the directory
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return UidBlock(base, path, fd)
    raise SandboxError(f"no free block of host uids: all {blocks} blocks of {block} uids from {start} are "
                       f"held ({busy} by live processes); stop a worker or lower CODEENV_UID_RANGE_START")
