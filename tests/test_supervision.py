"""A zygote that dies or hangs, idle or busy, is replaced; a call is never silently run twice."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.sandbox.outside.calls import CallJail
from tests.conftest import RUNNING_THEN_SLEEP, wait_until_running

pytestmark = pytest.mark.jail


@pytest_asyncio.fixture(scope="module")
async def small_pool() -> AsyncIterator[SlotPool]:
    settings = SandboxSettings(slots=1, control_timeout_s=2, kill_grace_s=1)
    async with SlotPool(settings) as pool:
        yield pool


def light(pool: SlotPool) -> CallJail:
    return pool.slots[0].zygotes["light"]


async def call(pool: SlotPool, code: str, **limits: float) -> object:
    return await pool.run(ExecRequest(code=code, limits=limits, profile="light"), slot_index=0)


async def test_idle_zygote_killed_is_replaced(small_pool: SlotPool) -> None:
    before = small_pool.restarts
    old_pid = light(small_pool).zygote_pid
    os.kill(old_pid, signal.SIGKILL)
    r = await call(small_pool, "print('after')")
    assert r.status == "ok" and r.stdout == "after\n"  # type: ignore[attr-defined]
    assert small_pool.restarts == before + 1
    assert light(small_pool).zygote_pid != old_pid


async def test_busy_zygote_killed_reports_started(small_pool: SlotPool) -> None:
    before = small_pool.restarts
    task = asyncio.create_task(call(small_pool, RUNNING_THEN_SLEEP, wall_s=60))
    await wait_until_running(light(small_pool))
    os.kill(light(small_pool).zygote_pid, signal.SIGKILL)
    r = await asyncio.wait_for(task, 20)
    assert r.status == "internal_error" and r.started  # type: ignore[attr-defined]
    r = await call(small_pool, "print('after')")
    assert r.status == "ok"  # type: ignore[attr-defined]
    assert small_pool.restarts == before + 1


@pytest.mark.slow
async def test_hung_idle_zygote_is_redispatched_unstarted(small_pool: SlotPool) -> None:
    before = small_pool.restarts
    os.kill(light(small_pool).zygote_pid, signal.SIGSTOP)
    r = await call(small_pool, "print('ran once')", wall_s=2)
    assert r.status == "ok" and r.stdout == "ran once\n"  # type: ignore[attr-defined]
    assert small_pool.restarts >= before + 1


@pytest.mark.slow
async def test_hung_busy_zygote_hits_the_outside_watchdog(small_pool: SlotPool) -> None:
    before = small_pool.restarts
    task = asyncio.create_task(call(small_pool, "open('running', 'w').close()\nwhile True: pass", wall_s=1))
    await wait_until_running(light(small_pool))
    os.kill(light(small_pool).zygote_pid, signal.SIGSTOP)
    r = await asyncio.wait_for(task, 20)
    assert r.status == "timeout" and r.limit == "wall" and r.started  # type: ignore[attr-defined]
    assert "recycled" in (r.message or "")  # type: ignore[attr-defined]
    r = await call(small_pool, "print('after')")
    assert r.status == "ok"  # type: ignore[attr-defined]
    assert small_pool.restarts == before + 1
