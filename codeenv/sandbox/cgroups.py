"""One cgroup per jail, with memory and pids caps, on cgroup v1 or v2.

The worker makes a subtree ``codeenv-<pid>`` below its own cgroup, and a group per jail under it.
nsjail is started inside the jail's group, so the zygote and everything it forks are counted there.
Reading these files from outside is how the worker learns, without trusting the jail, whether a
call hit its memory cap (OOM-kill events), how much memory it used at peak, and whether any of its
processes survived.

The worker refuses to start without working memory and pids caps rather than run jails without
them. On v1 it needs the ``memory`` and ``pids`` hierarchies, writable where it sits. On v2 (a
container with a private cgroup namespace, or a systemd unit with ``Delegate=yes``) it manages its
own cgroup: v2 lets a group with processes hand no controllers to its children ("no internal
processes"), so the worker first moves every process of its cgroup (itself, a container's init,
...) into the leaf ``codeenv-supervisor``, then enables ``+memory +pids`` (and ``+cpu`` if offered)
in its cgroup's ``cgroup.subtree_control``, and again in its ``codeenv-<pid>`` subtree.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from codeenv.errors import SandboxError

logger = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = -1
#: The v2 leaf that the processes of the worker's own cgroup move into, so it can delegate controllers.
SUPERVISOR_LEAF = "codeenv-supervisor"
#: Controllers a jail cannot go without, and the one it can (calls then run without a CPU cap).
REQUIRED_CONTROLLERS = ("memory", "pids")
OPTIONAL_CONTROLLERS = ("cpu",)
#: v1: the hierarchy that measures a jail's CPU time (judged tests' CPU limits); v2 has cpu.stat always.
V1_ACCOUNTING = "cpuacct"
V2_HINT = "docker: --cgroupns=private, systemd: Delegate=yes"
#: Docker mounts /sys/fs/cgroup read-only in a container that is not --privileged.
V2_WRITE_HINT = "docker: --cgroupns=private with /sys/fs/cgroup read-write, e.g. --privileged; systemd: Delegate=yes"
V1_HINT = "docker: --privileged, or /sys/fs/cgroup mounted read-write"
#: Times the worker moves its cgroup's processes out before giving up (new ones may keep arriving).
MOVE_ATTEMPTS = 5


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


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """``/proc/<pid>/cgroup`` as {controller: path}; the v2 unified hierarchy is the key ''."""
    own: dict[str, str] = {}
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own.setdefault(controller, path)
    return own


def _mounted_v1(root: Path) -> list[str]:
    try:
        return sorted(d.name for d in root.iterdir() if (d / "cgroup.procs").exists())
    except OSError:
        return []


class CgroupFs:
    """The file operations of setting up the worker's subtree (never of a call: see _ControlFiles).

    cgroupfs is not a file system like others: a write to ``cgroup.procs`` moves a process,
    ``cgroup.subtree_control`` refuses controllers with EBUSY while its group holds processes, and
    one write carries one value. Tests stand in for those rules with a subclass over a plain directory.
    """

    def read(self, path: Path) -> str:
        return path.read_text()

    def write(self, path: Path, text: str) -> None:
        with open(path, "w") as f:  # one write() per value, as cgroupfs wants it
            f.write(text)

    def mkdir(self, path: Path) -> None:
        path.mkdir(exist_ok=True)


@dataclass(frozen=True)
class CgroupLayout:
    """Where cgroups are mounted (`root`), which version, and where this process sits (`own`).

    Both the root and `own` (``/proc/self/cgroup``, parsed) can be given, so the logic runs against
    a directory laid out like a hierarchy in tests and in ``codeenv doctor --cgroup-root``.
    """

    root: Path
    version: int
    own: Mapping[str, str]

    @classmethod
    def detect(cls, root: Path | None = None, proc_cgroup: str | None = None) -> CgroupLayout:
        """The layout under `root`; SandboxError saying what is missing if it cannot cap jails."""
        root = root or DEFAULT_ROOT
        own = parse_proc_cgroup(proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text())
        if (root / "cgroup.controllers").exists():
            if "" not in own:
                raise SandboxError(f"cgroup v2 is mounted at {root}, but this process is in no v2 cgroup")
            return cls(root, 2, own)
        mounted = _mounted_v1(root)
        if not mounted:
            raise SandboxError(
                f"no cgroup file system at {root}: the worker needs cgroup v1 (memory and pids hierarchies) or "
                f"cgroup v2 with memory and pids delegated ({V2_HINT})")
        checks = {"memory": "memory.limit_in_bytes", "pids": "cgroup.procs"}
        for name, probe in checks.items():
            if not (root / name / probe).exists() or name not in own:
                raise SandboxError(
                    f"cgroup v1: the {name} hierarchy is not mounted at {root / name} (mounted: "
                    f"{' '.join(mounted)}); jails need memory and pids caps: mount it "
                    f"(mount -t cgroup -o {name} cgroup {root / name})")
        return cls(root, 1, own)

    def mount(self, hierarchy: str) -> Path:
        """The mount of a v1 hierarchy ("memory", "pids", "cpu"); the v2 root for ""."""
        return self.root / hierarchy if hierarchy else self.root

    def own_dir(self, hierarchy: str) -> Path:
        """This process's cgroup directory in `hierarchy` ("" on v2).

        In a container without a cgroup namespace, /proc/self/cgroup names a path on the host, while
        the mount shows the container's own group as its root: then the mount root is the answer.
        """
        mount = self.mount(hierarchy)
        path = mount / self.own[hierarchy].lstrip("/")
        if path != mount and not path.is_dir():
            try:
                if str(os.getpid()) in (mount / "cgroup.procs").read_text().split():
                    return mount
            except OSError:
                pass
        return path

    def delegated_dir(self) -> Path:
        """v2: the cgroup the worker manages (its own, or the parent of its supervisor leaf)."""
        own = self.own_dir("")
        return own.parent if own.name == SUPERVISOR_LEAF else own


def _move_processes(cgroup: Path, leaf: Path, fs: CgroupFs) -> int:
    """Move every process of `cgroup` into `leaf`; return how many moved."""
    fs.mkdir(leaf)
    moved = 0
    for pid in fs.read(cgroup / "cgroup.procs").split():
        try:
            fs.write(leaf / "cgroup.procs", pid)
            moved += 1
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                continue  # it exited meanwhile
            raise SandboxError(
                f"cgroup v2: cannot move process {pid} from {cgroup} into {leaf} ({exc}); the worker must "
                f"own its cgroup ({V2_WRITE_HINT})") from exc
    return moved


def _enable_controllers(cgroup: Path, controllers: list[str], fs: CgroupFs) -> None:
    """Write ``+c ...`` to `cgroup`'s subtree_control, first moving its processes into a leaf if v2
    refuses (EBUSY: a group with processes cannot hand controllers to its children). Processes may
    arrive between the move and the write (a ``docker exec``), so it tries a few times."""
    control = cgroup / "cgroup.subtree_control"
    text = " ".join(f"+{c}" for c in controllers)
    for _ in range(MOVE_ATTEMPTS):
        try:
            fs.write(control, text)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise SandboxError(
                    f"cgroup v2: cannot enable {text} in {control} ({exc}); give the worker a cgroup with "
                    f"{' and '.join(controllers)} delegated ({V2_WRITE_HINT})") from exc
        moved = _move_processes(cgroup, cgroup / SUPERVISOR_LEAF, fs)
        logger.info("cgroup v2: moved %d process(es) of %s into %s, so that it can enable %s", moved, cgroup,
                    SUPERVISOR_LEAF, text)
    raise SandboxError(
        f"cgroup v2: cannot enable {text} in {control}: processes keep arriving in {cgroup} while the worker "
        f"moves them into {SUPERVISOR_LEAF}; start the worker in a cgroup of its own")


def require_v2_controllers(cgroup: Path, available: list[str]) -> None:
    """SandboxError naming the first required controller that `cgroup` is not given."""
    for controller in REQUIRED_CONTROLLERS:
        if controller not in available:
            raise SandboxError(
                f"cgroup v2: the {controller} controller is not available in {cgroup} (cgroup.controllers "
                f"lists: {' '.join(available) or 'nothing'}); give the container a cgroup with {controller} "
                f"delegated ({V2_HINT})")


def delegate_v2(cgroup: Path, fs: CgroupFs | None = None) -> list[str]:
    """Make memory and pids (and cpu, if offered) usable by groups below `cgroup`; return them.

    Refuses (SandboxError) when `cgroup` is not given memory or pids: jails without them would run
    uncapped. The cpu controller is optional: without it, calls run without a CPU cap.
    """
    fs = fs or CgroupFs()
    available = fs.read(cgroup / "cgroup.controllers").split()
    require_v2_controllers(cgroup, available)
    enabled = fs.read(cgroup / "cgroup.subtree_control").split()
    missing = [c for c in REQUIRED_CONTROLLERS if c not in enabled]
    if missing:
        _enable_controllers(cgroup, missing, fs)
    wanted = list(REQUIRED_CONTROLLERS)
    for controller in OPTIONAL_CONTROLLERS:
        if controller not in available:
            continue
        if controller not in enabled:
            try:
                _enable_controllers(cgroup, [controller], fs)
            except SandboxError as exc:
                logger.warning("%s; calls run without a %s cap", exc, controller)
                continue
        wanted.append(controller)
    return wanted


class JailCgroup(Protocol):
    """The cgroup of one jail."""

    name: str

    def procs_files(self) -> list[Path]: ...
    def set_cpu_limit(self, cpus: float) -> None: ...
    def set_cpu_weight(self, times_default: float) -> None: ...
    def kill_all(self) -> bool: ...
    def set_memory_limit(self, limit_bytes: int) -> None: ...
    def set_pids_max(self, count: int) -> None: ...
    def set_socket_memory_limit(self, limit_bytes: int) -> bool: ...
    def memory_usage(self) -> int: ...
    def cpu_usage_ns(self) -> int | None:
        """CPU time used by the group's processes so far, in ns (None without CPU accounting)."""
        ...
    def reset_peak(self) -> None: ...
    def memory_peak(self) -> int | None: ...
    def oom_kills(self) -> int: ...
    def pids_current(self) -> int: ...
    def pids_limit_hits(self) -> int: ...
    def procs(self) -> list[int]: ...
    def remove(self) -> None: ...
    def close_files(self) -> None:
        """Close the control files kept open (they reopen when next used): a group that waits long
        between uses (an idle session's) then holds no fd."""
        ...
    def delegate(self) -> None:
        """Let groups below this one use its controllers (v2; nothing to do on v1)."""


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


def owner_alive(pid: int, made: Path) -> bool:
    """Whether process `pid`, which made `made` (a directory named after it), still runs: a process
    of that pid started after `made` was made is another one (the pid was reused)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        started = boot + start_ticks / os.sysconf("SC_CLK_TCK")
        return started <= made.stat().st_ctime + 2  # btime is whole seconds
    except (OSError, ValueError, IndexError, StopIteration):
        return Path(f"/proc/{pid}").exists()


def remove_tree(top: Path, timeout_s: float = 10.0) -> int:
    """Kill every process in cgroup `top` and the groups below it, then remove them, deepest first;
    the number of groups that would not go."""
    groups = [Path(d) for d, _, _ in os.walk(top)]  # parents before children
    deadline = time.monotonic() + timeout_s
    while True:  # until no group holds a process (a fork in flight joins one while we kill)
        alive = False
        for group in groups:
            try:
                pids = (group / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for p in pids:
                alive = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p), signal.SIGKILL)
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    left = 0
    for group in reversed(groups):  # children first: a group with children cannot go
        while True:
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:  # EBUSY: killed processes take a moment to leave
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    left += 1
                    break
                time.sleep(0.01)
    return left


class V1Cgroup:
    """A jail's group in the v1 ``memory`` and ``pids`` hierarchies."""

    def __init__(self, name: str, memory: Path, pids: Path, cpu: Path | None = None,
                 cpuacct: Path | None = None) -> None:
        self.name = name
        self.memory = memory
        self.pids = pids
        self.cpu = cpu
        self.cpuacct = cpuacct if cpuacct is None or cpu is None or cpuacct.resolve() != cpu.resolve() else None
        self._usage_dir = cpu if cpuacct is not None and self.cpuacct is None else cpuacct
        for d in (memory, pids, cpu, self.cpuacct):
            if d is not None:
                d.mkdir(exist_ok=True)
        self._memsw = (memory / "memory.memsw.limit_in_bytes").exists()
        self._files = _ControlFiles()

    def procs_files(self) -> list[Path]:
        dirs = [self.memory, self.pids] + [d for d in (self.cpu, self.cpuacct) if d is not None]
        return [d / "cgroup.procs" for d in dirs]

    def set_cpu_limit(self, cpus: float) -> None:
        if self.cpu is None:
            return
        try:
            self._files.write(self.cpu, "cpu.cfs_period_us", "100000")
            self._files.write(self.cpu, "cpu.cfs_quota_us", str(int(cpus * 100_000)) if cpus > 0 else "-1")
        except OSError as exc:  # v1 refuses a quota above the parent's (a CPU-limited container)
            logger.warning("no CPU cap of %g for %s (%s): the parent cgroup's own cap applies", cpus, self.name, exc)

    def set_cpu_weight(self, times_default: float) -> None:
        if self.cpu is None:
            return
        try:  # cpu.shares: 1024 by default, 2 to 262144
            self._files.write(self.cpu, "cpu.shares", str(max(2, min(262_144, round(1024 * times_default)))))
        except OSError as exc:
            logger.warning("no CPU weight for %s (%s): the default applies", self.name, exc)

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

    def set_socket_memory_limit(self, limit_bytes: int) -> bool:
        """v1 charges socket buffers to nothing until the group's TCP limit is set: set it (before the
        jail's first socket). False where the kernel has no `memory.kmem.tcp` files."""
        try:
            self._files.write(self.memory, "memory.kmem.tcp.limit_in_bytes", str(limit_bytes))
        except FileNotFoundError:
            return False
        except OSError as exc:  # e.g. a kernel that refuses it once the group has had sockets
            logger.warning("no socket buffer cap for %s: %s", self.name, exc)
            return False
        return True

    def memory_usage(self) -> int:
        return _parse_int(self._files.read(self.memory, "memory.usage_in_bytes"))

    def cpu_usage_ns(self) -> int | None:
        if self._usage_dir is None:
            return None
        return _parse_int(self._files.read(self._usage_dir, "cpuacct.usage"))

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

    def delegate(self) -> None:
        pass

    def close_files(self) -> None:
        self._files.close()

    def remove(self) -> None:
        _kill_procs(self)
        self._files.close()
        for d in (self.memory, self.pids, self.cpu, self.cpuacct):
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
        # Kernels before 6.12 cannot reset the peak (ru_maxrss is used then). A reset holds for the
        # fd it was written to, so the fd stays open from a reset to the read after it.
        self._resettable_peak = (path / "memory.peak").exists()

    def procs_files(self) -> list[Path]:
        return [self.path / "cgroup.procs"]

    def set_cpu_limit(self, cpus: float) -> None:
        if not (self.path / "cpu.max").exists():
            return
        try:
            self._files.write(self.path, "cpu.max", f"{int(cpus * 100_000)} 100000" if cpus > 0 else "max 100000")
        except OSError as exc:
            logger.warning("no CPU cap of %g for %s (%s)", cpus, self.name, exc)

    def set_cpu_weight(self, times_default: float) -> None:
        if not (self.path / "cpu.weight").exists():
            return
        try:  # 100 by default, 1 to 10000
            self._files.write(self.path, "cpu.weight", str(max(1, min(10_000, round(100 * times_default)))))
        except OSError as exc:
            logger.warning("no CPU weight for %s (%s): the default applies", self.name, exc)

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

    def set_socket_memory_limit(self, limit_bytes: int) -> bool:
        """v2 charges socket buffers to memory.current: the memory limit covers them already."""
        return True

    def set_pids_max(self, count: int) -> None:
        self._files.write(self.path, "pids.max", str(count))

    def memory_usage(self) -> int:
        return _parse_int(self._files.read(self.path, "memory.current"))

    def cpu_usage_ns(self) -> int | None:
        return _parse_keyed(self._files.read(self.path, "cpu.stat")).get("usage_usec", 0) * 1000

    def reset_peak(self) -> None:
        if self._peak_fd is None and self._resettable_peak:
            try:
                self._peak_fd = os.open(self.path / "memory.peak", os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                self._resettable_peak = False
        if self._peak_fd is not None:
            try:
                os.write(self._peak_fd, b"reset\n")
            except OSError:
                os.close(self._peak_fd)
                self._peak_fd = None
                self._resettable_peak = False

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

    def close_files(self) -> None:
        self._files.close()
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None

    def delegate(self) -> None:
        available = (self.path / "cgroup.controllers").read_text().split()
        wanted = [c for c in (*REQUIRED_CONTROLLERS, *OPTIONAL_CONTROLLERS) if c in available]
        (self.path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))

    def remove(self) -> None:
        self.kill_all()
        self.close_files()
        _rmdir_when_empty(self.path)


class CgroupTree:
    """The worker's own subtree of jail cgroups."""

    def __init__(self, version: int, bases: dict[str, Path], layout: CgroupLayout | None = None) -> None:
        self.version = version
        self.bases = bases
        self.layout = layout

    @classmethod
    def create(cls, root: Path | None = None, tag: str | None = None, *, layout: CgroupLayout | None = None,
               fs: CgroupFs | None = None) -> CgroupTree:
        """Detect the hierarchy (or take `layout`), set up the worker's subtree `tag`, reap dead ones.

        Raises SandboxError saying what is missing when jails could not get memory and pids caps.
        """
        layout = layout or CgroupLayout.detect(root)
        fs = fs or CgroupFs()
        tag = tag or f"codeenv-{os.getpid()}"
        bases = cls._create_v1(layout, tag, fs) if layout.version == 1 else cls._create_v2(layout, tag, fs)
        cls._reap_stale(bases)
        return cls(layout.version, bases, layout)

    @staticmethod
    def _create_v1(layout: CgroupLayout, tag: str, fs: CgroupFs) -> dict[str, Path]:
        bases = {name: layout.own_dir(name) / tag for name in REQUIRED_CONTROLLERS}
        if "cpu" in layout.own and (layout.mount("cpu") / "cpu.cfs_quota_us").exists():
            bases["cpu"] = layout.own_dir("cpu") / tag
        if V1_ACCOUNTING in layout.own and (layout.mount(V1_ACCOUNTING) / "cpuacct.usage").exists():
            bases[V1_ACCOUNTING] = layout.own_dir(V1_ACCOUNTING) / tag
        for name, base in list(bases.items()):
            try:
                fs.mkdir(base)
            except OSError as exc:
                if name in (*OPTIONAL_CONTROLLERS, V1_ACCOUNTING):
                    logger.warning("cgroup v1: cannot create %s (%s); calls run without %s", base, exc, name)
                    del bases[name]
                    continue
                raise SandboxError(
                    f"cgroup v1: cannot create {base} in the {name} hierarchy ({exc}); the worker needs its "
                    f"own {name} cgroup writable ({V1_HINT})") from exc
        return bases

    @staticmethod
    def _create_v2(layout: CgroupLayout, tag: str, fs: CgroupFs) -> dict[str, Path]:
        parent = layout.delegated_dir()
        enabled = delegate_v2(parent, fs)
        base = parent / tag
        try:
            fs.mkdir(base)
            fs.write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in enabled))
        except OSError as exc:
            raise SandboxError(f"cgroup v2: cannot create the jails' cgroups under {base} ({exc}); the worker "
                               f"must own its cgroup ({V2_WRITE_HINT})") from exc
        return {"unified": base}

    @staticmethod
    def _reap_stale(bases: dict[str, Path]) -> None:
        """Remove subtrees left by workers that ended without cleaning up (SIGKILL included), at any
        depth (codeenv-PID-N/families/familyK/main, ...): every process in them is killed first."""
        for base in bases.values():
            for sibling in base.parent.glob("codeenv-*"):
                pid = sibling.name.split("-")[1]  # codeenv-<pid>-<n>; codeenv-supervisor is no subtree
                if sibling == base or not pid.isdigit() or owner_alive(int(pid), sibling):
                    continue
                left = remove_tree(sibling)
                if left:
                    logger.warning("cannot remove %d cgroup(s) left by dead worker %s under %s", left, pid, sibling)
                else:
                    logger.info("removed the cgroups left by dead worker %s (%s)", pid, sibling)

    def group(self, name: str) -> JailCgroup:
        if self.version == 1:
            cpu = self.bases["cpu"] / name if "cpu" in self.bases else None
            cpuacct = self.bases["cpuacct"] / name if "cpuacct" in self.bases else None
            return V1Cgroup(name, self.bases["memory"] / name, self.bases["pids"] / name, cpu, cpuacct)
        return V2Cgroup(name, self.bases["unified"] / name)

    def memory_usage(self) -> int:
        """What every jail and session of the worker uses together now (its subtree's charge), in bytes."""
        if self.version == 1:
            return _parse_int((self.bases["memory"] / "memory.usage_in_bytes").read_text())
        return _parse_int((self.bases["unified"] / "memory.current").read_text())

    def remove(self) -> None:
        for base in self.bases.values():
            try:
                base.rmdir()
            except OSError:
                pass
