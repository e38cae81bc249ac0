"""Nothing is left behind (issue 31): whatever way a worker ended, SIGKILL included, the next start
removes every cgroup of it at any depth (codeenv-PID-N/families/familyK/main, ...), kills every
process in them, and removes its runtime files; its uid block is free again."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.models import SESSION_KEY_HEADER
from codeenv.sandbox.cgroups import CgroupLayout, owner_alive, remove_tree
from codeenv.sandbox.uids import uids_in_use
from tests.conftest import start_service

KEY = {SESSION_KEY_HEADER: "the-key-of-the-killed-worker-client"}


def groups_of(pid: int, settings: SandboxSettings) -> list[Path]:
    """Every cgroup (any depth, every hierarchy) of the worker `pid`'s pools."""
    layout = CgroupLayout.detect(settings.cgroup_root)
    hierarchies = ["memory", "pids", "cpu", "cpuacct"] if layout.version == 1 else [""]
    found = []
    for hierarchy in hierarchies:
        if hierarchy not in layout.own:
            continue
        for top in layout.own_dir(hierarchy).glob(f"codeenv-{pid}-*"):
            found += [Path(d) for d, _, _ in os.walk(top)]
    return found


def processes_in(groups: list[Path]) -> set[int]:
    pids: set[int] = set()
    for group in groups:
        try:
            pids.update(int(p) for p in (group / "cgroup.procs").read_text().split())
        except OSError:
            pass
    return pids


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for init to reap it does not)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text(errors="replace")
    except OSError:
        return False


@pytest.mark.jail
@pytest.mark.slow
async def test_a_sigkilled_worker_with_sessions_and_forks_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    settings = SandboxSettings()
    service = start_service("serve", "--slots", "1", "--log-level", "warning", log=tmp_path / "serve.log")
    try:
        await service.await_ready()
        async with httpx.AsyncClient(base_url=service.url, headers=KEY, timeout=60) as c:
            for _ in range(2):
                made = await c.post("/v1/sessions", json={"profile": "light"})
                assert made.status_code == 201, made.text
                sid = made.json()["session_id"]
                ran = await c.post(f"/v1/sessions/{sid}/execute", json={"code": "import os\nx = os.getpid()"})
                assert ran.json()["status"] == "ok", ran.text
                forked = await c.post(f"/v1/sessions/{sid}/fork")
                assert forked.status_code == 201, forked.text
            # A call runs while it dies too.
            assert (await c.post("/v1/execute", json={"code": "print(1)"})).json()["stdout"] == "1\n"
        groups = groups_of(service.pid, settings)
        deepest = max(len(g.parts) for g in groups)
        assert any(g.name == "main" and g.parent.name.startswith("family") for g in groups), groups
        left_running = processes_in(groups)
        assert left_running
        their_uids = {os.stat(f"/proc/{p}").st_uid for p in left_running} - {0}
        runtime = list(settings.runtime_dir.glob(f"codeenv-{service.pid}-*"))
        assert runtime
    finally:
        os.kill(service.pid, signal.SIGKILL)
        service.kill()
    dead = service.pid
    assert groups_of(dead, settings) == groups  # SIGKILL cleaned nothing up (nsjail ends some jails with it)
    async with SlotPool(SandboxSettings(slots=1)) as next_pool:  # the next start reaps it all
        assert groups_of(dead, settings) == [], f"cgroups of worker {dead} remain (up to depth {deepest})"
        # Killed by the reaper; init reaps them a moment later (a zombie still shows in /proc).
        for _ in range(500):
            remaining = [p for p in left_running if alive(p)]
            if not remaining:
                break
            await asyncio.sleep(0.01)
        assert not remaining, "processes of the dead worker remain"
        assert not [d for d in runtime if d.exists()], "runtime files of the dead worker remain"
        assert (await next_pool.run(ExecRequest(code="print('next')"))).stdout == "next\n"
    assert their_uids and not set(uids_in_use()) & their_uids, "processes run under the dead worker's uids"


@pytest.mark.unit
def test_a_reused_pid_is_no_live_owner(tmp_path: Path) -> None:
    made = tmp_path / "codeenv-1-0"
    made.mkdir()
    assert owner_alive(os.getpid(), made)  # this process started before the directory was made
    assert not owner_alive(2**22 + 1, made)  # no such process (above any pid_max)


@pytest.mark.unit
def test_remove_tree_removes_every_depth(tmp_path: Path) -> None:
    deep = tmp_path / "codeenv-1-0" / "families" / "family3" / "main"
    deep.mkdir(parents=True)
    (tmp_path / "codeenv-1-0" / "slot0-light").mkdir()
    assert remove_tree(tmp_path / "codeenv-1-0") == 0
    assert not (tmp_path / "codeenv-1-0").exists()
