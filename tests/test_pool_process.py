"""`serve --processes N`: the host's pool process is supervised. Killed under load, its calls are
answered at once (provably unstarted ones `overloaded`, `started: false`; the others
`internal_error`, `started: true`), it is restarted and the gateways reconnect; a pool process that
cannot start makes `serve` exit non-zero with the cause."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from codeenv.bench.services import Service
from tests.conftest import start_service
from tests.test_api import _gauge

pytestmark = [pytest.mark.jail, pytest.mark.slow]

WALL_S = 6.0


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (the supervisor restarts the pool from a thread)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _pool_process(serve_pid: int) -> int | None:
    for pid in _children(serve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pool" in argv and b"codeenv.cli" in argv:
            return pid
    return None


def _serve(log: Path, **env: str) -> Service:
    return start_service("serve", "--slots", "2", "--processes", "2", "--log-level", "warning",
                         "--log-format", "text", log=log, PATH=os.environ.get("PATH", "/usr/bin"), **env)


async def test_a_killed_pool_process_is_restarted_and_its_calls_answered(tmp_path: Path) -> None:
    service = _serve(tmp_path / "serve.log")
    url = service.url
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            await service.await_ready(90)
            pool_pid = _pool_process(service.pid)
            assert pool_pid is not None
            # Eight calls on two slots: two run, six wait for a slot when the pool process dies.
            clients = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(8)]
            body = {"code": "open('started', 'w').close()\nimport time\ntime.sleep(30)", "limits": {"wall_s": WALL_S}}
            sent = time.monotonic()
            calls = [asyncio.ensure_future(k.post("/v1/execute", json=body)) for k in clients]
            deadline = time.monotonic() + 30
            while _gauge((await c.get("/metrics")).text, "codeenv_free_slots") != 0:
                assert time.monotonic() < deadline, "the calls never took both slots"
                await asyncio.sleep(0.05)
            os.kill(pool_pid, signal.SIGKILL)
            replies = await asyncio.wait_for(asyncio.gather(*calls), WALL_S + 10)
            answered_s = time.monotonic() - sent
            await asyncio.gather(*(k.aclose() for k in clients))
            results: list[dict[str, Any]] = [r.json() for r in replies]
            started = [r for r in results if r["started"]]
            unstarted = [r for r in results if not r["started"]]
            assert all(r["status"] == "internal_error" and "may have run" in r["message"] for r in started), results
            assert all(r["status"] == "overloaded" and "did not run" in r["message"] for r in unstarted), results
            assert len(started) == 2 and len(unstarted) == 6, results
            assert answered_s < WALL_S + 10
            # A new pool process comes up and the gateways reconnect to it.
            deadline = time.monotonic() + 30
            while True:
                r = await c.post("/v1/execute", json={"code": "print('back')"})
                if r.status_code == 200 and r.json()["status"] == "ok":
                    break
                assert time.monotonic() < deadline, f"no call succeeded within 30 s of the kill: {r.text}"
                await asyncio.sleep(0.2)
            new_pid = _pool_process(service.pid)
            assert new_pid is not None and new_pid != pool_pid
    finally:
        status = await service.stop_async(90)
    err = service.log_tail(10**9)
    assert status in (0, -15), err[-3000:]
    assert "the pool process exited with status -9" in err


async def test_serve_exits_non_zero_when_its_pool_process_cannot_start(tmp_path: Path) -> None:
    # The pool process's zygotes cannot start in time; serve itself (which starts none) can.
    service = _serve(tmp_path / "serve.log", CODEENV_ZYGOTE_START_TIMEOUT_S="0.001")
    try:
        status = await asyncio.to_thread(service.wait, 120)
    finally:
        service.kill()
    text = service.log_tail(10**9)
    assert status == 2, text[-3000:]
    assert "giving up" in text and "did not start" in text, text[-3000:]
