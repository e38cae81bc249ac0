"""The HTTP gateway over the embedded queue: in-process (ASGI) and as a real uvicorn server."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest

from codeenv import ExecRequest, SlotPool
from codeenv.settings import GatewaySettings
from tests.conftest import GatewayClient, SharedPoolQueue, start_service, until
from tests.fakes import FakeQueue


@pytest.mark.jail
async def test_execute(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/execute", json={"code": "import sys\nprint(sys.stdin.read() * 2)", "stdin": "ab",
                                               "id": "c1", "limits": {"wall_s": 5}})
    assert r.status_code == 200
    body = r.json()
    assert (body["status"], body["stdout"], body["id"], body["started"]) == ("ok", "abab\n", "c1", True)


@pytest.mark.jail
async def test_batch_keeps_order_and_rejects_bad_items_alone(client: httpx.AsyncClient) -> None:
    items = [{"code": f"print({i})", "id": str(i)} for i in range(20)]
    items[3] = {"code": "print(3)", "limits": {"wall_s": -1}, "id": "bad-limit"}
    items[7] = {"code": "print(7)", "limits": {"wall_s": 9999}, "id": "over-cap"}
    items[9] = {"cmd": "rm -rf /"}
    items[11] = {"code": "print('\ud800')", "id": "surrogate"}
    # ensure_ascii keeps the lone surrogate as the escape \ud800 a client would send
    r = await client.post("/v1/execute/batch", content=json.dumps({"requests": items}).encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 200
    results = r.json()["results"]
    assert len(results) == 20
    for i, res in enumerate(results):
        if i in (3, 7, 9, 11):
            assert res["status"] == "rejected" and not res["started"] and res["message"], res
        else:
            assert res["status"] == "ok" and res["stdout"] == f"{i}\n" and res["id"] == str(i)
    assert "cannot exceed the configured limit" in results[7]["message"]


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    (b'{"code": "1", "limits": ' + b"[" * 900 + b"]" * 900 + b"}", 422, "limits"),
    (b'{"code": 1}', 422, "string"),
    (b'{"code": "1", "limits": {"wall_s": "NaN"}}', 422, "valid number"),  # a string is not a number
    (b'{"code": "1", "limits": {"memory_mb": 100000000}}', 422, "cannot exceed the configured limit"),
    (b'{"code": "print(\\"\\ud800\\")"}', 422, "surrogates"),
    (b"\xff\xfe", 400, "not valid JSON"),
    (b'{"code": "1", "profile": "\\ud800"}', 422, "surrogates"),
    (b'{"code": "1", "id": "a\\udc00"}', 422, "surrogates"),
])
@pytest.mark.unit
async def test_bad_input_gets_a_clear_4xx(gateway: GatewayClient, body: bytes, status: int, fragment: str) -> None:
    queue = FakeQueue()
    async with gateway(queue=queue) as client:
        r = await client.post("/v1/execute", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert fragment in json.dumps(r.json()["detail"]) and not queue.calls


@pytest.mark.unit
async def test_body_and_batch_caps(gateway: GatewayClient) -> None:
    queue = FakeQueue()
    async with gateway(queue=queue, max_body_bytes=1 << 20, max_batch=64) as client:
        r = await client.post("/v1/execute", json={"code": "#" * (2 << 20)})
        assert r.status_code == 413 and "limit" in r.json()["detail"]
        r = await client.post("/v1/execute/batch", json={"requests": [{"code": "1"}] * 65})
        assert r.status_code == 422 and "at most 64" in r.json()["detail"]
        assert not queue.calls
        r = await client.post("/v1/execute/batch", json={"requests": [{"code": "1"}] * 64})
        assert r.status_code == 200 and len(queue.calls) == 64


@pytest.mark.unit
async def test_an_answer_that_could_outgrow_max_answer_mb_is_refused_before_its_calls_run(
        gateway: GatewayClient) -> None:
    """Output caps sum over a batch: 24 calls of 16 MiB on both streams could answer 768 MiB."""
    queue = FakeQueue()
    big = {"code": "print(1)", "limits": {"output_bytes": 16 << 20}}
    async with gateway(queue=queue, max_answer_mb=256) as client:
        for path in ("/v1/execute/batch", "/v1/execute/stream"):
            r = await client.post(path, json={"requests": [big] * 24})
            assert r.status_code == 422 and "768 MiB" in r.json()["detail"] and "max_answer_mb" in r.text, r.text
        judged = {"code": "print(1)", "tests": [{"stdin": "", "expected_stdout": "1"}] * 1000}
        r = await client.post("/v1/judge/batch", json={"requests": [judged] * 30})
        assert r.status_code == 422 and "max_answer_mb" in r.text, r.text
        assert not queue.calls
        r = await client.post("/v1/execute/batch", json={"requests": [big] * 8})  # 256 MiB: fits
        assert r.status_code == 200 and len(queue.calls) == 8


@pytest.mark.jail
async def test_health_ready_metrics_docs(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).status_code == 200
    await client.post("/v1/execute", json={"code": "1/0"})
    text = (await client.get("/metrics")).text
    assert 'codeenv_calls_total{status="error"}' in text and "codeenv_run_seconds_bucket" in text
    for gauge in ("codeenv_slots 2.0", "codeenv_free_slots", "codeenv_slot_restarts", "codeenv_waiting"):
        assert gauge in text
    schema = (await client.get("/openapi.json")).json()
    assert {"ExecRequest", "ExecResult", "Limits", "BatchRequest"} <= set(schema["components"]["schemas"])


@pytest.mark.jail
async def test_overload_is_an_explicit_answer(gateway: GatewayClient) -> None:
    async with gateway(max_queued=1) as c:
        r = await c.post("/v1/execute/batch", json={"requests": [{"code": "import time; time.sleep(0.2)"}] * 8})
        statuses = [x["status"] for x in r.json()["results"]]
        assert statuses.count("ok") == 3 and statuses.count("overloaded") == 5  # 2 slots + 1 queued
        assert all(not x["started"] for x in r.json()["results"] if x["status"] == "overloaded")


@pytest.mark.unit
def test_non_loopback_bind_needs_a_token() -> None:
    with pytest.raises(ValueError, match="set a token"):
        GatewaySettings(host="0.0.0.0")
    assert GatewaySettings(host="0.0.0.0", token="t" * 32).token
    assert GatewaySettings(host="0.0.0.0", insecure=True).insecure


@pytest.mark.unit
async def test_token_is_checked_on_every_endpoint(gateway: GatewayClient) -> None:
    queue = FakeQueue()
    async with gateway(queue=queue, token="s3cret-token-0123456789") as c:
        for method, path in (("GET", "/healthz"), ("GET", "/metrics"), ("POST", "/v1/execute"),
                             ("POST", "/v1/judge"), ("POST", "/run_code"), ("GET", "/v1/sessions")):
            assert (await c.request(method, path, json={"code": "1"})).status_code == 401, (method, path)
        for wrong in ("Bearer s3cret-token-012345678", "s3cret-token-0123456789", "Basic s3cret-token-0123456789"):
            r = await c.post("/v1/execute", json={"code": "1"}, headers={"authorization": wrong})
            assert r.status_code == 401, wrong
        assert not queue.calls
        ok = await c.post("/v1/execute", json={"code": "print(1)", "stdin": "in"},
                          headers={"authorization": "Bearer s3cret-token-0123456789"})
        assert ok.status_code == 200 and ok.json()["stdout"] == "in" and queue.calls[0].code == "print(1)"


def _gauge(metrics: str, name: str) -> float:
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))


@pytest.mark.jail
@pytest.mark.slow
async def test_codeenv_serve_over_real_http(tmp_path: Path) -> None:
    service = start_service("serve", "--slots", "1", "--log-level", "warning", log=tmp_path / "serve.log")
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as c:
            await service.await_ready(90)
            r = await c.post("/v1/execute", json={"code": "import sympy\nprint(sympy.sqrt(8))"})
            assert r.status_code == 200 and r.json()["stdout"] == "2*sqrt(2)\n"

            # A client that gives up 0.6 s into a batch of 40 calls: its unstarted calls never run.
            before = _gauge((await c.get("/metrics")).text, "codeenv_calls_run")
            batch = {"requests": [{"code": "import time\ntime.sleep(0.2)"}] * 40}
            with pytest.raises(httpx.TimeoutException):
                await c.post("/v1/execute/batch", json=batch, timeout=0.6)
            # Until nothing waits and the slot is free: then no call of the batch is left to run.
            deadline = time.monotonic() + 30
            while True:
                metrics = (await c.get("/metrics")).text
                if _gauge(metrics, "codeenv_waiting") == 0 and _gauge(metrics, "codeenv_free_slots") == 1:
                    break
                assert time.monotonic() < deadline, "the cancelled batch never drained"
                await asyncio.sleep(0.05)
            ran = _gauge(metrics, "codeenv_calls_run") - before
            assert 1 <= ran < 40, ran  # some started before the client gave up; the rest never ran
            r = await c.post("/v1/execute", json={"code": "print('still serving')"})
            assert r.json()["stdout"] == "still serving\n"
    finally:
        status = await service.stop_async(30)
    err = service.log_tail(10**9)
    # A graceful stop: the pool closed its jails (uvicorn then re-raises SIGTERM as its exit status).
    assert status in (0, -15) and "slot pool closed" in err, err[-2000:]
    # Structured logs: one JSON object per line, one line per batch.
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    batches = [e for e in events if e.get("event") == "batch"]
    assert batches and batches[0]["calls"] == 1 and batches[0]["statuses"] == {"ok": 1}


@pytest.mark.jail
async def test_a_resubmitted_id_attaches_to_the_same_call(client: httpx.AsyncClient) -> None:
    code = "import random, time\ntime.sleep(0.3)\nprint(random.random())"
    first, again = await asyncio.gather(
        client.post("/v1/execute", json={"code": code, "id": "retry-me"}),
        client.post("/v1/execute", json={"code": code, "id": "retry-me"}),
    )
    assert first.json()["stdout"] == again.json()["stdout"]  # one run, two answers
    later = await client.post("/v1/execute", json={"code": code, "id": "retry-me"})
    assert later.json()["stdout"] == first.json()["stdout"]
    by_id = await client.get("/v1/results/retry-me")
    assert by_id.status_code == 200 and by_id.json()["stdout"] == first.json()["stdout"]
    # A client re-sending after a lost connection sends what is left of its deadline: the same call.
    resent = await client.post("/v1/execute", json={"code": code, "id": "retry-me", "deadline_s": 3.5})
    assert resent.json()["stdout"] == first.json()["stdout"]
    other = await client.post("/v1/execute", json={"code": "print(2)", "id": "retry-me"})
    assert other.status_code == 409 and "different call" in other.json()["detail"]
    assert (await client.get("/v1/results/never-sent")).status_code == 404


@pytest.mark.jail
async def test_more_bad_input(client: httpx.AsyncClient) -> None:
    huge = '{"code": "1", "limits": {"memory_mb": 1' + "0" * 400 + "}}"
    r = await client.post("/v1/execute", content=huge.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 422 and "cannot exceed" in r.text
    r = await client.post("/v1/execute/batch", content=('{"requests": [' + huge + ', {"code": "print(1)"}]}').encode(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 200 and [x["status"] for x in r.json()["results"]] == ["rejected", "ok"]
    r = await client.post("/v1/execute/batch", content=b'{"requests": [{"code": "print(1)", "id": "\\ud800"}, '
                          b'{"code": "print(2)", "profile": "\\ud800"}, {"code": "print(3)"}]}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 200 and [x["status"] for x in r.json()["results"]] == ["rejected", "rejected", "ok"]
    r = await client.post("/nowhere", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 404
    r = await client.post("/v1/execute", json={"code": "print(5)", "id": "a/b"})
    assert (await client.get("/v1/results/a/b")).json()["stdout"] == "5\n"


@pytest.mark.jail
async def test_hostile_calls_through_http(client: httpx.AsyncClient) -> None:
    hostile = [
        ({"code": "while True: pass", "limits": {"wall_s": 1}}, "timeout"),
        ({"code": "x = bytearray(3 * 1024**3)", "limits": {"memory_mb": 256}}, "memory"),
        ({"code": "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
          "limits": {"wall_s": 1}}, "timeout"),
        ({"code": "import sys\nwhile True: sys.stdout.write('y' * 65536)"}, "output_limit"),
        ({"code": "import socket\nsocket.create_connection(('127.0.0.1', 6379), timeout=1)"}, "error"),
        ({"code": "import os, signal\nfor s in range(1, 65):\n    try: os.kill(1, s)\n    except OSError: pass\n"
                  "print('done')"}, "ok"),
        ({"code": "print('fine')"}, "ok"),
    ]
    r = await client.post("/v1/execute/batch", json={"requests": [h for h, _ in hostile]})
    assert r.status_code == 200
    assert [x["status"] for x in r.json()["results"]] == [s for _, s in hostile]
    after = await client.post("/v1/execute", json={"code": "print('next')"})
    assert after.json()["stdout"] == "next\n"


@pytest.mark.jail
@pytest.mark.slow
@pytest.mark.parametrize("redis_mode", [False, pytest.param(True, marks=pytest.mark.redis)], ids=["embedded", "redis"])
async def test_serve_with_several_gateway_processes_keeps_one_pool(redis_mode: bool, request: pytest.FixtureRequest,
                                                                    tmp_path: Path) -> None:
    extra = ["--redis", request.getfixturevalue("redis_server").url] if redis_mode else []
    service = start_service("serve", "--slots", "2", "--processes", "3", "--log-level", "warning",
                            *extra, log=tmp_path / "serve.log", PATH=os.environ.get("PATH", "/usr/bin"),
                            CODEENV_REDIS_PREFIX=uuid.uuid4().hex)
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as c:
            await service.await_ready(90)
            code = "import random\nprint(random.random())"
            # Many connections, so every gateway process takes some; ids are shared by all of them.
            clients = [httpx.AsyncClient(base_url=service.url, timeout=30) for _ in range(12)]
            try:
                first = await asyncio.gather(*(k.post("/v1/execute", json={"code": code, "id": f"p{i}"})
                                               for i, k in enumerate(clients)))
                again = await asyncio.gather(*(k.post("/v1/execute", json={"code": code, "id": f"p{i}"})
                                               for i, k in enumerate(reversed(clients))))
            finally:
                await asyncio.gather(*(k.aclose() for k in clients))
            stdout = {r.json()["id"]: r.json()["stdout"] for r in first}
            assert len(set(stdout.values())) == 12  # twelve runs ...
            assert all(stdout[r.json()["id"]] == r.json()["stdout"] for r in again)  # ... each answered twice
            # The pool's figures reach the gateways twice a second (through Redis, as the worker
            # publishes them): until they show the slots and the calls.
            deadline = time.monotonic() + 30
            while True:
                metrics = (await c.get("/metrics")).text
                if _gauge(metrics, "codeenv_slots") == 2 and (redis_mode or _gauge(metrics, "codeenv_calls_run") == 12):
                    break
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.1)
            assert _gauge(metrics, "codeenv_slots") == 2  # one pool of two slots behind three processes
            assert _gauge(metrics, 'codeenv_calls_total{status="ok"}') == 24  # summed over the processes
    finally:
        status = await service.stop_async(60)
    assert status in (0, -15), service.log_tail()


@pytest.mark.jail
async def test_gateways_lose_the_pool_process_with_clear_answers(pool: SlotPool, tmp_path: Path) -> None:
    from codeenv.errors import QueueUnavailable
    from codeenv.queue.host_socket import HostSocketQueue, HostSocketServer

    server = HostSocketServer(SharedPoolQueue(pool, 100), tmp_path / "pool.sock")
    await server.start()
    gateway = HostSocketQueue(tmp_path / "pool.sock")
    await gateway.start()
    try:
        [ok] = await gateway.submit([ExecRequest(code="print('via the socket')", id="sock-1")])
        assert ok.stdout == "via the socket\n"
        assert await gateway.lookup("sock-1") == (True, ok)
        running = asyncio.ensure_future(gateway.submit([ExecRequest(code="import time\ntime.sleep(1)")]))
        await until(lambda: pool.free_slots < len(pool.slots), "the call takes a slot")
        await server.close()  # the pool process goes away mid-call
        [lost] = await asyncio.wait_for(running, 10)
        assert lost.status == "internal_error" and lost.started and "may have run" in (lost.message or "")
        [refused] = await gateway.submit([ExecRequest(code="print(1)")])
        assert refused.status == "overloaded" and not refused.started
        with pytest.raises(QueueUnavailable):
            await gateway.lookup("sock-1")
        assert not gateway.ready()
    finally:
        await gateway.close()
