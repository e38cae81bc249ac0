"""Fixtures: a real slot pool (real nsjail, real cgroups) shared by the whole session."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from codeenv import ExecRequest, ExecResult, SandboxSettings, SlotPool
from codeenv.sandbox.zygote_proc import ZygoteProcess

SLOTS = 2


def pytest_configure(config: pytest.Config) -> None:
    if os.geteuid() != 0:
        raise pytest.UsageError("codeenv's tests run real nsjail jails with cgroups: run them as root")


class Runner:
    """Runs calls on a shared pool, optionally pinned to one slot."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool

    async def __call__(self, code: str, *, stdin: str = "", slot: int | None = None,
                       profile: str | None = None, **limits: Any) -> ExecResult:
        request = ExecRequest(code=code, stdin=stdin, limits=limits, profile=profile)
        return await self.pool.run(request, slot_index=slot)

    async def healthy_after(self, slot: int, profile: str | None = None) -> ExecResult:
        """The next call on `slot` succeeds."""
        result = await self("print('still fine')", slot=slot, profile=profile)
        assert result.status == "ok", result
        assert result.stdout == "still fine\n"
        return result


#: A call that announces it is running by creating a file, then sleeps.
RUNNING_THEN_SLEEP = "open('running', 'w').close()\nimport time\ntime.sleep(60)"


async def wait_until_running(zygote: ZygoteProcess) -> None:
    """Until the call started with RUNNING_THEN_SLEEP has created its file (seen from outside)."""
    for _ in range(4000):
        if zygote._workdir_usage() != zygote.baseline_workdir:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the call never started")


@pytest_asyncio.fixture(scope="session")
async def pool() -> AsyncIterator[SlotPool]:
    async with SlotPool(SandboxSettings(slots=SLOTS)) as p:
        yield p


@pytest.fixture
def run(pool: SlotPool) -> Runner:
    return Runner(pool)
