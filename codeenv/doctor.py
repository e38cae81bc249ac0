"""``codeenv doctor``: what this host offers a worker, and what is missing.

Each check ends ``ok``, ``warn`` (the worker runs, on a weaker host) or ``fail`` (the worker would
refuse to start, or run jails without a protection). The checks call what the worker calls at
start (the cgroup layout and its delegation rules, the slot sizing, the uid range check), so the
doctor and the worker agree; they change nothing on the host (probe cgroups are removed at once,
and on cgroup v2 the doctor reports the processes the worker would move instead of moving them).
The doctor judges the cgroup it runs in: run it where the worker runs (inside its container, or
with ``systemd-run -p Delegate=yes`` like its unit).

Usage::

    checks = run_checks(SandboxSettings())
    print(to_json(checks)) if machine else render(checks, Console())
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from codeenv.errors import CodeenvError, SandboxError
from codeenv.sandbox.cgroups import (
    OPTIONAL_CONTROLLERS,
    REQUIRED_CONTROLLERS,
    SUPERVISOR_LEAF,
    V1_ACCOUNTING,
    V2_WRITE_HINT,
    CgroupLayout,
    require_v2_controllers,
)
from codeenv.sandbox.image import Image, ImageSpec, current_image, find_spec, spec_digest
from codeenv.sandbox.jail import check_traversable, linker_notice, nsjail_binary
from codeenv.sandbox.probe import missing_library, package_for, probe_jail
from codeenv.sandbox.sizing import (
    SlotPlan,
    cgroup_memory_limit,
    host_memory_mb,
    memory_allowance,
    plan_slots,
    socket_memory_limit,
    tcp_pressure_bytes,
)
from codeenv.sandbox.uids import (
    check_uids_free,
    check_uids_mapped,
    check_user_namespace,
    claim_for,
    in_user_namespace,
    uids_needed,
)
from codeenv.settings import SandboxSettings

#: The namespaces every jail is made of (jail.py sets each clone_new* flag).
NAMESPACES = {
    "user": os.CLONE_NEWUSER, "pid": os.CLONE_NEWPID, "net": os.CLONE_NEWNET, "mount": os.CLONE_NEWNS,
    "uts": os.CLONE_NEWUTS, "ipc": os.CLONE_NEWIPC, "cgroup": os.CLONE_NEWCGROUP,
}
PROBE_TIMEOUT_S = 20
#: Installs an allow-everything seccomp filter, as nsjail does with its policy (PR_SET_NO_NEW_PRIVS
#: 38, PR_SET_SECCOMP 22, SECCOMP_MODE_FILTER 2; one BPF_RET|BPF_K instruction: SECCOMP_RET_ALLOW).
SECCOMP_PROBE = """
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
insn = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000))
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
prog = Prog(1, ctypes.addressof(insn))
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(prog), 0, 0):
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
"""


class Level(StrEnum):
    ok = "ok"
    warn = "warn"
    fail = "fail"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: Level
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    sizing: SlotPlan | None = None

    @property
    def ok(self) -> bool:
        return all(c.status != Level.fail for c in self.checks)

    def add(self, name: str, status: Level, detail: str) -> None:
        self.checks.append(Check(name, status, detail))


def _probe(code: str) -> str | None:
    """Run `code` in a fresh interpreter (never fork this one: it may have threads); its error or None."""
    try:
        done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def check_process(report: Report) -> None:
    report.add("root", Level.ok if os.geteuid() == 0 else Level.fail,
               "running as root" if os.geteuid() == 0 else
               "not root: jails need root (namespaces, cgroups, mapping slot uids)")
    version = ".".join(map(str, sys.version_info[:3]))
    report.add("python", Level.ok if sys.version_info >= (3, 12) else Level.fail, f"{version} ({sys.executable})")


def check_namespaces(report: Report) -> None:
    max_userns = (_read(Path("/proc/sys/user/max_user_namespaces")) or "?").strip()
    for name, flag in NAMESPACES.items():
        error = _probe(f"import os; os.unshare({flag})")
        note = f"; user.max_user_namespaces = {max_userns}" if name == "user" else ""
        if error is None:
            report.add(f"namespace {name}", Level.ok, f"can be created{note}")
        else:
            report.add(f"namespace {name}", Level.fail, f"cannot be created: {error}{note}")


def _probe_dir(directory: Path) -> str | None:
    """Whether a group can be made in `directory`: made and removed at once; the error or None."""
    probe = directory / f"codeenv-doctor-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return str(exc)
    return None


def check_cgroups(report: Report, root: Path | None) -> CgroupLayout | None:
    try:
        layout = CgroupLayout.detect(root)
    except (SandboxError, OSError) as exc:
        report.add("cgroup", Level.fail, str(exc))
        return None
    if layout.version == 1:
        report.add("cgroup", Level.ok, f"v1 at {layout.root}")
        for name in (*REQUIRED_CONTROLLERS, *OPTIONAL_CONTROLLERS):
            if name not in layout.own or not (layout.mount(name) / "cgroup.procs").exists():
                report.add(f"cgroup {name}", Level.warn, "not mounted: calls run without a CPU cap")
                continue
            own = layout.own_dir(name)
            error = _probe_dir(own)
            if error is None:
                report.add(f"cgroup {name}", Level.ok, f"{own} is writable")
            else:
                report.add(f"cgroup {name}", Level.fail if name in REQUIRED_CONTROLLERS else Level.warn,
                           f"cannot create a group in {own}: {error}")
        if V1_ACCOUNTING in layout.own and (layout.mount(V1_ACCOUNTING) / "cpuacct.usage").exists():
            report.add(f"cgroup {V1_ACCOUNTING}", Level.ok, "judged tests' CPU limits are enforced within 50 ms")
        else:
            report.add(f"cgroup {V1_ACCOUNTING}", Level.warn, "not mounted: judged tests' CPU limits fall back to "
                       "RLIMIT_CPU (whole seconds)")
        return layout
    own = layout.delegated_dir()
    available = (_read(own / "cgroup.controllers") or "").split()
    enabled = (_read(own / "cgroup.subtree_control") or "").split()
    try:
        require_v2_controllers(own, available)
    except SandboxError as exc:
        report.add("cgroup", Level.fail, str(exc))
        return layout
    wanted = [c for c in (*REQUIRED_CONTROLLERS, *OPTIONAL_CONTROLLERS) if c in available]
    missing = [c for c in wanted if c not in enabled]
    procs = (_read(own / "cgroup.procs") or "").split()
    if not missing:
        plan = f"{' '.join(wanted)} enabled for its subtree already"
    elif procs:
        plan = (f"the worker will move the {len(procs)} process(es) of {own} into {SUPERVISOR_LEAF}, then "
                f"enable {' '.join('+' + c for c in missing)}")
    else:
        plan = f"the worker will enable {' '.join('+' + c for c in missing)}"
    if missing and not os.access(own / "cgroup.subtree_control", os.W_OK):
        report.add("cgroup", Level.fail, f"v2 at {own}: cgroup.subtree_control is not writable ({V2_WRITE_HINT})")
        return layout
    error = _probe_dir(own)
    if error is not None:
        report.add("cgroup", Level.fail, f"v2 at {own}: cannot create a group there ({error}; {V2_WRITE_HINT})")
        return layout
    report.add("cgroup", Level.ok, f"v2 at {own}, offering {' '.join(available)}; {plan}")
    if "cpu" not in available:
        report.add("cgroup cpu", Level.warn, "the cpu controller is not delegated: calls run without a CPU cap")
    return layout


def check_memory(report: Report, settings: SandboxSettings, layout: CgroupLayout | None,
                 spec: ImageSpec | None) -> None:
    try:
        limit = cgroup_memory_limit(layout) if layout is not None else None
        host_mb = host_memory_mb()
        allowance = memory_allowance(layout)
    except (OSError, ValueError, SandboxError) as exc:
        report.add("memory limit", Level.fail, f"cannot read: {exc}")
        return
    where = f"{limit[0] >> 20} MB on {limit[1]}" if limit is not None else "none on the worker's cgroup"
    report.add("memory limit", Level.ok, f"{where}; the host has {host_mb} MB")
    if spec is None:
        return
    plan = plan_slots(settings, spec, allowance)
    report.sizing = plan
    status = Level.fail if not plan.slots else Level.ok if plan.slots == plan.wanted and not plan.over_host_memory \
        else Level.warn
    report.add("slot sizing", status, plan.describe())


def check_swap(report: Report, layout: CgroupLayout | None) -> None:
    swaps = (_read(Path("/proc/swaps")) or "").splitlines()[1:]
    if not swaps:
        report.add("swap", Level.ok, "off")
        return
    accounted = False
    if layout is not None and layout.version == 1:
        accounted = (layout.own_dir("memory") / "memory.memsw.limit_in_bytes").exists()
    elif layout is not None:
        with contextlib.suppress(SandboxError, OSError):
            accounted = (layout.delegated_dir() / "memory.swap.max").exists()
    if accounted:
        report.add("swap", Level.ok, f"on ({len(swaps)} device(s)), accounted: jails get none")
    else:
        report.add("swap", Level.warn, f"on ({len(swaps)} device(s)) and not accounted by the memory cgroup: a call "
                                       "can swap past its memory limit (turn swap off, or boot with swapaccount=1)")


def check_socket_memory(report: Report, settings: SandboxSettings, layout: CgroupLayout | None) -> None:
    """Socket buffers a call queues must count against a limit, and all slots' limits together
    must stay below the host's TCP pressure threshold (Redis and the gateway share it)."""
    if layout is None:
        return
    if layout.version == 2:
        report.add("socket memory", Level.ok, "charged to each jail's memory limit (cgroup v2)")
        return
    if not (layout.own_dir("memory") / "memory.kmem.tcp.limit_in_bytes").exists():
        report.add("socket memory", Level.warn, "this kernel cannot account socket buffers on cgroup v1 (no "
                                                "memory.kmem.tcp): a call can queue them outside its memory limit")
        return
    per_jail = socket_memory_limit(settings)
    pressure = tcp_pressure_bytes()
    total = per_jail * settings.slots
    detail = f"{settings.slots} slots × {per_jail >> 20} MB of socket buffers = {total >> 20} MB"
    if pressure is not None and total >= pressure:
        report.add("socket memory", Level.warn, f"{detail}, not below the host's TCP pressure threshold "
                                                f"({pressure >> 20} MB): lower CODEENV_SOCKET_MEMORY_MB")
    else:
        below = f", below the host's TCP pressure threshold ({pressure >> 20} MB)" if pressure else ""
        report.add("socket memory", Level.ok, f"{detail}{below}")


def check_seccomp(report: Report) -> None:
    status = _read(Path("/proc/self/status")) or ""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "Seccomp" not in fields:
        report.add("seccomp", Level.fail, "this kernel has no seccomp (CONFIG_SECCOMP): jails need it")
        return
    error = _probe(SECCOMP_PROBE)
    mode = fields["Seccomp"].strip()
    note = " (this process runs under a seccomp filter already, e.g. a container's profile)" if mode == "2" else ""
    if error is None:
        report.add("seccomp", Level.ok, f"filters can be installed{note}")
    else:
        report.add("seccomp", Level.fail, f"cannot install a filter: {error}{note}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (not built, or not among the active LSMs)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION): the jail's side has its own
    # copy of the number (inside/proc.py), which only the pool and the protocol may import from
    version = libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, int(version))


def check_landlock(report: Report, settings: SandboxSettings) -> None:
    abi = landlock_abi()
    if abi >= 6:
        report.add("session forks apart", Level.ok, f"Landlock ABI {abi}: each fork gets a domain of its own")
    elif not settings.session_forks_apart:
        report.add("session forks apart", Level.warn, f"off (CODEENV_SESSION_FORKS_APART=false; Landlock ABI "
                                                      f"{abi}): a session's forks can signal each other")
    else:
        report.add("session forks apart", Level.warn, f"Landlock ABI {abi or 'absent'} has no scopes (6, Linux "
                                                      "6.12): session forks are refused; upgrade the kernel, or "
                                                      "set CODEENV_SESSION_FORKS_APART=false to share a domain")


def check_bpf(report: Report) -> None:
    value = (_read(Path("/proc/sys/kernel/unprivileged_bpf_disabled")) or "").strip()
    if value == "0":
        report.add("unprivileged bpf", Level.warn, "enabled: jails' seccomp refuses bpf(), but the host is more "
                                                   "exposed (sysctl kernel.unprivileged_bpf_disabled=1)")
    else:
        report.add("unprivileged bpf", Level.ok, f"disabled ({value})" if value else "not available")


#: (check name, sysctl file, values that are fine, what fixes it, why it matters)
SYSCTLS = (
    ("kernel log", "kernel/dmesg_restrict", {"1"}, "sysctl -w kernel.dmesg_restrict=1",
     "any user of the host may read the kernel log"),
    ("userfaultfd", "vm/unprivileged_userfaultfd", {"0"}, "sysctl -w vm.unprivileged_userfaultfd=0",
     "unprivileged userfaultfd is the usual tool to widen kernel race windows"),
    ("io_uring", "kernel/io_uring_disabled", {"1", "2"}, "sysctl -w kernel.io_uring_disabled=2",
     "io_uring has been the kernel's largest source of privilege escalations"),
)


def check_host_baseline(report: Report) -> None:
    """The host settings the jail relies on for defence in depth (its seccomp policy refuses all of
    these inside jails): each ok, or a warning with the command that fixes it."""
    for name, path, fine, fix, why in SYSCTLS:
        value = (_read(Path("/proc/sys") / path) or "").strip()
        if not value:
            report.add(name, Level.ok, f"not available on this kernel ({path.replace('/', '.')})")
        elif value in fine:
            report.add(name, Level.ok, f"restricted ({path.replace('/', '.')} = {value})")
        else:
            report.add(name, Level.warn, f"{why} ({path.replace('/', '.')} = {value}): {fix}")
    # getpid through the x32 ABI: -1 (ENOSYS) where the kernel has x32 off.
    error = _probe("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
                   "sys.exit(0 if libc.syscall(39 | 0x40000000) == -1 else 1)")
    if error is None:
        report.add("x32 syscalls", Level.ok, "disabled")
    else:
        report.add("x32 syscalls", Level.warn, "enabled: every jail kills them (its ABI filter), but the host is "
                                               "more exposed; boot with syscall.x32=n")


def check_core_pattern(report: Report) -> None:
    """A crash in a jail must not start anything outside it. Jails' processes are non-dumpable, but
    a program a call execs (`python3 -c`) is dumpable again, and the kernel pipes its core to a
    `|helper` on the host whatever RLIMIT_CORE says."""
    pattern = (_read(Path("/proc/sys/kernel/core_pattern")) or "").strip()
    if pattern.startswith("|"):
        report.add("core dumps", Level.warn, f"kernel.core_pattern pipes core dumps to a host program "
                                             f"({pattern[:80]}): a crash in a jail starts it; set "
                                             "kernel.core_pattern=core (or a path)")
    else:
        report.add("core dumps", Level.ok, f"written as files ({pattern or 'core'}), never piped to a host program")


def check_uids(report: Report, settings: SandboxSettings, slots: int) -> int | None:
    """The host uids a pool would run its slots as (claimed and released again), or None."""
    try:
        check_user_namespace(settings)
    except SandboxError as exc:
        report.add("slot uids", Level.fail, str(exc))
        return None
    if settings.uid_base is not None:
        try:
            check_uids_mapped(settings.uid_base, uids_needed(settings))
            check_uids_free(settings.uid_base, slots)
        except SandboxError as exc:
            report.add("slot uids", Level.fail, str(exc))
            return None
        last = settings.uid_base + slots - 1
        report.add("slot uids", Level.ok, f"{settings.uid_base}..{last} unused (CODEENV_UID_BASE)")
        return settings.uid_base
    try:
        block = claim_for(settings)
    except SandboxError as exc:
        report.add("slot uids", Level.fail, str(exc))
        return None
    block.release()
    where = " of this process's own user namespace (as in a pod)" if in_user_namespace() else ""
    report.add("slot uids", Level.ok, f"a free block from host uid {block.base}{where} ({block.size} uids; locks in "
                                      f"{settings.uid_lock_dir})")
    return block.base


def _tail(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not linker_notice(line)]
    return lines[-1] if lines else ""


def check_nsjail(report: Report, settings: SandboxSettings, image: Image | None, uid: int | None) -> None:
    """The pool's own start check: one jail of the image, as a slot gets it (else only that nsjail runs)."""
    try:
        binary = nsjail_binary(settings)
    except CodeenvError as exc:
        report.add("nsjail", Level.fail, str(exc))
        return
    if image is None or uid is None:
        try:
            done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            report.add("nsjail", Level.fail, f"{binary} does not run: {exc}")
            return
        library = missing_library(done.stderr)
        if library is not None:
            report.add("nsjail", Level.fail, f"{binary} cannot run: its shared library {library} is missing; "
                                             f"install the Debian package {package_for(library)}")
        elif "Usage" not in done.stdout + done.stderr:
            report.add("nsjail", Level.fail, f"{binary} does not run: {_tail(done.stderr) or done.returncode}")
        else:
            report.add("nsjail", Level.warn, f"{binary} runs; no jail tried (no built image or no free uids)")
        return
    try:
        probe_jail(settings, image, binary, uid)
    except SandboxError as exc:
        report.add("nsjail", Level.fail, str(exc))
        return
    report.add("nsjail", Level.ok, f"{binary} runs a jail of {image.name} as host uid {uid}")


def check_image(report: Report, settings: SandboxSettings) -> tuple[ImageSpec | None, Image | None]:
    try:
        spec, raw = find_spec(settings.image)
        image = current_image(settings.images_dir, spec.name, spec_digest(raw))
    except CodeenvError as exc:
        report.add("sandbox image", Level.fail, str(exc))
        return None, None
    if image is None:
        report.add("sandbox image", Level.warn, f"{spec.name} is not built (or its declaration changed): the worker "
                                                f"builds it at start, or run `codeenv image build {settings.image}`")
        return spec, None
    try:
        check_traversable(image.root)
    except SandboxError as exc:
        report.add("sandbox image", Level.fail, str(exc))
        return spec, None
    report.add("sandbox image", Level.ok, f"{image.name} {image.short_hash} at {image.path}")
    return spec, image


def run_checks(settings: SandboxSettings) -> Report:
    """Every check, in the order a reader wants them."""
    report = Report()
    check_process(report)
    check_namespaces(report)
    check_seccomp(report)
    layout = check_cgroups(report, settings.cgroup_root)
    spec, image = check_image(report, settings)
    check_memory(report, settings, layout, spec)
    check_swap(report, layout)
    check_socket_memory(report, settings, layout)
    uid = check_uids(report, settings, settings.slots)
    check_nsjail(report, settings, image, uid)  # the pool's start check: one jail
    check_landlock(report, settings)
    check_bpf(report)
    check_core_pattern(report)
    check_host_baseline(report)
    return report


def to_json(report: Report) -> str:
    out: dict[str, Any] = {"ok": report.ok, "checks": [asdict(c) for c in report.checks], "sizing": None}
    if report.sizing is not None:
        plan = report.sizing
        out["sizing"] = {"wanted_slots": plan.wanted, "slots": plan.slots, "zygote_mb": plan.zygote_mb,
                         "call_mb": plan.call_mb, "allowed_mb": plan.allowance.limit_mb,
                         "allowed_by": plan.allowance.source}
    return json.dumps(out, indent=2, ensure_ascii=False)


STYLES = {Level.ok: "green", Level.warn: "yellow", Level.fail: "bold red"}


def render(report: Report, console: Console) -> None:
    table = Table(title="codeenv doctor", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for check in report.checks:
        table.add_row(escape(check.name), f"[{STYLES[check.status]}]{check.status}[/]", escape(check.detail))
    console.print(table)
    failed = [c.name for c in report.checks if c.status == Level.fail]
    console.print(f"[bold red]missing:[/] {', '.join(failed)}" if failed else "[green]this host can run a worker[/]")
