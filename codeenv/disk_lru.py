"""Files on disk by name under a size cap, the least recently used removed first: the compile
cache's binaries and the problem packages a worker holds.

Each file is written beside its place and renamed into it, so a reader (another process sharing
the directory too) sees it whole or not at all. A use touches its mtime (atime is often not kept):
that is the LRU order. The size is measured once, then counted as files are added; past the cap,
files are removed until 3/4 of it is left.

Usage::

    lru = DiskLRU(root, cap_bytes)
    lru.write("ab12.bin", data)          # or: tmp = lru.temp("ab12.json"); ...; lru.adopt("ab12.json", tmp)
    data = lru.read("ab12.bin")          # None on a miss
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass
class DiskLRU:
    """Files by name in `root` (spread over subdirectories by the name's first two characters)."""

    root: Path
    cap_bytes: int
    _size: int | None = field(default=None, repr=False)

    def path(self, name: str) -> Path:
        return self.root / name[:2] / name

    def touch(self, name: str) -> bool:
        """Whether `name` is here; if so it counts as used now."""
        try:
            os.utime(self.path(name))
        except OSError:
            return False
        return True

    def read(self, name: str) -> bytes | None:
        """The file's bytes (it counts as used now), or None on a miss."""
        if self.cap_bytes <= 0:
            return None
        path = self.path(name)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def temp(self, name: str) -> Path:
        """A path beside `name`'s place to write it to, before `adopt` renames it there."""
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")

    def write(self, name: str, data: bytes) -> bool:
        """Keep `data` as `name` (not if over a quarter of the cap); False if it could not be kept."""
        if self.cap_bytes <= 0 or len(data) > self.cap_bytes // 4:
            return False
        try:
            tmp = self.temp(name)
            tmp.write_bytes(data)
        except OSError as exc:
            logger.warning("%s: cannot keep %s: %s", self.root, name, exc)
            return False
        return self.adopt(name, tmp)

    def adopt(self, name: str, tmp: Path) -> bool:
        """Rename `tmp` (from `temp(name)`) into `name`'s place; False (and `tmp` removed) if it
        could not be."""
        try:
            size = tmp.stat().st_size
            os.replace(tmp, self.path(name))
        except OSError as exc:
            logger.warning("%s: cannot keep %s: %s", self.root, name, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self._size = self._measure() if self._size is None else self._size + size
        if self._size > self.cap_bytes:
            self._prune()
        return True

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            self.path(name).unlink()

    def _entries(self) -> list[tuple[float, int, Path]]:
        found = []
        for path in self.root.glob("*/*"):
            with contextlib.suppress(OSError):
                st = path.stat()
                found.append((st.st_mtime, st.st_size, path))
        return found

    def _measure(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _prune(self) -> None:
        """Remove the least recently used files until 3/4 of the cap is left."""
        entries = sorted(self._entries())
        size = sum(s for _, s, _ in entries)
        for _, s, path in entries:
            if size <= self.cap_bytes * 3 // 4:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                size -= s
        self._size = size
