"""How many slots fit in the memory the worker may use.

A slot holds its idle zygotes (one per profile of the image) and runs one call at a time, which may
use up to ``caps.memory_mb`` on top of its zygote before its jail's cgroup OOM-kills it. If
``slots × (zygotes + largest call)`` is more than the worker's own cgroup allows, a burst of big
calls makes the kernel OOM-kill inside the worker's cgroup (in a container: the container) instead
of the one call that asked for too much. So the pool starts only as many slots as fit, says so, and
refuses to start when not even one does. ``codeenv doctor`` reports the same computation.

Usage::

    plan = plan_slots(settings, image.spec, memory_allowance(layout))
    slots = apply_plan(plan)         # logs a warning if it had to lower the count; raises if 0
    preflight(settings, image.spec)  # the same refusals, before a command binds or starts anything
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from codeenv.errors import SandboxError
from codeenv.sandbox.cgroups import CgroupLayout, require_v2_controllers
from codeenv.sandbox.image import ImageSpec
from codeenv.settings import SandboxSettings

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
#: Limits at or above this mean "none" (v1 writes "no limit" as a page-rounded 2**63 - 1).
NO_LIMIT_BYTES = 1 << 62
#: Estimated memory of an idle zygote (with its nsjail), as the jail's cgroup counts it. Measured on
#: python-math: a standard-library profile 11-12 MB, numpy + sympy + mpmath 62-64 MB, those with
#: scipy and networkx 92-93 MB. An image with heavier preloads should set zygote_memory_mb.
STDLIB_ZYGOTE_MB = 16
PRELOAD_ZYGOTE_MB = 96


def estimate_zygote_mb(spec: ImageSpec) -> int:
    """Memory one slot's idle zygotes take, all profiles together, estimated from their preloads."""
    total = 0
    for profile in spec.profiles:
        stdlib_only = all(name.partition(".")[0] in sys.stdlib_module_names for name in profile.preload)
        total += STDLIB_ZYGOTE_MB if stdlib_only else PRELOAD_ZYGOTE_MB
    return total


@dataclass(frozen=True)
class MemoryAllowance:
    """The most memory the worker's processes may use together, and what sets it."""

    limit_mb: int
    #: Completes "exceeds the N MB ...": "this worker's cgroup allows" or "of this host's memory".
    source: str
    #: The cgroup whose limit binds, if one does.
    cgroup: Path | None = None


def _limit_file(layout: CgroupLayout) -> tuple[Path, Path, str]:
    """The worker's own memory cgroup, the mount it lies in, and the file that holds its limit."""
    if layout.version == 1:
        return layout.own_dir("memory"), layout.mount("memory"), "memory.limit_in_bytes"
    return layout.delegated_dir(), layout.mount(""), "memory.max"


def cgroup_memory_limit(layout: CgroupLayout) -> tuple[int, Path] | None:
    """The lowest memory limit on the worker's cgroup and its visible ancestors, in bytes, and where.

    v1 (hierarchical accounting) and v2 both enforce every ancestor's limit, so the lowest counts.
    None when no visible group is limited.
    """
    own, mount, name = _limit_file(layout)
    lowest: tuple[int, Path] | None = None
    for directory in [own, *own.parents]:
        if not directory.is_relative_to(mount):
            break
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue  # the root group has no limit file
        if text == "max" or not text.isdigit() or int(text) >= NO_LIMIT_BYTES:
            continue
        if lowest is None or int(text) < lowest[0]:
            lowest = (int(text), directory)
    return lowest


def meminfo_bytes(field: str, meminfo: Path = MEMINFO) -> int | None:
    """A field of /proc/meminfo in bytes, or None where the kernel gives none."""
    for line in meminfo.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    return None


def host_memory_mb(meminfo: Path = MEMINFO) -> int:
    total = meminfo_bytes("MemTotal", meminfo)
    if total is None:
        raise SandboxError(f"no MemTotal in {meminfo}")
    return total >> 20


def memory_allowance(layout: CgroupLayout | None, meminfo: Path = MEMINFO) -> MemoryAllowance:
    """The lower of the worker's cgroup limit (if any) and the host's memory."""
    host = MemoryAllowance(host_memory_mb(meminfo), "of this host's memory (MemTotal)")
    limit = cgroup_memory_limit(layout) if layout is not None else None
    if limit is None or limit[0] >> 20 >= host.limit_mb:
        return host
    return MemoryAllowance(limit[0] >> 20, "this worker's cgroup allows", limit[1])


@dataclass(frozen=True)
class SlotPlan:
    """The slot count asked for, and the count that fits."""

    wanted: int
    slots: int
    zygote_mb: int
    call_mb: int
    allowance: MemoryAllowance

    @property
    def slot_mb(self) -> int:
        return self.zygote_mb + self.call_mb

    @property
    def needed_mb(self) -> int:
        return self.wanted * self.slot_mb

    @property
    def arithmetic(self) -> str:
        return (f"{self.wanted} slot{'s' if self.wanted > 1 else ''} × ({self.zygote_mb} MB zygote + "
                f"{self.call_mb} MB per call) = {self.needed_mb} MB")

    @property
    def over_host_memory(self) -> bool:
        """No cgroup limit binds, and the worst case would not fit in the host's memory."""
        return self.allowance.cgroup is None and self.needed_mb > self.allowance.limit_mb

    @property
    def room(self) -> str:
        return f"the {self.allowance.limit_mb} MB {self.allowance.source}"

    def describe(self) -> str:
        """One line: the arithmetic and its verdict (what the pool logs and `codeenv doctor` shows)."""
        sum_, room = self.arithmetic, self.room
        if self.slots == 0:
            return (f"memory: one slot needs {self.zygote_mb} MB zygote + {self.call_mb} MB per call = "
                    f"{self.slot_mb} MB, more than {room}; lower caps.memory_mb (CODEENV_CAPS__MEMORY_MB) "
                    "or give the worker more memory")
        if self.over_host_memory:
            return (f"memory: {sum_} exceeds {room}: if every slot ran a call of the largest size at once, the "
                    "kernel's OOM killer would pick what dies; give the worker a cgroup memory limit (then the "
                    "pool runs only the slots that fit) or lower caps.memory_mb (CODEENV_CAPS__MEMORY_MB)")
        if self.slots == self.wanted:
            return f"memory: {sum_} fits in {room}"
        return f"memory: {sum_} exceeds {room}; running {self.slots} slot{'s' if self.slots > 1 else ''}"


def plan_slots(settings: SandboxSettings, spec: ImageSpec, allowance: MemoryAllowance) -> SlotPlan:
    """How many of `settings.slots` fit: each needs its zygotes plus the largest call (caps.memory_mb).

    Only a cgroup limit lowers the count: its OOM kill would take the whole worker (in a container,
    the container). Without one, the host's memory is checked but only warned about
    (`over_host_memory`): the kernel's global OOM killer picks the largest process, a call, and the
    jail reports `memory`; cutting a 64-core node to the slots whose worst case fits its RAM at once
    would cost most of its throughput for a case that seldom happens. A cap larger than the whole
    host refuses either way.
    """
    zygote_mb = settings.zygote_memory_mb or estimate_zygote_mb(spec)
    call_mb = settings.caps.memory_mb
    fit = min(settings.slots, allowance.limit_mb // (zygote_mb + call_mb))
    if allowance.cgroup is None and fit > 0:
        fit = settings.slots
    return SlotPlan(settings.slots, fit, zygote_mb, call_mb, allowance)


def apply_plan(plan: SlotPlan) -> int:
    """The slot count to run: refuses (SandboxError) if none fits, warns if fewer than asked."""
    if plan.slots == 0:
        raise SandboxError(plan.describe())
    if plan.slots < plan.wanted or plan.over_host_memory:
        logger.warning("%s", plan.describe())
    return plan.slots


def preflight(settings: SandboxSettings, spec: ImageSpec) -> SlotPlan:
    """What the pool would refuse at start, checked without touching the host: a cgroup hierarchy
    without memory or pids, or not one slot fitting in memory. Lets `codeenv serve` fail with a
    message before it binds, instead of with its application's start-up traceback."""
    layout = CgroupLayout.detect(settings.cgroup_root)
    if layout.version == 2:
        cgroup = layout.delegated_dir()
        require_v2_controllers(cgroup, (cgroup / "cgroup.controllers").read_text().split())
    plan = plan_slots(settings, spec, memory_allowance(layout))
    if plan.slots == 0:
        raise SandboxError(plan.describe())
    return plan


# --- socket buffers (kernel memory no memory limit counts on cgroup v1) ----------------------------

TCP_MEM = Path("/proc/sys/net/ipv4/tcp_mem")
PAGE = 4096


def tcp_pressure_bytes(tcp_mem: Path = TCP_MEM) -> int | None:
    """The host's TCP memory pressure threshold (tcp_mem's middle value), or None if unknown."""
    try:
        return int(tcp_mem.read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def socket_memory_limit(settings: SandboxSettings, tcp_mem: Path = TCP_MEM) -> int:
    """The socket buffer cap of one jail: `socket_memory_mb`, lowered so that all slots together
    stay below half the host's TCP pressure threshold (the other half is the host's: Redis, the
    gateway). Set on cgroup v1, where socket buffers are otherwise charged to nothing."""
    cap = settings.socket_memory_mb << 20
    pressure = tcp_pressure_bytes(tcp_mem)
    if pressure is not None:
        cap = min(cap, pressure // 2 // settings.slots)
    return max(cap, 1 << 20)


def families_socket_memory_limit(settings: SandboxSettings, tcp_mem: Path = TCP_MEM) -> int:
    """The socket buffer cap of all session families of a worker together (their common parent group):
    a quarter of the host's TCP pressure threshold, on top of the slots' half, so that sessions can
    neither take the calls' share nor push the host into TCP memory pressure. Each family also has the
    cap of one slot (`socket_memory_limit`)."""
    cap = (settings.socket_memory_mb << 20) * max(1, settings.sessions_max)
    pressure = tcp_pressure_bytes(tcp_mem)
    if pressure is not None:
        cap = min(cap, pressure // 4 // PAGE * PAGE)
    return max(cap, 1 << 20)
