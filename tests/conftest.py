"""Fixtures: a real slot pool (real nsjail, real cgroups) shared by the whole session."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import pytest_asyncio
import redis
import uvicorn

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


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Until `condition()` holds (a state seen from outside that offers no event to wait on),
    polled every 10 ms; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # noqa: ASYNC110 (what it polls offers no event)
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        await asyncio.sleep(0.01)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private redis-server on a free port (never the machine's own), stopped by PID."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise pytest.UsageError("the Redis tests need redis-server (scripts/test installs it)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        try:
            for _ in range(200):
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.025)
            raise RuntimeError("redis-server did not start")
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 90) -> None:
    """Until the service behind `client` answers /readyz with 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await client.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{client.base_url} did not become ready within {timeout_s:g}s")


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """A real uvicorn server for `app` in this event loop (so it can share the session's pool)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        await task
