"""What a rollback cannot put back: a cell's process shares the pre-cell process's shared memory
mappings and open file descriptions (a fork shares them), so the pre-cell process takes an account of
its fds before the cell and, after a rollback, lists what the cell may have changed there."""

from __future__ import annotations

import os

#: Things a rolled-back cell could not have restored, listed at most.
UNRESTORED_MAX = 20


def open_files(skip: set[int]) -> dict[int, tuple[int, int]]:
    """Each open fd but `skip`: (offset, or -1 where it has none; status flags). A cell's process
    shares them with the session's (a fork shares open file descriptions)."""
    import fcntl

    files = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in skip:
            continue
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:
            continue  # the listing's own fd, closed by now
        try:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:
            offset = -1  # a pipe or a socket
        files[fd] = (offset, flags)
    return files


def not_restored(before: dict[int, tuple[int, int]]) -> list[str]:
    """What a rolled-back cell shared with the pre-cell process, which the rollback cannot put
    back (said in the result, see `ExecResult.not_restored`): writable shared memory mappings (the
    cell's writes to them stay), open files whose offset or flags it moved, and pipes and sockets
    (what it read from or wrote to them stays read or written)."""
    what = []
    with open("/proc/self/maps") as f:
        shared = sum(1 for line in f if (perms := line.split(None, 2)[1])[1] == "w" and perms[3] == "s")
    if shared:
        what.append(f"{shared} shared writable memory mapping(s) (mmap, multiprocessing.Value or Array): "
                    "what the cell wrote there stays")
    after = open_files(set())
    for fd, (offset, flags) in sorted(before.items()):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = "?"
        if offset < 0:
            what.append(f"fd {fd} ({name}): what the cell read from it or wrote to it stays")
        elif after.get(fd, (offset, flags)) != (offset, flags):
            what.append(f"fd {fd} ({name}): its offset or flags as the cell left them "
                        f"(offset {after[fd][0]}, was {offset})")
    return what[:UNRESTORED_MAX]
