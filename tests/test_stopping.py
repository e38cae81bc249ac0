"""Stopping `codeenv serve` while calls run, as a person (Ctrl-C) or a supervisor (SIGTERM) does, in
each deployment: every call is answered (running ones finish, or are stopped and answered `killed`,
within the grace period; those not started are `overloaded` with started: false), the process exits
within the grace period, and nothing prints a traceback."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from codeenv.bench.services import Service
from tests.conftest import start_service

pytestmark = [pytest.mark.jail, pytest.mark.slow]

GRACE_S = 6.0
#: Two slots: two calls run, two wait. Whichever two the slots take first, none ends before the stop has
#: reached the slots (so the two waiting are never started), and each but the 30 s one ends within the
#: grace period.
SLEEPS = (3, 30, 3, 3)


async def call(c: httpx.AsyncClient, seconds: float) -> dict[str, Any]:
    r = await c.post("/v1/execute", json={"code": f"import time\ntime.sleep({seconds})\nprint('done')",
                                          "limits": {"wall_s": 60, "cpu_s": 60}})
    assert r.headers["content-type"].startswith("application/json"), r.text  # never uvicorn's plain-text 500
    body: dict[str, Any] = r.json()
    return body


def _gauge(metrics: str, name: str) -> float:
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))


async def stop_under_load(service: Service, sig: int, second: bool = False,
                          slots_gauge: bool = True) -> list[dict[str, Any]]:
    service.wait_ready()
    async with httpx.AsyncClient(base_url=service.url, timeout=60) as c:
        calls = [asyncio.create_task(call(c, s)) for s in SLEEPS]
        deadline = time.monotonic() + 30
        # Two calls hold the slots and two wait (with Redis the gauges are the workers' last heartbeat).
        while slots_gauge and not (_gauge(text := (await c.get("/metrics")).text, "codeenv_free_slots") == 0
                                   and _gauge(text, "codeenv_waiting") == 2):
            assert time.monotonic() < deadline, "the calls never took both slots"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2 if slots_gauge else 1.0)
        t0 = time.monotonic()
        service.proc.send_signal(sig)  # type: ignore[union-attr]
        if second:
            await asyncio.sleep(0.5)
            service.proc.send_signal(sig)  # type: ignore[union-attr]
        results = await asyncio.gather(*calls)
        status = await asyncio.to_thread(service.wait, GRACE_S + 10)
        took = time.monotonic() - t0
    assert took < GRACE_S + 1.5, f"exited {took:.1f}s after the signal, past its grace period of {GRACE_S:g}s"
    assert status in (0, -signal.SIGTERM), service.log_tail()  # uvicorn ends by the SIGTERM it was sent
    for result, seconds in zip(results, SLEEPS, strict=True):
        assert (result["status"] == "ok" and result["stdout"] == "done\n"
                or (result["status"], result["started"]) == ("killed", True) and "grace period" in result["message"]
                or (result["status"], result["started"]) == ("overloaded", False)), (seconds, result)
    return results


def no_traceback(log: Path) -> None:
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("mode", ["embedded", "processes"])
async def test_a_stop_signal_answers_every_call_within_the_grace_period(tmp_path: Path, sig: int, mode: str) -> None:
    log = tmp_path / "serve.log"
    extra = ["--processes", "2"] if mode == "processes" else []
    service = start_service("serve", "--slots", "2", "--log-format", "text", *extra, log=log,
                            CODEENV_SHUTDOWN_GRACE_S=str(GRACE_S))
    try:
        results = await stop_under_load(service, sig)
    finally:
        service.kill()
    statuses = [r["status"] for r in results]
    # The slots take the calls in the order their requests reach the gateway, which is not the order
    # they were sent: the 30 s call is stopped if it started, and not run if it did not.
    assert statuses[1] in ("killed", "overloaded"), results
    assert statuses.count("ok") >= 1 and statuses.count("killed") <= 1 and statuses.count("overloaded") == 2, results
    no_traceback(log)


async def test_a_second_signal_stops_the_running_calls_at_once(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    service = start_service("serve", "--slots", "2", "--log-format", "text", log=log,
                            CODEENV_SHUTDOWN_GRACE_S="60")
    try:
        t0 = time.monotonic()
        results = await stop_under_load(service, signal.SIGINT, second=True)
    finally:
        service.kill()
    assert time.monotonic() - t0 < 30
    assert sorted(r["status"] for r in results) == ["killed", "killed", "overloaded", "overloaded"], results
    no_traceback(log)


@pytest.mark.redis
async def test_a_stop_signal_with_redis_answers_every_call(tmp_path: Path, redis_server: Service) -> None:
    log = tmp_path / "serve.log"
    service = start_service("serve", "--slots", "2", "--log-format", "text", "--redis", redis_server.url, log=log,
                            CODEENV_SHUTDOWN_GRACE_S=str(GRACE_S), CODEENV_REDIS_PREFIX=f"stop{time.time_ns()}")
    try:
        results = await stop_under_load(service, signal.SIGTERM, slots_gauge=False)
    finally:
        service.kill()
    statuses = sorted(r["status"] for r in results)
    # Which two the worker claimed first is the stream's order: one that ends, and one cut or not run.
    assert statuses.count("overloaded") >= 1 and "ok" in statuses, results
    no_traceback(log)
