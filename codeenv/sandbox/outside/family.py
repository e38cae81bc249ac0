"""A session family on the worker's side: its state (`Family`, and its `Session`s) and the
processes of it that the worker must find in its own pid namespace."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from codeenv.errors import SandboxError
from codeenv.models import ExecResult, Limits
from codeenv.sandbox.cgroups import JailCgroup
from codeenv.sandbox.host_functions import HostSession
from codeenv.sandbox.outside.families import FamilyChannel, SessionJail


@dataclass
class Family:
    """One family on the worker's side: its supervisor's socket and pidfd, its uid, and its cgroups.

    `cgroup` holds the family's CPU cap and its pids cap. Below it, `main` holds the supervisor, and
    `groups[N]` session N's process and its cells': each session has a memory cap of its own
    (`memory_cap`), so what one keeps never leaves a sibling's cells less. While a cell runs its
    session's group has the cell's limits; the cell's processes are the first the OOM killer takes
    there, before the stopped pre-cell process."""

    fid: int
    uid_index: int
    jail: SessionJail
    sock: socket.socket
    pidfd: int
    cgroup: JailCgroup
    main: JailCgroup
    groups: dict[int, JailCgroup]
    memory_cap: int
    sessions: dict[int, Session] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_index: int = 1
    ended: str | None = None
    channel: FamilyChannel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = FamilyChannel(self.sock)

    def move(self, pids: Iterable[int], to: JailCgroup) -> None:
        """Move processes of the family into `to`; SandboxError when the kernel refuses (a process
        that ended is no error). A process left outside its group would run without its caps."""
        for pid in pids:
            for procs in to.procs_files():
                try:
                    procs.write_text(str(pid))
                except ProcessLookupError:
                    break
                except OSError as exc:
                    raise SandboxError(f"cannot move a session's process into its cgroup {procs.parent} "
                                       f"({exc.strerror}); it would run without its limits") from exc

    def remove_cgroups(self) -> None:
        for group in (*self.groups.values(), self.main, self.cgroup):  # children first
            group.remove()

    def close_files(self) -> None:
        """Between cells the family holds no cgroup file open: an idle family costs the worker two
        fds (its socket and pidfd), whatever its groups' control files a cell reads."""
        for group in (*self.groups.values(), self.main, self.cgroup):
            group.close_files()

    @property
    def last_used(self) -> float:
        return max((s.last_used for s in self.sessions.values()), default=0.0)


#: What a Session is: a live session, or a snapshot (a fork that runs no cell, only forks).
SESSION, SNAPSHOT = "session", "snapshot"


@dataclass
class Session:
    id: str
    index: int  # its number in the family (the supervisor's sid)
    family: Family
    owner: bytes  # the hash of its creator's session key (its forks': the same)
    profile: str
    idle_ttl_s: float
    limits: Limits
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    cells: int = 0
    busy: int = 0  # cells running or waiting
    alias: str | None = None  # the id its creator chose, if it chose one (what the session answers to)
    kind: str = SESSION  # or SNAPSHOT
    expires: float | None = None  # a snapshot's end (monotonic)
    cpu_s: float = 0.0  # its cells' CPU time
    host: HostSession | None = None  # its host functions and their totals
    cell_ids: collections.OrderedDict[str, asyncio.Future[ExecResult]] = field(
        default_factory=collections.OrderedDict)

    @property
    def public_id(self) -> str:
        """The id its owner knows it by: the one it chose, else the one the service made."""
        return self.alias if self.alias is not None else self.id

    def describe(self, worker: str = "") -> dict[str, Any]:
        now = time.monotonic()
        family_memory = memory = None
        with contextlib.suppress(OSError, ValueError):
            family_memory = self.family.cgroup.memory_usage()
        with contextlib.suppress(OSError, ValueError, KeyError):  # what it keeps (a fork: beyond what it shares)
            memory = self.family.groups[self.index].memory_usage()
        info = {"session_id": self.public_id, "kind": self.kind, "profile": self.profile, "worker": worker,
                "age_s": round(now - self.created, 3),
                "idle_s": round(0.0 if self.busy else now - self.last_used, 3), "cells": self.cells,
                "cpu_s": round(self.cpu_s, 6), "memory_bytes": memory, "family_memory_bytes": family_memory,
                "family_sessions": len(self.family.sessions), "idle_ttl_s": self.idle_ttl_s}
        if self.expires is not None:
            info["expires_in_s"] = round(max(0.0, self.expires - now), 3)
        if self.host is not None:
            info.update(functions=sorted(self.host.spec.functions), host_calls=self.host.calls,
                        host_s=round(self.host.seconds, 6))
        return info


def pidfd_pid(pidfd: int) -> int:
    """The pid (in our namespace) of the process a pidfd refers to."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise SandboxError("the kernel does not say which process a pidfd refers to")
