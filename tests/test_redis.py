"""The Redis Streams queue: real redis-server (own port), real worker processes, real SIGKILLs.

"Ran once" is counted outside the jails, from the workers' own log line per call started.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from codeenv import ExecRequest, SlotPool
from codeenv.api import create_app
from codeenv.bench.services import Service, free_port, start_codeenv, start_redis
from codeenv.models import ExecResult
from codeenv.queue.redis import RedisQueue
from codeenv.queue.redis_protocol import GROUP, Keys, encode_job
from codeenv.settings import GatewaySettings
from codeenv.worker import StreamWorker
from tests.conftest import until

pytestmark = [pytest.mark.jail, pytest.mark.redis, pytest.mark.slow]

#: Fast failure detection for tests: a worker is dead 1 s after its last heartbeat.
FAST = {"heartbeat_s": 0.2, "worker_dead_after_s": 1.0}


def settings_for(server: Service, prefix: str, **extra: Any) -> GatewaySettings:
    return GatewaySettings(slots=2, redis_url=server.url, redis_prefix=prefix, local_worker=False,
                           **(FAST | extra))


class WorkerProcess:
    """`codeenv worker` in a process of its own, logging one JSON line per call started."""

    def __init__(self, server: Service, prefix: str, log: Path, slots: int = 2) -> None:
        self.server, self.prefix, self.log = server, prefix, log
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CODEENV_REDIS_PREFIX": prefix,
                    "CODEENV_HEARTBEAT_S": "0.2", "CODEENV_WORKER_DEAD_AFTER_S": "1", "CODEENV_SLOTS": str(slots)}
        self.service: Service | None = None

    async def start(self) -> None:
        self.service = start_codeenv("worker", "--redis", self.server.url, "--log-level", "debug",
                                     env=self.env, log=self.log)

    def kill(self) -> None:
        assert self.service is not None
        self.service.kill()

    async def stop(self) -> int | None:
        assert self.service is not None
        return await self.service.stop_async(60)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def uid_base(self) -> int:
        """The first host uid of the block its pool claimed (from the pool's "ready" line)."""
        found = re.findall(r"host uids from (\d+)", self.log.read_text())
        assert found, "the worker's pool did not say which uids it runs on"
        return int(found[-1])

    def started_ids(self) -> list[str]:
        return [e["id"] for e in self.events() if e.get("event") == "start"]


async def wait_for_workers(server: Service, prefix: str, count: int, timeout: float = 90) -> None:
    """Until `count` workers say they are alive (their keys, named by the protocol's Keys)."""
    r = aioredis.Redis(port=server.port, decode_responses=True)
    pattern = Keys(prefix).alive("*")
    try:
        deadline = time.monotonic() + timeout
        while len([k async for k in r.scan_iter(pattern)]) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} workers did not come up within {timeout:g}s")
            await asyncio.sleep(0.1)
    finally:
        await r.aclose()


@pytest_asyncio.fixture
async def prefix() -> str:
    return uuid.uuid4().hex[:12]


@pytest_asyncio.fixture
async def local_worker(redis_server: Service, pool: SlotPool, prefix: str) -> AsyncIterator[StreamWorker]:
    worker = StreamWorker(settings_for(redis_server, prefix), pool=pool)
    await worker.start()
    yield worker
    await worker.stop()


@pytest_asyncio.fixture
async def redis_queue(redis_server: Service, prefix: str) -> AsyncIterator[RedisQueue]:
    """A gateway's queue on the private Redis (the name `gateway` is the ASGI client's, see conftest)."""
    queue = RedisQueue(settings_for(redis_server, prefix))
    await queue.start()
    yield queue
    await queue.close()


def sleepy(i: int, seconds: float = 0.3) -> ExecRequest:
    return ExecRequest(code=f"import time\ntime.sleep({seconds})\nprint({i})", id=f"call-{i}")


async def test_a_sigkilled_worker_loses_no_call_and_runs_none_twice(
        redis_server: Service, redis_queue: RedisQueue, prefix: str, tmp_path: Path) -> None:
    workers = [WorkerProcess(redis_server, prefix, tmp_path / f"w{i}.log") for i in range(2)]
    await asyncio.gather(*(w.start() for w in workers))
    try:
        await wait_for_workers(redis_server, prefix, 2)
        batch = asyncio.ensure_future(redis_queue.submit([sleepy(i) for i in range(40)]))
        deadline = time.monotonic() + 60
        while not (workers[0].started_ids() and workers[1].started_ids()):  # both workers are busy
            assert time.monotonic() < deadline, "the workers never took calls"
            await asyncio.sleep(0.05)
        workers[0].kill()
        results = await asyncio.wait_for(batch, 60)
        # The killed worker's uid block is free again for the next process that needs one.
        replacement = WorkerProcess(redis_server, prefix, tmp_path / "w2.log")
        workers.append(replacement)
        await replacement.start()
        await until(lambda: "host uids from" in replacement.log.read_text(), "the replacement's pool started", 90)
        assert replacement.uid_base() == workers[0].uid_base()
    finally:
        for w in workers:
            await w.stop()
    started = Counter(workers[0].started_ids() + workers[1].started_ids())
    assert set(started.values()) == {1}, "a call ran twice"
    assert len(results) == 40
    for i, result in enumerate(results):
        assert result.id == f"call-{i}"
        if result.status == "ok":
            assert result.stdout == f"{i}\n"
        else:  # it was running on the killed worker: answered, never rerun
            assert result.status == "internal_error" and result.started, result
            assert "died" in (result.message or "")
            assert result.id in workers[0].started_ids()
    lost = [r for r in results if r.status != "ok"]
    assert 1 <= len(lost) <= 2, lost  # at most the killed worker's two slots were running
    assert started[f"call-{39}"] == 1 and f"call-{39}" in workers[1].started_ids()


async def test_the_dead_workers_pending_jobs_are_reclaimed(
        redis_server: Service, pool: SlotPool, prefix: str) -> None:
    """Entries pending to workers that died: unmarked ones run, marked ones are answered, and one
    that two workers died holding is not tried a third time."""
    settings = settings_for(redis_server, prefix)
    keys = Keys(prefix)
    r = aioredis.Redis(port=redis_server.port, decode_responses=True)
    reply = f"{prefix}:reply:test"
    try:
        await r.xgroup_create(keys.jobs, GROUP, id="0", mkstream=True)
        for job, code in (("fresh", "print('ran here')"), ("marked", "print('must not run')"),
                          ("poison", "print('must not run either')")):
            request = ExecRequest(code=code, id=job)
            await r.xadd(keys.jobs, {"k": job, "job": encode_job(job, reply, job, request.model_dump_json())})
        got: Any = await r.xreadgroup(GROUP, "ghost-1", {keys.jobs: ">"}, count=3)
        entries = {json.loads(f["job"])["job"]: e for e, f in got[0][1]}
        await r.set(keys.started("marked"), "ghost-1")  # it had started when ghost-1 died
        await asyncio.sleep(0.25)
        await r.xclaim(keys.jobs, GROUP, "ghost-2", 0, [entries["poison"]])  # delivered twice
        await asyncio.sleep(0.25)  # older than the reclaim idle floor
        worker = StreamWorker(settings, pool=pool)
        await worker.start()
        try:
            results: dict[str, ExecResult] = {}
            for _ in range(100):
                got = await r.blmpop(0.1, 1, reply, direction="RIGHT", count=10)
                for item in got[1] if got else []:
                    job, _, body = item.partition("\n")
                    if not body.startswith("@"):  # not a worker's "started" notice
                        results[job] = ExecResult.model_validate_json(body)
                if len(results) == 3:
                    break
        finally:
            await worker.stop()
        assert results["fresh"].status == "ok" and results["fresh"].stdout == "ran here\n"
        assert results["marked"].status == "internal_error" and results["marked"].started
        assert "ghost-1" in (results["marked"].message or "")
        assert results["poison"].status == "internal_error" and not results["poison"].started
        assert "not tried again" in (results["poison"].message or "")
        assert await r.xlen(keys.jobs) == 0
        assert not await r.xpending_range(keys.jobs, GROUP, "-", "+", 10)
    finally:
        await r.aclose()


async def test_a_call_claimed_past_its_deadline_is_answered_not_run(
        redis_server: Service, pool: SlotPool, prefix: str) -> None:
    """The claim marks a job started; one whose deadline has passed must still get its answer."""
    keys = Keys(prefix)
    r = aioredis.Redis(port=redis_server.port, decode_responses=True)
    reply = f"{prefix}:reply:test"
    try:
        await r.xgroup_create(keys.jobs, GROUP, id="0", mkstream=True)
        request = ExecRequest(code="print('must not run')", id="late", deadline_s=0.5)
        payload = json.loads(encode_job("late-job", reply, "late", request.model_dump_json()))
        payload["t"] -= 10  # queued ten seconds ago (a gateway whose cancel never arrived)
        await r.xadd(keys.jobs, {"k": "late-job", "job": json.dumps(payload)})
        worker = StreamWorker(settings_for(redis_server, prefix), pool=pool)
        await worker.start()
        try:
            got: Any = await r.blmpop(10, 1, reply, direction="RIGHT", count=1)
        finally:
            await worker.stop()
        assert got is not None
        result = ExecResult.model_validate_json(got[1][0].partition("\n")[2])
        assert result.status == "overloaded" and not result.started and "deadline" in (result.message or "")
        assert await r.xlen(keys.jobs) == 0
    finally:
        await r.aclose()


async def test_a_long_call_is_not_stolen_from_a_live_worker(
        redis_server: Service, pool: SlotPool, redis_queue: RedisQueue, prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="codeenv.worker")
    workers = [StreamWorker(settings_for(redis_server, prefix), pool=pool) for _ in range(2)]
    for w in workers:
        await w.start()
    try:
        # 4 s: four times the time after which a silent worker counts as dead.
        [result] = await asyncio.wait_for(redis_queue.submit([sleepy(0, 4.0)]), 30)
    finally:
        for w in workers:
            await w.stop()
    assert result.status == "ok" and result.wall_s >= 4.0
    starts = [r for r in caplog.records if getattr(r, "event", None) == "start" and getattr(r, "id", None) == "call-0"]
    assert len(starts) == 1


async def test_two_workers_and_a_gateway_on_one_host_share_the_load(redis_server: Service, prefix: str,
                                                                    tmp_path: Path) -> None:
    # Three `codeenv` processes on one host and not one uid setting: each worker claims its own block.
    workers = [WorkerProcess(redis_server, prefix, tmp_path / f"w{i}.log", slots=1) for i in range(2)]
    await asyncio.gather(*(w.start() for w in workers))
    gateway = start_codeenv("serve", "--redis", redis_server.url, "--no-local-worker", "--log-level", "warning",
                            port=free_port(), env=workers[0].env)
    try:
        await wait_for_workers(redis_server, prefix, 2)
        await gateway.await_ready(90)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
            batch = {"requests": [sleepy(i, 0.05).model_dump(exclude_none=True) for i in range(60)]}
            results = [ExecResult.model_validate(r) for r in
                       (await client.post("/v1/execute/batch", json=batch)).json()["results"]]
    finally:
        await gateway.stop_async(60)
        for w in workers:
            assert await w.stop() == 0  # a graceful stop on SIGTERM
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(60)]
    by_worker = Counter(r.worker.rsplit("/", 1)[0] for r in results)
    assert len(by_worker) == 2 and min(by_worker.values()) >= 10, by_worker
    assert workers[0].uid_base() != workers[1].uid_base()


async def test_a_killed_gateways_calls_resubmitted_elsewhere_run_once(
        redis_server: Service, redis_queue: RedisQueue, prefix: str, tmp_path: Path) -> None:
    worker = WorkerProcess(redis_server, prefix, tmp_path / "w.log")
    await worker.start()
    first = start_codeenv("serve", "--redis", redis_server.url, "--no-local-worker", "--log-level", "warning",
                          port=free_port(), env=worker.env)
    requests = [sleepy(i, 0.4) for i in range(10)]
    try:
        await wait_for_workers(redis_server, prefix, 1)
        async with httpx.AsyncClient(base_url=first.url, timeout=30) as c:
            await first.await_ready(90)
            body = {"requests": [r.model_dump(exclude_none=True) for r in requests]}
            sent = asyncio.ensure_future(c.post("/v1/execute/batch", json=body))
            await asyncio.sleep(0.6)
            first.kill()  # mid-batch
            with pytest.raises(httpx.TransportError):
                await sent
        results = await asyncio.wait_for(redis_queue.submit(requests), 60)  # a new gateway, the same ids
    finally:
        first.kill()
        await worker.stop()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]
    assert Counter(worker.started_ids()) == Counter(f"call-{i}" for i in range(10))


async def test_redis_restarted_under_load(pool: SlotPool, prefix: str) -> None:
    server = start_redis()
    settings = settings_for(server, prefix)
    worker = StreamWorker(settings, pool=pool)
    queue = RedisQueue(settings)
    await worker.start()
    await queue.start()
    outcomes: list[ExecResult] = []
    stop = asyncio.Event()

    async def client(n: int) -> None:
        i = 0
        while not stop.is_set():
            batch = [ExecRequest(code=f"import time\ntime.sleep(0.05)\nprint({n})", deadline_s=5) for _ in range(5)]
            t0 = time.monotonic()
            outcomes.extend(await queue.submit(batch))
            assert time.monotonic() - t0 < 15, "a call hung past its deadline"
            i += 1
            await asyncio.sleep(0.05)

    try:
        clients = asyncio.gather(*(client(n) for n in range(3)))
        await asyncio.sleep(1.0)
        server.kill()  # everything in it is gone
        await asyncio.sleep(1.0)
        server.start().wait_ready()
        restarted = len(outcomes)
        await asyncio.sleep(4.0)
        stop.set()
        await asyncio.wait_for(clients, 30)
        after = outcomes[restarted:]
        assert sum(r.status == "ok" for r in after) >= 10, Counter(r.status for r in after)
        for r in outcomes:
            assert r.status in ("ok", "overloaded", "internal_error"), r
            if r.status == "overloaded":
                assert not r.started
            if r.status == "internal_error":
                assert r.started and ("Redis" in (r.message or "") or "queue" in (r.message or "")), r
        [fresh] = await asyncio.wait_for(queue.submit([ExecRequest(code="print('back')")]), 10)
        assert fresh.stdout == "back\n"
        assert queue.ready()
    finally:
        await queue.close()
        await worker.stop()
        server.kill()


async def test_a_client_gone_mid_batch_cancels_its_unstarted_calls(
        local_worker: StreamWorker, redis_queue: RedisQueue, pool: SlotPool) -> None:
    gone = asyncio.Event()
    before = pool.calls_started
    batch = asyncio.ensure_future(redis_queue.submit(
        [ExecRequest(code="import time\ntime.sleep(0.02)") for _ in range(1000)], gone))
    await until(lambda: pool.calls_started - before >= 2 * len(pool.slots), "the batch's first calls started")
    at_gone = pool.calls_started
    gone.set()
    with pytest.raises(asyncio.CancelledError):
        await batch
    # Then nothing is left to start: the gateway waits for no call, the worker holds none.
    await until(lambda: not redis_queue._waiting and not local_worker._held, "the unstarted calls were cancelled")
    ran_after = pool.calls_started - at_gone
    # What was running, plus at most one claim round.
    assert ran_after <= 2 * len(pool.slots) + 1, ran_after
    assert at_gone > 0


async def test_a_full_queue_answers_overloaded_and_recovers(
        redis_server: Service, pool: SlotPool, prefix: str) -> None:
    settings = settings_for(redis_server, prefix, max_queued=5)
    queue = RedisQueue(settings)
    await queue.start()
    app = create_app(settings, queue)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            waiting = asyncio.ensure_future(queue.submit([ExecRequest(code=f"print({i})") for i in range(5)]))
            # No worker yet: five calls fill the queue once they are written.
            await until(lambda: len(queue._waiting) == 5 and all(c.entry for c in queue._waiting.values()),
                        "five calls are queued")
            r = await c.post("/v1/execute/batch", json={"requests": [{"code": "print(1)"}] * 3})
            assert r.status_code == 429 and r.headers["retry-after"]
            assert {x["status"] for x in r.json()["results"]} == {"overloaded"}
            r = await c.post("/v1/execute", json={"code": "print(1)"})
            assert r.status_code == 429 and not r.json()["started"]
            assert (await c.get("/readyz")).status_code == 503  # no worker
            worker = StreamWorker(settings, pool=pool)
            await worker.start()
            try:
                assert [x.stdout for x in await asyncio.wait_for(waiting, 30)] == [f"{i}\n" for i in range(5)]
                r = await c.post("/v1/execute", json={"code": "print('recovered')"})
                assert r.status_code == 200 and r.json()["stdout"] == "recovered\n"
            finally:
                await worker.stop()
    finally:
        await queue.close()


async def test_a_stopping_worker_hands_unstarted_calls_back(
        redis_server: Service, pool: SlotPool, redis_queue: RedisQueue, prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="codeenv.worker")
    # Two workers on one 2-slot pool: `second` busies both slots, then `first` claims two calls
    # that can only wait for a slot. Stopping `first` must hand those back, not run them itself.
    first, second = (StreamWorker(settings_for(redis_server, prefix), pool=pool) for _ in range(2))
    await second.start()
    busy = asyncio.ensure_future(redis_queue.submit([sleepy(i, 1.0) for i in range(2)]))
    await until(lambda: pool.free_slots == 0, "the first two calls hold both slots", 10)
    await first.start()
    waiting = asyncio.ensure_future(redis_queue.submit([sleepy(i, 0.1) for i in range(2, 4)]))
    await until(lambda: len(first._held) == 2, "the stopping worker claimed the two waiting calls", 10)
    await first.stop()
    handed = [r for r in caplog.records if getattr(r, "event", None) == "hand_back"]
    assert handed and handed[0].jobs == 2
    results = await asyncio.wait_for(asyncio.gather(busy, waiting), 30)
    await second.stop()
    assert [r.stdout for part in results for r in part] == [f"{i}\n" for i in range(4)]
    starts = Counter(getattr(r, "id", None) for r in caplog.records if getattr(r, "event", None) == "start")
    assert starts == Counter(f"call-{i}" for i in range(4))


@pytest.mark.parametrize("mode", ["embedded", "redis"])
async def test_ten_thousand_calls_from_64_clients(mode: str, redis_server: Service, pool: SlotPool,
                                                  prefix: str) -> None:
    from tests.test_api import SharedPoolQueue

    settings = settings_for(redis_server, prefix) if mode == "redis" else GatewaySettings(slots=2)
    worker = StreamWorker(settings, pool=pool) if mode == "redis" else None
    queue: Any = RedisQueue(settings) if mode == "redis" else SharedPoolQueue(pool, settings.max_queued)
    if worker is not None:
        await worker.start()
        await queue.start()
    app = create_app(settings, queue)
    per_client, batch = 10_000 // 64 + 1, 16

    async def client(c: httpx.AsyncClient, n: int) -> int:
        done = 0
        for start in range(0, per_client, batch):
            ids = [f"{n}-{i}" for i in range(start, min(per_client, start + batch))]
            r = await c.post("/v1/execute/batch", json={"requests": [{"code": f"print('{i}')", "id": i} for i in ids]})
            assert r.status_code == 200
            got = r.json()["results"]
            assert [x["id"] for x in got] == ids and [x["stdout"] for x in got] == [f"{i}\n" for i in ids]
            done += len(got)
        return done

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost",
                                     timeout=120) as c:
            counts = await asyncio.wait_for(asyncio.gather(*(client(c, n) for n in range(64))), 240)
        assert sum(counts) == 64 * per_client >= 10_000
        if mode == "redis":
            # Nothing is left behind without an expiry: Redis memory returns to its baseline.
            r = aioredis.Redis(port=redis_server.port, decode_responses=True)
            try:
                assert await r.xlen(f"{prefix}:jobs") == 0
                persistent = [k async for k in r.scan_iter(f"{prefix}:*", count=1000) if await r.ttl(k) == -1]
                assert sorted(persistent) == sorted([f"{prefix}:jobs", f"{prefix}:workers"]), persistent[:5]
            finally:
                await r.aclose()
    finally:
        if worker is not None:
            await queue.close()
            await worker.stop()


async def test_a_stopping_worker_still_writes_the_result_it_is_writing(
        redis_server: Service, redis_queue: RedisQueue, prefix: str, tmp_path: Path) -> None:
    """The result write is shielded: SIGTERM to a worker (with no grace for running calls) while
    its result write keeps failing still lets the result reach the gateway once Redis takes it."""
    worker = WorkerProcess(redis_server, prefix, tmp_path / "w.log")
    worker.env["CODEENV_SHUTDOWN_GRACE_S"] = "0"
    await worker.start()
    r = aioredis.Redis(port=redis_server.port, decode_responses=True)
    try:
        await wait_for_workers(redis_server, prefix, 1)
        # Result writes (the only LPUSH, inside the finish script) fail from now on; claims do not.
        await r.execute_command("ACL", "SETUSER", "default", "-lpush")
        call = asyncio.ensure_future(redis_queue.submit([ExecRequest(
            code="import time\ntime.sleep(0.5)\nprint('kept')", id="kept-1")]))
        deadline = time.monotonic() + 60
        [name] = await r.hkeys(f"{prefix}:workers")
        while "kept-1" not in worker.started_ids():
            assert time.monotonic() < deadline, "the call never started"
            await asyncio.sleep(0.02)
        while json.loads(await r.hget(f"{prefix}:workers", name) or "{}").get("free") != 2:
            assert time.monotonic() < deadline, "the call never ended"
            await asyncio.sleep(0.02)  # the call has ended: its result write is failing and retried
        assert worker.service is not None
        os.kill(worker.service.pid, signal.SIGTERM)
        while not any("results before stopping" in e.get("message", "") for e in worker.events()):
            assert worker.service.returncode is None, "the worker stopped without writing the result"
            assert time.monotonic() < deadline, "the worker never waited for its result write"
            await asyncio.sleep(0.05)
        assert not call.done()
        await r.execute_command("ACL", "SETUSER", "default", "+lpush")
        [result] = await asyncio.wait_for(call, 60)
        assert (result.status, result.stdout, result.started) == ("ok", "kept\n", True), result
        assert await worker.stop() == 0
    finally:
        await r.execute_command("ACL", "SETUSER", "default", "+lpush")
        await r.aclose()
        if worker.service is not None and worker.service.returncode is None:
            worker.kill()


async def _resend_until_run(queue: RedisQueue, requests: list[ExecRequest],
                            first: list[ExecResult]) -> dict[str, ExecResult]:
    """What a client does: a call answered `started: false` is sent again (same id) until it runs."""
    final = {r.id: r for r in first if r.started}
    pending = [req for req, r in zip(requests, first, strict=True) if not r.started]
    for _ in range(10):
        if not pending:
            break
        results = await asyncio.wait_for(queue.submit(pending), 120)
        final.update({r.id: r for r in results if r.started})
        pending = [req for req, r in zip(pending, results, strict=True) if not r.started]
        await asyncio.sleep(0.2)
    assert not pending, f"{len(pending)} calls never ran"
    return {k: v for k, v in final.items() if k is not None}


async def test_after_redis_loses_its_data_only_calls_that_ran_say_started(prefix: str, tmp_path: Path) -> None:
    server = start_redis()
    worker = WorkerProcess(server, prefix, tmp_path / "worker.log")
    queue = RedisQueue(settings_for(server, prefix))
    try:
        await worker.start()
        await wait_for_workers(server, prefix, 1)
        await queue.start()
        requests = [ExecRequest(code=f"import time\ntime.sleep(0.4)\nprint({i})", id=f"c{i}") for i in range(48)]
        batch = asyncio.ensure_future(queue.submit(requests))
        await until(lambda: len(worker.started_ids()) >= 5, "five calls started")
        server.kill()  # SIGKILL: every key is gone
        server.start().wait_ready()
        first = await asyncio.wait_for(batch, 120)
        ran = Counter(worker.started_ids())
        assert {r.id for r in first if r.started} == set(ran), (Counter(r.status for r in first), ran)
        assert all(r.status == "ok" for r in first if r.started)
        assert all(r.status == "overloaded" for r in first if not r.started)
        assert sum(not r.started for r in first) >= 30  # most of the 48 were still queued
        final = await _resend_until_run(queue, requests, first)
        assert sorted(final) == sorted(f"c{i}" for i in range(48))
        assert all(final[f"c{i}"].stdout == f"{i}\n" for i in range(48))
        assert Counter(worker.started_ids()) == Counter(f"c{i}" for i in range(48))  # each ran exactly once
    finally:
        await queue.close()
        await worker.stop()
        server.kill()


async def test_a_worker_killed_with_redis_leaves_only_the_calls_it_started_unknown(prefix: str, tmp_path: Path) -> None:
    server = start_redis()
    survivor = WorkerProcess(server, prefix, tmp_path / "survivor.log", slots=1)
    doomed = WorkerProcess(server, prefix, tmp_path / "doomed.log", slots=1)
    queue = RedisQueue(settings_for(server, prefix))
    try:
        await asyncio.gather(survivor.start(), doomed.start())
        await wait_for_workers(server, prefix, 2)
        await queue.start()
        await until(lambda: queue.stats()["workers"] >= 2, "the gateway's snapshot has seen both workers")
        requests = [ExecRequest(code=f"import time\ntime.sleep(0.4)\nprint({i})", id=f"d{i}") for i in range(48)]
        batch = asyncio.ensure_future(queue.submit(requests))
        await until(lambda: len(doomed.started_ids()) >= 2, "the doomed worker started calls")
        doomed.kill()
        server.kill()
        server.start().wait_ready()
        first = await asyncio.wait_for(batch, 120)
        ran = Counter(survivor.started_ids()) + Counter(doomed.started_ids())
        said_started = {r.id for r in first if r.started}
        # Never "not started" for a call that ran; "may have run" only for what the dead worker
        # had marked started (what ran, or what its one slot had just claimed).
        assert set(ran) <= said_started and len(said_started - set(ran)) <= 1, (said_started, ran)
        for r in first:
            if r.started and r.status != "ok":
                assert r.status == "internal_error" and "did not come back" in (r.message or ""), r
        assert sum(not r.started for r in first) >= 30, Counter(r.status for r in first)
        # The client sends again only what surely never ran: nothing runs twice.
        await _resend_until_run(queue, requests, first)
        after = Counter(survivor.started_ids()) + Counter(doomed.started_ids())
        assert max(after.values()) == 1
    finally:
        await queue.close()
        await survivor.stop()
        server.kill()
