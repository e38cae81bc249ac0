"""`codeenv doctor`, as a person runs it (a real process), on this host and on fake cgroup roots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from codeenv import SandboxSettings
from codeenv.doctor import Level, run_checks
from tests.conftest import jail_env

pytestmark = pytest.mark.jail


def doctor(*args: str) -> tuple[int, str, str]:
    done = subprocess.run([sys.executable, "-m", "codeenv.cli", "doctor", *args], capture_output=True, text=True,
                          env=jail_env(), timeout=120)
    return done.returncode, done.stdout, done.stderr


def by_name(report: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in report["checks"]}


def test_this_host_can_run_a_worker() -> None:
    code, out, err = doctor("--json")
    assert code == 0, out + err
    report = json.loads(out)
    checks = by_name(report)
    assert report["ok"] is True
    assert not [c for c in report["checks"] if c["status"] == "fail"]
    for name in ("root", "python", "namespace user", "namespace pid", "namespace net", "namespace mount",
                 "namespace uts", "namespace ipc", "namespace cgroup", "seccomp", "nsjail", "cgroup",
                 "cgroup memory", "cgroup pids", "sandbox image", "memory limit", "slot sizing", "swap",
                 "slot uids", "unprivileged bpf", "core dumps", "socket memory", "kernel log", "userfaultfd",
                 "io_uring", "x32 syscalls"):
        assert name in checks, name
    assert checks["cgroup"]["detail"].startswith("v1 at /sys/fs/cgroup")
    sizing = report["sizing"]
    assert sizing["zygote_mb"] == 208 and sizing["call_mb"] == SandboxSettings().caps.memory_mb
    assert checks["slot sizing"]["detail"].startswith(f"memory: {sizing['wanted_slots']} slots × (208 MB zygote")


def test_table_says_the_host_is_fine() -> None:
    code, out, _ = doctor("--slots", "1")
    assert code == 0 and "slot sizing" in out and "this host can run a worker" in out


def test_missing_memory_controller_fails(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("pids cpu\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    code, out, _ = doctor("--json", "--cgroup-root", str(tmp_path))
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert by_name(report)["cgroup"] == {
        "name": "cgroup", "status": "fail",
        "detail": f"cgroup v2: the memory controller is not available in {tmp_path} (cgroup.controllers lists: "
                  "pids cpu); give the container a cgroup with memory delegated (docker: --cgroupns=private, "
                  "systemd: Delegate=yes)"}
    code, out, _ = doctor("--cgroup-root", str(tmp_path))
    assert code == 1 and "missing: cgroup" in out


def test_no_cgroups_at_all_fails(tmp_path: Path) -> None:
    code, out, _ = doctor("--json", "--cgroup-root", str(tmp_path))
    assert code == 1
    assert by_name(json.loads(out))["cgroup"]["detail"].startswith(f"no cgroup file system at {tmp_path}")


def test_v2_plan_is_reported_not_carried_out(tmp_path: Path) -> None:
    """The doctor says which processes the worker would move, and moves none (run in-process)."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.procs").write_text(f"1\n{os.getpid()}\n")
    report = run_checks(SandboxSettings(cgroup_root=tmp_path))
    cgroup = next(c for c in report.checks if c.name == "cgroup")
    assert cgroup.status == Level.ok
    assert cgroup.detail == (f"v2 at {tmp_path}, offering cpu memory pids; the worker will move the 2 process(es) of "
                             f"{tmp_path} into codeenv-supervisor, then enable +memory +pids +cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cgroup.controllers", "cgroup.procs",
                                                          "cgroup.subtree_control"]


@pytest.mark.parametrize("abi, apart, level, says", [
    (7, True, Level.ok, "domain of its own"),
    (5, True, Level.warn, "forks are refused"),
    (0, False, Level.warn, "can signal each other"),
])
def test_the_doctor_says_whether_session_forks_are_kept_apart(
        monkeypatch: pytest.MonkeyPatch, abi: int, apart: bool, level: Level, says: str) -> None:
    from codeenv import doctor as module
    from codeenv.doctor import Report, check_landlock

    monkeypatch.setattr(module, "landlock_abi", lambda: abi)
    report = Report()
    check_landlock(report, SandboxSettings(session_forks_apart=apart))
    (check,) = report.checks
    assert (check.status, check.name) == (level, "session forks apart") and says in check.detail, check
