"""Sessions never take what the rest of the service needs (issue 31): an idle session costs the worker
O(1) fds, `sessions_max` is held to what the host allows (a setting that does not fit is refused at
start), past the budget or a client's quota a new session is 429 with Retry-After, and stateless
calls and /v1/judge still run with the budget full."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.api import create_app
from codeenv.errors import SandboxError
from codeenv.models import SESSION_KEY_HEADER, ExecResult, Limits
from codeenv.queue.embedded import from_settings
from codeenv.sandbox.budget import FDS_PER_FAMILY, session_budget
from codeenv.settings import GatewaySettings
from tests.conftest import serving


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.unit
def test_the_budget_names_what_bounds_it() -> None:
    settings = SandboxSettings(slots=2)
    host = {"nofile": 20_000, "memory_bytes": 24 << 30, "pid_max": 32_768, "memory_cgroups": 400,
            "sigpending": 96_362}
    budget = session_budget(settings, jails=6, connections=2048, cells_at_once=8, **host)
    assert budget.sessions == 96_362 // 2 // 64 - 6 and budget.binding.startswith("host root's queued signals")
    few_fds = session_budget(settings, jails=6, **{**host, "nofile": 4096})
    assert few_fds.binding == "open files (RLIMIT_NOFILE)" and few_fds.sessions < 500
    crowded = session_budget(settings, jails=6, **{**host, "memory_cgroups": 65_000})
    assert crowded.sessions == 0 and crowded.binding == "memory cgroup ids"


@pytest.mark.jail
async def test_an_idle_session_holds_o1_fds_in_the_worker(pool: SlotPool) -> None:
    m = pool.sessions
    assert m is not None
    first = await m.create("light")  # the session jail and the spare family exist from here
    await pool.run(ExecRequest(code="x = 1", session=first.id))
    before, sessions = open_fds(), []
    try:
        for _ in range(6):
            s = await m.create("light")
            sessions.append(s)
            r = await pool.run(ExecRequest(code="import os\nx = os.getpid()", session=s.id))
            assert r.status == "ok", r
        fork = await m.fork(sessions[0].id)  # a fork lives in its family: no fd of its own
        assert (await pool.run(ExecRequest(code="x", session=fork.id))).status == "ok"
        per_session = (open_fds() - before) / len(sessions)
        assert per_session <= FDS_PER_FAMILY, per_session
    finally:
        for s in [first, *sessions]:
            if s.id in m.sessions:
                await m.delete(s.id)


@pytest.mark.jail
async def test_a_sessions_max_that_does_not_fit_is_refused_at_start() -> None:
    with pytest.raises(SandboxError, match="CODEENV_SESSIONS_MAX=50000 does not fit this host") as refused:
        async with SlotPool(SandboxSettings(slots=1, sessions_max=50_000)):
            pass
    assert "\n" not in str(refused.value)
    # Left at its default, it is lowered to what fits instead.
    budget = session_budget(SandboxSettings(), jails=2 * 4)
    assert 0 < budget.sessions


@pytest.mark.jail
async def test_a_full_budget_is_429_and_leaves_calls_and_the_judge_running() -> None:
    settings = GatewaySettings(slots=1, sessions_max=3, session_client_max=2, session_spares=False)
    alice, bob = ({SESSION_KEY_HEADER: f"{name}-key-of-this-test-0123"} for name in ("alice", "bob"))
    async with serving(create_app(settings, from_settings(settings))) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as c:
        made = [await c.post("/v1/sessions", json={"profile": "light"}, headers=alice) for _ in range(2)]
        assert [r.status_code for r in made] == [201, 201]
        quota = await c.post("/v1/sessions", json={"profile": "light"}, headers=alice)
        assert quota.status_code == 429 and quota.headers["retry-after"] and "one client" in quota.text
        fork = await c.post(f"/v1/sessions/{made[0].json()['session_id']}/fork", headers=alice)
        assert fork.status_code == 429 and "one client" in fork.text
        assert (await c.post("/v1/sessions", json={"profile": "light"}, headers=bob)).status_code == 201
        full = await c.post("/v1/sessions", json={"profile": "light"}, headers=bob)
        assert full.status_code == 429 and full.headers["retry-after"] and "its most" in full.text
        # Stateless calls and the judge are unharmed.
        one = await c.post("/v1/execute", json={"code": "print(6 * 7)"})
        assert one.status_code == 200 and one.json()["stdout"] == "42\n", one.text
        judged = await c.post("/v1/judge", json={"code": "print(int(input()) * 2)",
                                                 "tests": [{"stdin": "21", "expected_stdout": "42"}]})
        assert judged.status_code == 200 and judged.json()["status"] == "passed", judged.text
        # Ending one of alice's makes room for her again.
        assert (await c.delete(f"/v1/sessions/{made[1].json()['session_id']}", headers=alice)).status_code == 204
        assert (await c.post("/v1/sessions", json={"profile": "light"}, headers=alice)).status_code == 201


@pytest.mark.jail
async def test_running_cells_take_at_most_their_share_of_the_cpus_and_are_sure_of_it(pool: SlotPool) -> None:
    """Four cells burn CPU for 2 s alone, then beside two calls burning CPU on both slots: alone, the
    cells together never take more than session_cpu_share (half) of the host's CPUs; beside the
    busy slots they still get about that share (their group's weight; the default weight gave them
    a third, one group against two)."""
    m = pool.sessions
    assert m is not None
    cap_cpus = pool.settings.session_cpu_share * len(os.sched_getaffinity(0))
    sessions = [await m.create("light") for _ in range(4)]
    families = m._families_group()  # made with the first family; counts every cell's CPU
    limits = Limits(wall_s=30, cpu_s=30)

    async def burn(seconds: float, calls: int) -> tuple[float, float, list[ExecResult]]:
        """(the cells' CPU seconds, the wall seconds, the results), cells first."""
        code = f"import time\nwhile time.time() < {time.time() + seconds}:\n    pass\n"
        before, t0 = families.cpu_usage_ns() or 0, time.monotonic()
        results = await asyncio.gather(
            *(pool.run(ExecRequest(code=code, session=s.id, limits=limits)) for s in sessions),
            *(pool.run(ExecRequest(code=code, profile="light", limits=limits)) for _ in range(calls)))
        assert [r.status for r in results] == ["ok"] * len(results), results
        return ((families.cpu_usage_ns() or 0) - before) / 1e9, time.monotonic() - t0, results

    try:
        alone_s, window_s, _ = await burn(2.0, calls=0)
        assert alone_s <= cap_cpus * window_s * 1.1 + 0.2, (alone_s, cap_cpus, window_s)
        beside_s, _, results = await burn(3.0, calls=2)
        calls_s = sum(r.cpu_s for r in results[len(sessions):])
        assert beside_s >= 0.7 * calls_s, (beside_s, calls_s)
    finally:
        for s in sessions:
            await m.delete(s.id)
