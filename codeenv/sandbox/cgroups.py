"""One cgroup per jail, with memory and pids caps, on cgroup v1 or v2.

The worker makes a subtree ``codeenv-<pid>`` below its own cgroup, and a group per jail under it.
nsjail is started inside the jail's group, so the zygote and everything it forks are counted there.
Reading these files from outside is how the worker learns, without trusting the jail, whether a
call hit its memory cap (OOM-kill events), how much memory it used at peak, and whether any of its
processes survived.

Usage::

    tree = CgroupTree.create()                  # v1 or v2, detected
    group = tree.group("slot0-math")
    group.set_memory_limit(1 << 30); group.set_pids_max(64)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from pathlib import Path
from typing import Protocol

from codeenv.errors import SandboxError

logger = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = -1


def _parse_int(text: str) -> int:
    text = text.strip()
    return UNLIMITED if text == "max" else int(text)


def _parse_keyed(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _read_int(path: Path) -> int:
    return _parse_int(path.read_text())


class _ControlFiles:
    """Cgroup control files kept open: a call reads several of them, and open() is the slow part.

    Files are named by their directory and name, so that no Path is built per call (hot path)."""

    def __init__(self) -> None:
        self._fds: dict[tuple[Path, str, int], int] = {}

    def _fd(self, directory: Path, name: str, flags: int) -> int:
        fd = self._fds.get((directory, name, flags))
        if fd is None:
            fd = self._fds[directory, name, flags] = os.open(directory / name, flags | os.O_CLOEXEC)
        return fd

    def read(self, directory: Path, name: str) -> str:
        return os.pread(self._fd(directory, name, os.O_RDONLY), 4096, 0).decode()

    def write(self, directory: Path, name: str, value: str) -> None:
        os.write(self._fd(directory, name, os.O_WRONLY), value.encode())

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path for `controller` ('' for the v2 unified hierarchy)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.split(",") == [controller] or (controller == "" and controllers == ""):
            return path
        if controller and controller in controllers.split(","):
            return path
    raise SandboxError(f"this process is in no {controller or 'unified'} cgroup")


class JailCgroup(Protocol):
    """The cgroup of one jail."""

    name: str

    def procs_files(self) -> list[Path]: ...
    def set_cpu_limit(self, cpus: float) -> None: ...
    def kill_all(self) -> bool: ...
    def set_memory_limit(self, limit_bytes: int) -> None: ...
    def set_pids_max(self, count: int) -> None: ...
    def memory_usage(self) -> int: ...
    def reset_peak(self) -> None: ...
    def memory_peak(self) -> int | None: ...
    def oom_kills(self) -> int: ...
    def pids_current(self) -> int: ...
    def pids_limit_hits(self) -> int: ...
    def procs(self) -> list[int]: ...
    def remove(self) -> None: ...


def _kill_procs(group: JailCgroup, timeout_s: float = 5.0) -> bool:
    """SIGKILL every process in `group` until none is left; False if some would not die."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = group.procs()
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def _rmdir_when_empty(path: Path, timeout_s: float = 2.0) -> None:
    """Remove a cgroup; killed processes may take a moment to leave it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                logger.warning("cannot remove cgroup %s: %s", path, exc)
                return
        time.sleep(0.01)


class V1Cgroup:
    """A jail's group in the v1 ``memory`` and ``pids`` hierarchies."""

    def __init__(self, name: str, memory: Path, pids: Path, cpu: Path | None = None) -> None:
        self.name = name
        self.memory = memory
        self.pids = pids
        self.cpu = cpu
        for d in (memory, pids, cpu):
            if d is not None:
                d.mkdir(exist_ok=True)
        self._memsw = (memory / "memory.memsw.limit_in_bytes").exists()
        self._files = _ControlFiles()

    def procs_files(self) -> list[Path]:
        dirs = [self.memory, self.pids] + ([self.cpu] if self.cpu else [])
        return [d / "cgroup.procs" for d in dirs]

    def set_cpu_limit(self, cpus: float) -> None:
        if self.cpu is None:
            return
        try:
            self._files.write(self.cpu, "cpu.cfs_period_us", "100000")
            self._files.write(self.cpu, "cpu.cfs_quota_us", str(int(cpus * 100_000)) if cpus > 0 else "-1")
        except OSError as exc:  # v1 refuses a quota above the parent's (a CPU-limited container)
            logger.warning("no CPU cap of %g for %s (%s): the parent cgroup's own cap applies", cpus, self.name, exc)

    def kill_all(self) -> bool:
        return _kill_procs(self)

    def set_memory_limit(self, limit_bytes: int) -> None:
        files = ["memory.limit_in_bytes"] + (["memory.memsw.limit_in_bytes"] if self._memsw else [])
        current = _parse_int(self._files.read(self.memory, "memory.limit_in_bytes"))
        # memsw must stay >= the memory limit at every moment: raise memsw first, lower it last.
        if limit_bytes > current:
            files.reverse()
        for f in files:
            self._files.write(self.memory, f, str(limit_bytes))

    def set_pids_max(self, count: int) -> None:
        self._files.write(self.pids, "pids.max", str(count))

    def memory_usage(self) -> int:
        return _parse_int(self._files.read(self.memory, "memory.usage_in_bytes"))

    def reset_peak(self) -> None:
        self._files.write(self.memory, "memory.max_usage_in_bytes", "0")

    def memory_peak(self) -> int | None:
        return _parse_int(self._files.read(self.memory, "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        return _parse_keyed(self._files.read(self.memory, "memory.oom_control")).get("oom_kill", 0)

    def pids_current(self) -> int:
        return _parse_int(self._files.read(self.pids, "pids.current"))

    def pids_limit_hits(self) -> int:
        return _parse_keyed(self._files.read(self.pids, "pids.events")).get("max", 0)

    def procs(self) -> list[int]:
        pids: set[int] = set()
        for d in (self.memory, self.pids):
            try:
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return sorted(pids)

    def remove(self) -> None:
        _kill_procs(self)
        self._files.close()
        for d in (self.memory, self.pids, self.cpu):
            if d is not None:
                _rmdir_when_empty(d)


class V2Cgroup:
    """A jail's group in the unified (v2) hierarchy."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        path.mkdir(exist_ok=True)
        self._files = _ControlFiles()
        self._peak_fd: int | None = None
        try:
            self._peak_fd = os.open(path / "memory.peak", os.O_RDWR)
        except OSError:
            self._peak_fd = None  # kernels before 6.12 cannot reset the peak: ru_maxrss is used

    def procs_files(self) -> list[Path]:
        return [self.path / "cgroup.procs"]

    def set_cpu_limit(self, cpus: float) -> None:
        if not (self.path / "cpu.max").exists():
            return
        try:
            self._files.write(self.path, "cpu.max", f"{int(cpus * 100_000)} 100000" if cpus > 0 else "max 100000")
        except OSError as exc:
            logger.warning("no CPU cap of %g for %s (%s)", cpus, self.name, exc)

    def kill_all(self) -> bool:
        # cgroup.kill (5.14+) kills every process at once, forks in flight included.
        with contextlib.suppress(OSError):
            (self.path / "cgroup.kill").write_text("1")
        return _kill_procs(self)

    def set_memory_limit(self, limit_bytes: int) -> None:
        self._files.write(self.path, "memory.max", str(limit_bytes))
        try:
            self._files.write(self.path, "memory.swap.max", "0")
        except OSError:
            pass

    def set_pids_max(self, count: int) -> None:
        self._files.write(self.path, "pids.max", str(count))

    def memory_usage(self) -> int:
        return _parse_int(self._files.read(self.path, "memory.current"))

    def reset_peak(self) -> None:
        if self._peak_fd is not None:
            try:
                os.write(self._peak_fd, b"reset\n")
            except OSError:
                os.close(self._peak_fd)
                self._peak_fd = None

    def memory_peak(self) -> int | None:
        if self._peak_fd is None:
            return None
        return int(os.pread(self._peak_fd, 64, 0).decode().strip())

    def oom_kills(self) -> int:
        return _parse_keyed(self._files.read(self.path, "memory.events")).get("oom_kill", 0)

    def pids_current(self) -> int:
        return _parse_int(self._files.read(self.path, "pids.current"))

    def pids_limit_hits(self) -> int:
        return _parse_keyed(self._files.read(self.path, "pids.events")).get("max", 0)

    def procs(self) -> list[int]:
        try:
            return sorted(int(p) for p in (self.path / "cgroup.procs").read_text().split())
        except FileNotFoundError:
            return []

    def remove(self) -> None:
        self.kill_all()
        self._files.close()
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        _rmdir_when_empty(self.path)


def _enable_v2_controllers(parent: Path, required: list[str], optional: list[str]) -> None:
    """Make controllers available to groups below `parent` (cgroup v2).

    v2 forbids a group with processes from handing controllers to its children, so when the
    worker itself sits in `parent` it first moves into a leaf of its own (``codeenv-worker-<pid>``).
    An optional controller (cpu) that cannot be enabled is left out with a warning.
    """
    control = parent / "cgroup.subtree_control"
    wanted = [c for c in required + optional if c not in control.read_text().split()]
    if not wanted:
        return
    moved = False
    for controller in wanted:
        try:
            try:
                control.write_text(f"+{controller}")
            except OSError as exc:
                if exc.errno != errno.EBUSY or moved:
                    raise
                leaf = parent / f"codeenv-worker-{os.getpid()}"
                leaf.mkdir(exist_ok=True)
                (leaf / "cgroup.procs").write_text(str(os.getpid()))
                moved = True
                control.write_text(f"+{controller}")
        except OSError as exc:
            if controller in optional:
                logger.warning("cgroup v2: cannot enable %s in %s (%s); calls run without it", controller,
                               control, exc)
                continue
            raise SandboxError(
                f"cannot enable +{controller} in {control} ({exc}); if other processes share the worker's "
                "cgroup, give the worker a cgroup of its own"
            ) from exc


class CgroupTree:
    """The worker's own subtree of jail cgroups."""

    def __init__(self, version: int, bases: dict[str, Path]) -> None:
        self.version = version
        self.bases = bases

    @classmethod
    def create(cls, root: Path | None = None, tag: str | None = None) -> CgroupTree:
        root = root or DEFAULT_ROOT
        tag = tag or f"codeenv-{os.getpid()}"
        v1_memory, v1_pids = root / "memory", root / "pids"
        if (v1_memory / "memory.limit_in_bytes").exists() and (v1_pids / "cgroup.procs").exists():
            bases = {
                "memory": v1_memory / _own_cgroup("memory").lstrip("/") / tag,
                "pids": v1_pids / _own_cgroup("pids").lstrip("/") / tag,
            }
            if (root / "cpu" / "cpu.cfs_quota_us").exists():
                bases["cpu"] = root / "cpu" / _own_cgroup("cpu").lstrip("/") / tag
            version = 1
        elif (root / "cgroup.controllers").exists():
            parent = root / _own_cgroup("").lstrip("/")
            if parent.name.startswith("codeenv-worker-"):
                parent = parent.parent  # a pool before this one moved the worker into its leaf
            available = set((parent / "cgroup.controllers").read_text().split())
            missing = {"memory", "pids"} - available
            if missing:
                raise SandboxError(
                    f"cgroup v2 at {parent} does not delegate the {', '.join(sorted(missing))} "
                    "controller(s); run the worker where it owns a delegated cgroup subtree "
                    "(systemd: Delegate=yes; containers: a private cgroup namespace)"
                )
            _enable_v2_controllers(parent, ["memory", "pids"], ["cpu"] if "cpu" in available else [])
            bases = {"unified": parent / tag}
            version = 2
        else:
            raise SandboxError(
                f"no usable cgroup hierarchy under {root}: need v1 memory+pids or v2 with both controllers"
            )
        try:
            for base in bases.values():
                base.mkdir(exist_ok=True)
            if version == 2:
                enabled = (bases["unified"].parent / "cgroup.subtree_control").read_text().split()
                (bases["unified"] / "cgroup.subtree_control").write_text(
                    " ".join(f"+{c}" for c in ("memory", "pids", "cpu") if c in enabled))
        except OSError as exc:
            raise SandboxError(f"cannot create the jail cgroups under {list(bases.values())}: {exc}") from exc
        cls._reap_stale(bases)
        return cls(version, bases)

    @staticmethod
    def _reap_stale(bases: dict[str, Path]) -> None:
        """Remove subtrees left by workers that died without cleaning up."""
        for base in bases.values():
            for sibling in base.parent.glob("codeenv-*"):
                parts = sibling.name.split("-")  # codeenv-<pid>-<n> or codeenv-worker-<pid>
                pid = parts[2] if len(parts) > 2 and parts[1] == "worker" else parts[1]
                if sibling == base or not pid.isdigit() or Path(f"/proc/{pid}").exists():
                    continue
                for group in [g for g in sibling.iterdir() if g.is_dir()] + [sibling]:
                    try:
                        for p in (group / "cgroup.procs").read_text().split():
                            os.kill(int(p), signal.SIGKILL)
                        group.rmdir()
                    except OSError:
                        pass

    def group(self, name: str) -> JailCgroup:
        if self.version == 1:
            cpu = self.bases["cpu"] / name if "cpu" in self.bases else None
            return V1Cgroup(name, self.bases["memory"] / name, self.bases["pids"] / name, cpu)
        return V2Cgroup(name, self.bases["unified"] / name)

    def remove(self) -> None:
        for base in self.bases.values():
            try:
                base.rmdir()
            except OSError:
                pass
