"""How many live sessions a worker may hold without taking what stateless calls and the host need.

Each idle session family costs the worker file descriptors, and the host memory, processes, memory
cgroups (whose ids are 16-bit: 65,535 per host, whoever makes them) and a share of host root's
queued-signal quota (see jail.JAIL_SIGPENDING). `session_budget` turns what the host has into the
most sessions each resource allows; the pool holds `sessions_max` to the least of them. A
`sessions_max` left at its default is lowered to it; one set on purpose above it is refused at
start, in one line that names the resource.

Usage::

    budget = session_budget(settings, jails=8)
    budget.sessions          # the most that fit
    budget.describe()        # "fds 8954, memory 1409, ..."
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from codeenv.sandbox.jail import JAIL_SIGPENDING
from codeenv.sandbox.sizing import meminfo_bytes
from codeenv.settings import SandboxSettings

#: What an idle session family holds in the worker: its supervisor's socket and a pidfd (its
#: groups' control files are closed between cells). Measured: tests/test_session_budget.py.
FDS_PER_FAMILY = 2
#: What a running cell holds on top: its pipes and memfds, its groups' control files.
FDS_PER_CELL = 32
#: The worker's own fds besides sessions and connections: slots' jails, Redis, logs, the image.
FD_RESERVE = 1024
#: Host memory an idle family takes (supervisor, session process, page tables; measured 5-6 MB on a
#: standard-library profile, copy-on-write from its zygote).
IDLE_FAMILY_BYTES = 8 << 20
#: Processes of an idle family (supervisor, session process, and a fork's).
PIDS_PER_FAMILY = 4
#: Memory cgroups of a family of one session (family, main, s0; each fork adds one, so a session
#: never costs more than this); the kernel numbers memory cgroups in 16 bits.
MEMORY_CGROUPS_PER_FAMILY = 3
MEMORY_CGROUP_IDS = 65_535
PID_MAX = Path("/proc/sys/kernel/pid_max")
PROC_CGROUPS = Path("/proc/cgroups")


@dataclass(frozen=True)
class SessionBudget:
    """Sessions each resource allows."""

    allowed: dict[str, int]

    @property
    def sessions(self) -> int:
        return max(0, min(self.allowed.values()))

    @property
    def binding(self) -> str:
        return min(self.allowed, key=lambda k: self.allowed[k])

    def describe(self) -> str:
        return ", ".join(f"{name} {count}" for name, count in self.allowed.items())


def memory_cgroups_in_use(proc_cgroups: Path = PROC_CGROUPS) -> int:
    """Memory cgroups that exist on the host now (every hierarchy's user counts)."""
    try:
        for line in proc_cgroups.read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == "memory":
                return int(parts[2])
    except (OSError, IndexError, ValueError):
        pass
    return 0


def session_budget(settings: SandboxSettings, jails: int, connections: int = 2048, cells_at_once: int = 16,
                   *, nofile: int | None = None, memory_bytes: int | None = None, pid_max: int | None = None,
                   memory_cgroups: int | None = None, sigpending: int | None = None) -> SessionBudget:
    """The sessions each resource of this host allows a worker with `jails` call and session jails,
    `connections` HTTP connections and `cells_at_once` cells running at once (the keyword arguments
    stand in for what is read from the host)."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nofile = 1 << 20 if nofile == resource.RLIM_INFINITY else nofile
    if memory_bytes is None:
        memory_bytes = meminfo_bytes("MemTotal") or 0
    if pid_max is None:
        pid_max = int(PID_MAX.read_text())
    if memory_cgroups is None:
        memory_cgroups = memory_cgroups_in_use()
    if sigpending is None:
        sigpending = resource.getrlimit(resource.RLIMIT_SIGPENDING)[0]
        sigpending = 1 << 30 if sigpending == resource.RLIM_INFINITY else sigpending
    fds = (nofile - FD_RESERVE - connections - cells_at_once * FDS_PER_CELL - jails * 16) // FDS_PER_FAMILY
    return SessionBudget({
        "open files (RLIMIT_NOFILE)": fds,
        "memory (half the host's)": memory_bytes // 2 // IDLE_FAMILY_BYTES,
        "processes (half of pid_max)": pid_max // 2 // PIDS_PER_FAMILY,
        "memory cgroup ids": (MEMORY_CGROUP_IDS - memory_cgroups - jails - 1024) // MEMORY_CGROUPS_PER_FAMILY,
        "host root's queued signals (half of RLIMIT_SIGPENDING)": sigpending // 2 // JAIL_SIGPENDING - jails,
    })
