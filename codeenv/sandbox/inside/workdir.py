"""Files in the jail's work dir: a call's files in and out, the wipe after a call, the baseline it is
checked against, a session dir's listing and changes, and its copy for a fork.

The functions take their directory as an argument: they run (and are tested) anywhere.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from . import proc
from .protocol import FETCH_DATA_AT, frame, unframe

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: Entries of a session's dir listed before each cell, at most (past it, changes go unlisted).
LISTING_MAX = 5000
#: Files listed as written by a rolled-back cell, at most.
WRITTEN_MAX = 100


def read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _dir_beneath(top: str, dirs: list[str], create: bool) -> int:
    """An fd of the directory `dirs` (a list of names) under `top`, made if `create`; no link is
    followed on the way."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in dirs:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_files(top: str, files_fd: int) -> None:
    """In the child, before user code: write the call's input files under `top`.

    The memfd holds a frame with the index [[path, size], ...], then the contents. Paths were
    checked by the worker (relative, no "..", no NUL); directories are made as needed and no link
    is followed.
    """
    blob = read_all(files_fd)
    if not blob:
        return
    index, offset = unframe(blob, len(blob))
    assert isinstance(index, list)
    for path, length in index:
        *dirs, name = path.split("/")
        fd = _dir_beneath(top, dirs, create=True)
        try:
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                          dir_fd=fd)
            try:
                view = memoryview(blob)[offset:offset + length]
                while view:
                    view = view[os.write(out, view):]
            finally:
                os.close(out)
        finally:
            os.close(fd)
        offset += length


def _open_beneath(top: str, path: str) -> int:
    """Open a file under `top` without following any link (a FIFO does not block)."""
    *dirs, name = path.split("/")
    fd = _dir_beneath(top, dirs, create=False)
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def fetch_files(top: str, list_fd: int, out_fd: int) -> None:
    """In a collector child, after the call: copy the requested files into the fetch-out memfd.

    Only regular files, no link followed, at most the memfd's room in all; anything else is
    refused by name. The index (JSON {"files": {path: [offset, size]}, "errors": {path: why}})
    goes at the start, the contents from FETCH_DATA_AT.
    """
    paths = json.loads(read_all(list_fd) or b"[]")
    room = os.fstat(out_fd).st_size - FETCH_DATA_AT
    offset = FETCH_DATA_AT
    files: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for path in paths:
        try:
            fd = _open_beneath(top, path)
        except FileNotFoundError:
            errors[path] = "no such file"
            continue
        except OSError as exc:
            errors[path] = ("a symbolic link" if exc.errno == errno.ELOOP
                            else f"cannot open: {os.strerror(exc.errno or 0)}")
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                errors[path] = "not a regular file"
                continue
            if st.st_size > room - (offset - FETCH_DATA_AT):
                errors[path] = f"{st.st_size} bytes: more than the {room - (offset - FETCH_DATA_AT)} left to fetch"
                continue
            start = offset
            while offset - start < st.st_size:
                chunk = os.read(fd, min(1 << 20, st.st_size - (offset - start)))
                if not chunk:
                    break
                os.pwrite(out_fd, chunk, offset)
                offset += len(chunk)
            files[path] = [start, offset - start]
        finally:
            os.close(fd)
    index = frame({"files": files, "errors": errors})
    if len(index) > FETCH_DATA_AT:
        index = frame({"files": {}, "errors": {p: "too many files to fetch" for p in paths}})
    os.pwrite(out_fd, index, 0)


def wipe(top: str) -> None:
    """Delete everything under `top` (runs in a janitor child, never in the zygote).

    Holds one directory fd at a time (a 3,000-deep tree is deeper than PATH_MAX and than any fd
    limit), lists each directory once (wide trees stay linear), and never follows a link.
    """
    for name in os.listxattr(top):  # e.g. a default ACL, which would shape the next call's files
        os.removexattr(top, name)
    os.chmod(top, 0o700)
    cur = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    pending = os.listdir(cur)
    stack: list[tuple[str, list[str]]] = []
    while True:
        while pending:
            name = pending.pop()
            st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=cur)
                continue
            os.chmod(name, 0o700, dir_fd=cur)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=cur)
            os.close(cur)
            cur = nxt
            stack.append((name, pending))
            pending = os.listdir(cur)
        if not stack:
            os.close(cur)
            return
        name, pending = stack.pop()
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        os.rmdir(name, dir_fd=parent)
        cur = parent


def wipe_tree(path: str) -> None:
    wipe(path)
    os.rmdir(path)


def listing(path: str) -> dict[str, tuple[int, int, int, int]]:
    """{relative path: (inode, size, mtime, ctime)} of what is under `path` (no link followed)."""
    entries = {}
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            entries[os.path.relpath(full, path)] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if len(entries) >= LISTING_MAX:
                return entries
    return entries


def changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What a rolled-back cell did to its session's files (they are not restored): paths created or
    changed, and deleted ones marked so."""
    paths = sorted(p for p, st in after.items() if before.get(p) != st)
    paths += sorted(f"{p} (deleted)" for p in before if p not in after)
    return paths[:WRITTEN_MAX]


def copy_tree(src: str, dst: str) -> None:
    """Copy a session's dir for its fork: files, dirs and links as they are (no link followed)."""
    os.mkdir(dst, 0o700)
    with os.scandir(src) as entries:
        for entry in entries:
            target = os.path.join(dst, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), target)
            elif entry.is_dir(follow_symlinks=False):
                copy_tree(entry.path, target)
            elif entry.is_file(follow_symlinks=False):
                fin = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode & 0o777
                    fout = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
                    try:
                        while os.copy_file_range(fin, fout, 1 << 30):
                            pass
                    finally:
                        os.close(fout)
                finally:
                    os.close(fin)
            # FIFOs, sockets and devices are not copied


#: A dir's contents held in memory (a snapshot's): (relative path, kind, mode, data or link target).
Held = list[tuple[str, str, int, bytes]]


def read_tree(src: str, prefix: str = "") -> Held:
    """A session's dir as `write_tree` writes it back: files, dirs and links as they are (no link
    followed; FIFOs, sockets and devices left out), read into this process's memory."""
    held: Held = []
    with os.scandir(src) as entries:
        for entry in entries:
            name = prefix + entry.name
            mode = entry.stat(follow_symlinks=False).st_mode & 0o777
            if entry.is_symlink():
                held.append((name, "link", 0, os.fsencode(os.readlink(entry.path))))
            elif entry.is_dir(follow_symlinks=False):
                held.append((name, "dir", 0o700, b""))
                held += read_tree(entry.path, name + "/")
            elif entry.is_file(follow_symlinks=False):
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    held.append((name, "file", mode, read_all(fd)))
                finally:
                    os.close(fd)
    return held


def write_tree(held: Held, dst: str) -> None:
    """Make `dst` with what `read_tree` held (a fork of a snapshot)."""
    os.mkdir(dst, 0o700)
    for name, kind, mode, data in held:
        target = os.path.join(dst, name)
        if kind == "link":
            os.symlink(os.fsdecode(data), target)
        elif kind == "dir":
            os.mkdir(target, 0o700)
        else:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)


class Workdir:
    """The jail's work dir and its state at start: a call leaves it as it found it, or it is wiped."""

    def __init__(self, path: str, tmpfs_options: str | None = None) -> None:
        self.path = path
        #: Set in a call jail: its zygote mounts a fresh tmpfs with these options after a call that
        #: changed the work dir (see `fresh`).
        self.tmpfs_options = tmpfs_options
        self.baseline = (0, 0)
        self.times: tuple[int, int] | None = None
        self.ctime = 0

    def usage(self) -> tuple[int, int]:
        """(inodes, blocks) in use."""
        st = os.statvfs(self.path)
        return st.f_files - st.f_ffree, st.f_blocks - st.f_bfree

    def record_baseline(self) -> None:
        self.baseline = self.usage()
        st = os.stat(self.path)
        self.times = (st.st_atime_ns, st.st_mtime_ns)
        self.ctime = st.st_ctime_ns

    def settle(self) -> bool:
        """After a call, in the zygote: whether it left the work dir as it found it, the tmpfs's
        inode counter included. Any entry made or removed, any mode, time or attribute set moves the
        dir's ctime, which no call can set back; a listing only moves its atime, put back here."""
        st = os.stat(self.path)
        if st.st_ctime_ns != self.ctime or not self.untouched(st):
            return False
        if (st.st_atime_ns, st.st_mtime_ns) != self.times:
            self.reset_times()
            self.ctime = os.stat(self.path).st_ctime_ns
        return True

    def fresh(self) -> bool:
        """A new tmpfs on the work dir in place of the one a call changed (the zygote only: PID 1,
        with CAP_SYS_ADMIN in the jail's user namespace): nothing of the call's files reaches the
        next, not even how many it made (the tmpfs numbers inodes from 1 again). False if this jail
        cannot (then `clean` wipes the dir); raises OSError if the old one went and no new one came."""
        if self.tmpfs_options is None or os.getpid() != 1:
            return False
        path = self.path.encode()
        if proc.libc().umount2(path, proc.MNT_DETACH) != 0:
            return False
        # Its source named as nsjail names the first one ("none"): a call cannot tell a fresh work dir
        # from the jail's first by its mountinfo line.
        proc.mount(b"none", path, b"tmpfs", proc.MS_NOSUID | proc.MS_NODEV, self.tmpfs_options.encode())
        os.chdir(self.path)  # the zygote's cwd held the old one
        self.record_baseline()
        return True

    def reset_times(self) -> None:
        """The work dir's own timestamps as at start: a call may set them (utime), and the wipe moves them."""
        if self.times is None:
            return
        try:
            os.utime(self.path, ns=self.times)
        except OSError:
            pass

    def untouched(self, st: os.stat_result | None = None) -> bool:
        """Its usage, mode and attributes as at start (`st`: the dir's stat, if made already)."""
        st = st or os.stat(self.path)
        return self.usage() == self.baseline and stat.S_IMODE(st.st_mode) == 0o700 and not os.listxattr(self.path)

    def clean(self, timeout_s: float) -> bool:
        """Make the work dir as it was at start; True if it is."""
        if self.untouched():
            return True
        wiped = proc.in_child("janitor", lambda: wipe(self.path), timeout_s)
        return wiped and self.usage() == self.baseline
