"""The worker's cgroups and its memory sizing.

This host runs cgroup v1, so v1 is also tested for real; v2 is tested against a directory laid out
like a delegated v2 hierarchy. Plain files do not behave like cgroupfs (a write to cgroup.procs
moves nothing, subtree_control never refuses), so FakeCgroupFs stands in for the kernel's rules the
code depends on: a pid written to a group's cgroup.procs leaves every other group; a group that holds
processes cannot enable controllers for its children (EBUSY, "no internal processes"); a controller
its own cgroup.controllers does not list cannot be enabled; a new group is offered what its parent
enabled.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.errors import SandboxError
from codeenv.sandbox.cgroups import SUPERVISOR_LEAF, CgroupFs, CgroupLayout, CgroupTree, V2Cgroup
from codeenv.sandbox.image import find_spec
from codeenv.sandbox.sizing import (
    MemoryAllowance,
    apply_plan,
    cgroup_memory_limit,
    estimate_zygote_mb,
    memory_allowance,
    plan_slots,
)
from tests.conftest import jail_env

V2_ALL = "cpuset cpu io memory pids"


class FakeCgroupFs(CgroupFs):
    """cgroupfs's rules over a plain directory (see the module docstring).

    `arrivals`: pids that appear in a group just before each write to its subtree_control (a
    `docker exec` racing the worker); one list per write, consumed in order.
    """

    def __init__(self, root: Path, arrivals: list[list[str]] | None = None, refuse: set[str] | None = None) -> None:
        self.root = root
        self.arrivals = arrivals or []
        self.refuse = refuse or set()  # controllers the kernel refuses to enable (EINVAL)
        self.moves: list[tuple[str, Path]] = []

    def write(self, path: Path, text: str) -> None:
        if path.name == "cgroup.procs":
            pid = text.strip()
            for procs in self.root.rglob("cgroup.procs"):
                procs.write_text("".join(f"{p}\n" for p in procs.read_text().split() if p != pid))
            path.write_text(path.read_text() + f"{pid}\n")
            self.moves.append((pid, path.parent))
        elif path.name == "cgroup.subtree_control":
            group = path.parent
            if self.arrivals:
                procs = group / "cgroup.procs"
                procs.write_text(procs.read_text() + "".join(f"{p}\n" for p in self.arrivals.pop(0)))
            if (group / "cgroup.procs").read_text().split():
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
            available = (group / "cgroup.controllers").read_text().split()
            enabled = path.read_text().split()
            for token in text.split():
                controller = token[1:]
                if controller not in available:
                    raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
                if controller in self.refuse:
                    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
                if token[0] == "+" and controller not in enabled:
                    enabled.append(controller)
                elif token[0] == "-" and controller in enabled:
                    enabled.remove(controller)
            path.write_text(" ".join(enabled))
        else:
            path.write_text(text)

    def mkdir(self, path: Path) -> None:
        path.mkdir(exist_ok=True)
        for name in ("cgroup.procs", "cgroup.subtree_control"):
            if not (path / name).exists():
                (path / name).write_text("")
        (path / "cgroup.controllers").write_text((path.parent / "cgroup.subtree_control").read_text())


def v2_root(tmp_path: Path, controllers: str = V2_ALL, procs: tuple[int, ...] = (1, 57),
            enabled: str = "") -> Path:
    """A container's cgroup namespace root: `controllers` offered, `procs` inside it."""
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    (tmp_path / "cgroup.subtree_control").write_text(enabled)
    (tmp_path / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    return tmp_path


def v2_layout(root: Path, own: str = "/") -> CgroupLayout:
    return CgroupLayout.detect(root, proc_cgroup=f"0::{own}\n")


# --- v2 -----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_v2_moves_every_process_into_a_leaf_then_enables_controllers(tmp_path: Path) -> None:
    root = v2_root(tmp_path, procs=(1, 57, os.getpid()))
    fs = FakeCgroupFs(root)
    tree = CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=fs)
    leaf = root / SUPERVISOR_LEAF
    assert tree.version == 2 and tree.bases == {"unified": root / "codeenv-42-0"}
    assert sorted((leaf / "cgroup.procs").read_text().split()) == sorted(["1", "57", str(os.getpid())])
    assert (root / "cgroup.procs").read_text() == ""
    assert (root / "cgroup.subtree_control").read_text().split() == ["memory", "pids", "cpu"]
    # ... and again one level down, so that every jail's group gets the controllers.
    base = root / "codeenv-42-0"
    assert (base / "cgroup.controllers").read_text().split() == ["memory", "pids", "cpu"]
    assert (base / "cgroup.subtree_control").read_text().split() == ["memory", "pids", "cpu"]
    tree.remove()
    # A second pool of the same worker sits in the leaf now: it manages the same cgroup, moves nothing.
    fs.moves.clear()
    tree = CgroupTree.create(layout=v2_layout(root, f"/{SUPERVISOR_LEAF}"), tag="codeenv-42-1", fs=fs)
    assert tree.bases == {"unified": root / "codeenv-42-1"} and fs.moves == []


@pytest.mark.unit
def test_v2_already_delegated_moves_nothing(tmp_path: Path) -> None:
    """A cgroup whose controllers are enabled already (say, by a worker before this one)."""
    root = v2_root(tmp_path, enabled="memory pids cpu", procs=())
    fs = FakeCgroupFs(root)
    CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=fs)
    assert fs.moves == [] and not (root / SUPERVISOR_LEAF).exists()


@pytest.mark.unit
def test_v2_processes_arriving_during_the_move_are_moved_too(tmp_path: Path) -> None:
    root = v2_root(tmp_path, procs=(1,))
    fs = FakeCgroupFs(root, arrivals=[[], ["99"]])  # 99 lands after the first move, before the write
    CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=fs)
    assert sorted((root / SUPERVISOR_LEAF / "cgroup.procs").read_text().split()) == ["1", "99"]
    assert "memory" in (root / "cgroup.subtree_control").read_text().split()


@pytest.mark.unit
def test_v2_gives_up_when_processes_keep_arriving(tmp_path: Path) -> None:
    root = v2_root(tmp_path, procs=(1,))
    fs = FakeCgroupFs(root, arrivals=[[str(100 + i)] for i in range(10)])
    with pytest.raises(SandboxError, match="processes keep arriving"):
        CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=fs)


@pytest.mark.unit
@pytest.mark.parametrize(("controllers", "missing"), [("pids cpu", "memory"), ("cpu io memory", "pids")])
def test_v2_without_memory_or_pids_is_refused(tmp_path: Path, controllers: str, missing: str) -> None:
    root = v2_root(tmp_path, controllers=controllers)
    with pytest.raises(SandboxError) as caught:
        CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=FakeCgroupFs(root))
    assert str(caught.value) == (
        f"cgroup v2: the {missing} controller is not available in {root} (cgroup.controllers lists: "
        f"{controllers}); give the container a cgroup with {missing} delegated "
        "(docker: --cgroupns=private, systemd: Delegate=yes)")
    assert not (root / SUPERVISOR_LEAF).exists()  # refused before touching anything


@pytest.mark.unit
def test_v2_cpu_is_optional(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = v2_root(tmp_path, controllers="memory pids")
    CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=FakeCgroupFs(root))
    assert (root / "codeenv-42-0" / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]
    other = tmp_path / "other"
    other.mkdir()
    root = v2_root(other)
    with caplog.at_level(logging.WARNING):
        CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=FakeCgroupFs(root, refuse={"cpu"}))
    assert (root / "codeenv-42-0" / "cgroup.subtree_control").read_text().split() == ["memory", "pids"]
    assert "calls run without a cpu cap" in caplog.text


@pytest.mark.unit
def test_v2_subtree_control_not_writable_is_refused(tmp_path: Path) -> None:
    root = v2_root(tmp_path)

    class ReadOnly(FakeCgroupFs):
        def write(self, path: Path, text: str) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with pytest.raises(SandboxError, match=r"cannot enable \+memory \+pids in .*Read-only file system"):
        CgroupTree.create(layout=v2_layout(root), tag="codeenv-42-0", fs=ReadOnly(root))


@pytest.mark.unit
def test_v2_jail_group_files(tmp_path: Path) -> None:
    """A jail's group reads and writes the v2 files (through the hot path's cached fds)."""
    path = tmp_path / "slot0-light"
    group = V2Cgroup("slot0-light", path)
    for f in ("memory.max", "memory.swap.max", "pids.max", "cpu.max"):
        (path / f).write_text("")
    group.set_memory_limit(256 << 20)
    group.set_pids_max(70)
    group.set_cpu_limit(1.5)
    assert (path / "memory.max").read_text() == str(256 << 20)
    assert (path / "pids.max").read_text() == "70"
    assert (path / "cpu.max").read_text() == "150000 100000"
    assert group.procs_files() == [path / "cgroup.procs"]
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (path / "pids.events").write_text("max 2\n")
    (path / "memory.current").write_text("1234\n")
    assert (group.oom_kills(), group.pids_limit_hits(), group.memory_usage()) == (1, 2, 1234)


# --- v1 -----------------------------------------------------------------------------------------


def v1_root(tmp_path: Path, hierarchies: tuple[str, ...] = ("memory", "pids", "cpu")) -> Path:
    for name in hierarchies:
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup.procs").write_text("")
    if "memory" in hierarchies:
        (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return tmp_path


V1_SELF = "8:pids:/\n4:memory:/\n1:cpu:/\n"


@pytest.mark.unit
@pytest.mark.parametrize(("present", "missing"), [(("memory", "cpu"), "pids"), (("pids", "cpu"), "memory")])
def test_v1_without_memory_or_pids_is_refused(tmp_path: Path, present: tuple[str, ...], missing: str) -> None:
    root = v1_root(tmp_path, present)
    with pytest.raises(SandboxError) as caught:
        CgroupLayout.detect(root, proc_cgroup=V1_SELF)
    assert str(caught.value) == (
        f"cgroup v1: the {missing} hierarchy is not mounted at {root / missing} "
        f"(mounted: {' '.join(sorted(present))}); "
        f"jails need memory and pids caps: mount it (mount -t cgroup -o {missing} cgroup {root / missing})")


@pytest.mark.unit
def test_no_cgroup_file_system_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="no cgroup file system at"):
        CgroupLayout.detect(tmp_path, proc_cgroup=V1_SELF)


@pytest.mark.unit
def test_v1_not_writable_is_refused(tmp_path: Path) -> None:
    root = v1_root(tmp_path)

    class ReadOnly(CgroupFs):
        def mkdir(self, path: Path) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    layout = CgroupLayout.detect(root, proc_cgroup=V1_SELF)
    with pytest.raises(SandboxError) as caught:
        CgroupTree.create(layout=layout, tag="codeenv-42-0", fs=ReadOnly())
    assert str(caught.value) == (
        f"cgroup v1: cannot create {root / 'memory' / 'codeenv-42-0'} in the memory hierarchy ([Errno 30] "
        "Read-only file system); the worker needs its own memory cgroup writable "
        "(docker: --privileged, or /sys/fs/cgroup mounted read-write)")


@pytest.mark.unit
def test_v1_private_view_uses_the_mount_root(tmp_path: Path) -> None:
    """A container without a cgroup namespace: /proc/self/cgroup names a host path the mount lacks."""
    root = v1_root(tmp_path)
    (root / "memory" / "cgroup.procs").write_text(f"1\n{os.getpid()}\n")
    layout = CgroupLayout.detect(root, proc_cgroup="8:pids:/\n4:memory:/docker/abc\n")
    assert layout.own_dir("memory") == root / "memory"
    assert layout.own_dir("pids") == root / "pids"


@pytest.mark.jail
def test_v1_on_this_host() -> None:
    """The real hierarchy: the subtree is made in memory, pids (and cpu) and removed again."""
    tree = CgroupTree.create(tag=f"codeenv-{os.getpid()}-test")
    try:
        assert tree.version == 1 and tree.layout is not None
        assert {"memory", "pids"} <= set(tree.bases) and all(b.is_dir() for b in tree.bases.values())
        group = tree.group("slot0-test")
        group.set_memory_limit(64 << 20)
        group.set_pids_max(8)
        assert group.memory_usage() == 0 and group.pids_current() == 0
        group.remove()
    finally:
        tree.remove()
    assert not any(b.exists() for b in tree.bases.values())


# --- sizing ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_memory_limit_v1_walks_up_to_the_lowest_limit(tmp_path: Path) -> None:
    root = v1_root(tmp_path)
    for sub, limit in (("a", 4 << 30), ("a/b", 9223372036854771712)):
        (root / "memory" / sub).mkdir()
        (root / "memory" / sub / "memory.limit_in_bytes").write_text(f"{limit}\n")
    layout = CgroupLayout.detect(root, proc_cgroup="8:pids:/\n4:memory:/a/b\n")
    assert cgroup_memory_limit(layout) == (4 << 30, root / "memory" / "a")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    expected = MemoryAllowance(4096, "this worker's cgroup allows", root / "memory" / "a")
    assert memory_allowance(layout, meminfo) == expected
    meminfo.write_text("MemTotal:       2048000 kB\n")  # the host is smaller than the limit
    assert memory_allowance(layout, meminfo) == MemoryAllowance(2000, "of this host's memory (MemTotal)")


@pytest.mark.unit
def test_memory_limit_v2_reads_memory_max_up_from_the_supervisor_leaf(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    (root / "svc").mkdir()
    (root / "svc" / "memory.max").write_text(f"{3 << 30}\n")
    (root / "svc" / "app").mkdir()
    (root / "svc" / "app" / "memory.max").write_text("max\n")
    (root / "svc" / "app" / SUPERVISOR_LEAF).mkdir()
    layout = v2_layout(root, f"/svc/app/{SUPERVISOR_LEAF}")
    assert layout.delegated_dir() == root / "svc" / "app"
    assert cgroup_memory_limit(layout) == (3 << 30, root / "svc")
    (root / "svc" / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(layout) is None


CGROUP = Path("/sys/fs/cgroup/memory/worker")  # where a limit binds (the sizing only names it)


def settings(slots: int, call_mb: int, zygote_mb: int | None = None, **kw: object) -> SandboxSettings:
    return SandboxSettings(slots=slots, zygote_memory_mb=zygote_mb,
                           caps={"memory_mb": call_mb},  # type: ignore[arg-type]
                           defaults={"memory_mb": min(call_mb, 1024)}, **kw)  # type: ignore[arg-type]


@pytest.mark.unit
def test_sizing_lowers_the_slot_count_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    spec, _ = find_spec("python-math")
    allowance = MemoryAllowance(3000, "this worker's cgroup allows", CGROUP)
    plan = plan_slots(settings(4, 1000, 200), spec, allowance)
    assert (plan.slots, plan.needed_mb) == (2, 4800)
    with caplog.at_level(logging.WARNING):
        assert apply_plan(plan) == 2
    assert caplog.messages == [
        "memory: 4 slots × (200 MB zygote + 1000 MB per call) = 4800 MB exceeds the 3000 MB this worker's "
        "cgroup allows; running 2 slots"]
    caplog.clear()
    assert apply_plan(plan_slots(settings(2, 1000, 200), spec, allowance)) == 2  # 2400 MB fits: quiet
    assert caplog.messages == []
    plan = plan_slots(settings(4, 1000, 200), spec,
                      MemoryAllowance(1500, "this worker's cgroup allows", CGROUP))
    assert plan.describe().endswith("running 1 slot")


@pytest.mark.unit
def test_sizing_refuses_when_not_one_slot_fits() -> None:
    spec, _ = find_spec("python-math")
    plan = plan_slots(settings(2, 4096, 200), spec, MemoryAllowance(4000, "this worker's cgroup allows", CGROUP))
    with pytest.raises(SandboxError) as caught:
        apply_plan(plan)
    assert str(caught.value) == (
        "memory: one slot needs 200 MB zygote + 4096 MB per call = 4296 MB, more than the 4000 MB this worker's "
        "cgroup allows; lower caps.memory_mb (CODEENV_CAPS__MEMORY_MB) or give the worker more memory")


@pytest.mark.unit
def test_zygote_estimate_per_image() -> None:
    spec, _ = find_spec("python-math")
    assert estimate_zygote_mb(spec) == 16 + 96 + 96  # light, math, scientific
    plan = plan_slots(settings(1, 1024), spec, MemoryAllowance(10_000, "x"))
    assert plan.zygote_mb == 208


@pytest.mark.unit
def test_host_memory_alone_warns_but_keeps_the_slots(caplog: pytest.LogCaptureFixture) -> None:
    """Without a cgroup limit the worst case is only warned about: the global OOM killer takes the
    largest process, a call, and cutting a big node's slots would cost its throughput."""
    spec, _ = find_spec("python-math")
    plan = plan_slots(settings(4, 1000, 200), spec, MemoryAllowance(3000, "of this host's memory (MemTotal)"))
    assert plan.slots == 4 and plan.over_host_memory
    with caplog.at_level(logging.WARNING):
        assert apply_plan(plan) == 4
    assert "exceeds the 3000 MB of this host's memory (MemTotal): if every slot ran" in caplog.text
    plan = plan_slots(settings(4, 4000, 200), spec, MemoryAllowance(3000, "of this host's memory (MemTotal)"))
    assert plan.slots == 0  # not even one call of the largest size fits the host: refused


@pytest.fixture
def cgroup_limited(monkeypatch: pytest.MonkeyPatch) -> MemoryAllowance:
    """The pool sees a cgroup limit of the host's size (this host's own cgroup has none)."""
    host = memory_allowance(CgroupLayout.detect())
    limited = MemoryAllowance(host.limit_mb, "this worker's cgroup allows", Path("/sys/fs/cgroup/memory"))
    monkeypatch.setattr("codeenv.sandbox.pool.memory_allowance", lambda layout: limited)
    return limited


@pytest.mark.jail
async def test_pool_runs_the_slots_that_fit(caplog: pytest.LogCaptureFixture,
                                            cgroup_limited: MemoryAllowance) -> None:
    """A real pool asked for 2 slots where its cgroup's memory holds 1 of them starts 1, and says so."""
    allowance = cgroup_limited
    call_mb = allowance.limit_mb * 3 // 4 - 208
    pool = SlotPool(settings(2, call_mb))
    with caplog.at_level(logging.WARNING):
        async with pool:
            assert len(pool.slots) == 1
            result = await pool.run(ExecRequest(code="print(1)"))
            assert result.status == "ok"
    assert f"exceeds the {allowance.limit_mb} MB" in caplog.text and "running 1 slot" in caplog.text


@pytest.mark.jail
async def test_pool_refuses_when_not_one_slot_fits() -> None:
    allowance = memory_allowance(CgroupLayout.detect())
    pool = SlotPool(settings(1, allowance.limit_mb + 1))
    with pytest.raises(SandboxError, match="memory: one slot needs"):
        await pool.start()
    assert pool.slots == []


@pytest.mark.jail
def test_serve_refuses_before_binding_when_not_one_slot_fits() -> None:
    env = jail_env(CODEENV_CAPS__MEMORY_MB=str(10**7))
    done = subprocess.run([sys.executable, "-m", "codeenv.cli", "serve", "--port", "1"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "error: memory: one slot needs" in " ".join(done.stderr.split()) and "Traceback" not in done.stderr


@pytest.mark.jail
async def test_pool_warns_when_zygotes_are_heavier_than_estimated(caplog: pytest.LogCaptureFixture,
                                                                 cgroup_limited: MemoryAllowance) -> None:
    """An estimate of 1 MB lets a slot with a call cap of all but 50 MB start; the zygotes it then
    measures (python-math: about 170 MB a slot) no longer fit, and it says what to set."""
    allowance = cgroup_limited
    pool = SlotPool(settings(1, allowance.limit_mb - 50, 1))
    with caplog.at_level(logging.WARNING):
        async with pool:
            measured_mb = sum(z.baseline_memory for z in pool.slots[0].zygotes.values()) >> 20
            assert 100 < measured_mb < 208, measured_mb  # the estimate for python-math stays above it
    assert f"memory: a slot's zygotes take {measured_mb} MB, not the 1 MB estimated" in caplog.text
    assert f"set CODEENV_ZYGOTE_MEMORY_MB={measured_mb}" in caplog.text
