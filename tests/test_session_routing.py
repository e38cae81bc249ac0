"""Sessions in every deployment: `serve --processes 2` (one pool process behind two gateway
processes) and Redis (two worker processes, two gateway processes). Real processes, real HTTP, a
private redis-server; every request on a connection of its own, so the kernel spreads them over the
gateway processes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from codeenv.bench.services import Service, free_port, start_codeenv
from codeenv.queue.redis import SNAPSHOT_EVERY_S
from tests.conftest import start_service
from tests.test_pool_process import _pool_process
from tests.test_redis import WorkerProcess, wait_for_workers

KEY = {"x-codeenv-session-key": "the-routing-tests-own-session-key"}
DEAD_AFTER_S = 1.0  # WorkerProcess's CODEENV_WORKER_DEAD_AFTER_S


async def ask(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    """One request on a connection of its own."""
    async with httpx.AsyncClient(base_url=url, timeout=90, headers=KEY) as c:
        return await c.request(method, path, json=body)


async def cell(url: str, sid: str, code: str) -> dict[str, Any]:
    r = await ask(url, "POST", f"/v1/sessions/{sid}/execute", {"code": code})
    body: dict[str, Any] = r.json()
    body["http"] = r.status_code
    return body


async def per_worker(url: str, name: str, until: Any, timeout_s: float = 15) -> dict[str, float]:
    """The gauge `codeenv_worker_NAME` by worker, once `until(values)` holds (read from /metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await ask(url, "GET", "/metrics")).text
        values = {m[1]: float(m[2]) for m in re.finditer(rf'^codeenv_worker_{name}{{worker="([^"]+)"}} (\S+)$', text,
                                                          re.MULTILINE)}
        if until(values):
            return values
        assert time.monotonic() < deadline, f"codeenv_worker_{name} stayed {values}"
        await asyncio.sleep(0.2)


async def a_chosen_id_routes(url: str) -> None:
    """A session created under an id the client chose answers to it (for its key only) from every
    gateway process: its cells, listing, conflict while it lives, 410 after its delete, reuse."""
    made = await ask(url, "POST", "/v1/sessions", {"profile": "light", "session_id": "rollout-7:turn_0"})
    assert made.status_code == 201 and made.json()["session_id"] == "rollout-7:turn_0", made.text
    assert made.headers["location"] == "/v1/sessions/rollout-7:turn_0"
    assert (await cell(url, "rollout-7:turn_0", "n = 0"))["session"] == "rollout-7:turn_0"
    assert await counts_from_every_process(url, "rollout-7:turn_0", 3) == ["1", "2", "3"]
    again = await ask(url, "POST", "/v1/sessions", {"profile": "light", "session_id": "rollout-7:turn_0"})
    assert again.status_code == 409, again.text
    other_key = {"x-codeenv-session-key": "another-callers-key"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=other_key) as o:
        assert (await o.get("/v1/sessions/rollout-7:turn_0")).status_code == 404
        assert (await o.post("/v1/sessions/rollout-7:turn_0/execute", json={"code": "n"})).status_code == 404
        theirs = await o.post("/v1/sessions", json={"profile": "light", "session_id": "rollout-7:turn_0"})
        assert theirs.status_code == 201, theirs.text  # the same name, another caller: another session
        assert (await o.post("/v1/sessions/rollout-7:turn_0/execute", json={"code": "'n' in dir()"})).json()[
            "value"] == "False"
        assert (await o.delete("/v1/sessions/rollout-7:turn_0")).status_code == 204
    listed = [s["session_id"] for s in (await ask(url, "GET", "/v1/sessions")).json()["sessions"]]
    assert "rollout-7:turn_0" in listed
    assert (await ask(url, "DELETE", "/v1/sessions/rollout-7:turn_0")).status_code == 204
    assert (await cell(url, "rollout-7:turn_0", "n"))["http"] == 410
    reused = await ask(url, "POST", "/v1/sessions", {"profile": "light", "session_id": "rollout-7:turn_0"})
    assert reused.status_code == 201 and (await cell(url, "rollout-7:turn_0", "'n' in dir()"))["value"] == "False"
    assert (await ask(url, "DELETE", "/v1/sessions/rollout-7:turn_0")).status_code == 204
    shaped = await ask(url, "POST", "/v1/sessions", {"session_id": "0a.1.x"})
    assert shaped.status_code == 422 and "shape of the ids the service makes" in shaped.text


async def siblings_and_a_snapshot_route(url: str, sid: str) -> None:
    """N forks in one request, and a snapshot forked after its session was deleted, each request on a
    new connection (so from either gateway process)."""
    made = await ask(url, "POST", f"/v1/sessions/{sid}/fork", {"count": 3})
    assert made.status_code == 201, made.text
    forks = made.json()["session_ids"]
    assert [(await cell(url, f, f"n += {i}; n"))["value"] for i, f in enumerate(forks)] == ["8", "9", "10"]
    source = (await ask(url, "POST", f"/v1/sessions/{forks[2]}/snapshot", {"ttl_s": 60})).json()["snapshot_id"]
    for f in forks:
        assert (await ask(url, "DELETE", f"/v1/sessions/{f}")).status_code == 204
    again = await ask(url, "POST", f"/v1/snapshots/{source}/fork", {"count": 2})
    assert again.status_code == 201, again.text
    assert [(await cell(url, f, "n"))["value"] for f in again.json()["session_ids"]] == ["10", "10"]
    listed = (await ask(url, "GET", "/v1/sessions")).json()
    assert [s["snapshot_id"] for s in listed["snapshots"]] == [source]
    assert (await ask(url, "DELETE", f"/v1/snapshots/{source}")).status_code == 204
    for f in again.json()["session_ids"]:
        assert (await ask(url, "DELETE", f"/v1/sessions/{f}")).status_code == 204


async def counts_from_every_process(url: str, sid: str, times: int) -> list[str | None]:
    """`times` cells that each add one to the session's `n`, each on a new connection."""
    return [(await cell(url, sid, "n += 1; n")).get("value") for _ in range(times)]


@pytest.mark.jail
@pytest.mark.slow
async def test_with_processes_every_gateway_process_reaches_every_session(tmp_path: Path) -> None:
    service = start_service("serve", "--slots", "2", "--processes", "2", "--log-level", "warning",
                            log=tmp_path / "serve.log", PATH=os.environ.get("PATH", "/usr/bin"))
    try:
        await service.await_ready(120)
        made = await ask(service.url, "POST", "/v1/sessions", {"profile": "light"})
        assert made.status_code == 201, made.text
        sid = made.json()["session_id"]
        assert (await cell(service.url, sid, "n = 0"))["status"] == "ok"
        assert await counts_from_every_process(service.url, sid, 8) == [str(i) for i in range(1, 9)]
        await per_worker(service.url, "cells", lambda v: sum(v.values()) >= 9)
        fork = await ask(service.url, "POST", f"/v1/sessions/{sid}/fork")
        assert fork.status_code == 201, fork.text
        fid = fork.json()["session_id"]
        assert (await cell(service.url, fid, "n"))["value"] == "8"
        listed = {s["session_id"] for s in (await ask(service.url, "GET", "/v1/sessions")).json()["sessions"]}
        assert listed == {sid, fid}
        assert (await ask(service.url, "GET", f"/v1/sessions/{sid}")).status_code == 200
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as stranger:
            assert (await stranger.get(f"/v1/sessions/{sid}", headers={
                "x-codeenv-session-key": "somebody-else-entirely"})).status_code == 404
        assert (await ask(service.url, "DELETE", f"/v1/sessions/{fid}")).status_code == 204
        assert (await cell(service.url, fid, "n"))["http"] == 410
        assert (await ask(service.url, "POST", "/v1/sessions/nonsense/fork")).status_code == 404
        await siblings_and_a_snapshot_route(service.url, sid)
        await a_chosen_id_routes(service.url)

        # The pool process SIGKILLed (as a dead worker): its sessions die with it, and once the
        # supervisor has restarted it, their ids answer 410 from every gateway process.
        pool_pid = _pool_process(service.pid)
        assert pool_pid is not None
        os.kill(pool_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (lost := await cell(service.url, sid, "n"))["http"] != 410:
            assert lost["status"] in ("overloaded", "internal_error"), lost  # the pool process is away
            assert time.monotonic() < deadline, lost
            await asyncio.sleep(0.2)
        assert lost["status"] == "session_lost" and "restarted" in lost["message"], lost
        assert (await ask(service.url, "POST", "/v1/sessions", {"profile": "light"})).status_code == 201
    finally:
        assert await service.stop_async(60) in (0, -15)


def _tag(session_id: str) -> str:
    return session_id.split(".", 1)[0]


@pytest.mark.jail
@pytest.mark.redis
@pytest.mark.slow
async def test_with_redis_sessions_live_on_their_worker_and_die_with_it(redis_server: Service, tmp_path: Path) -> None:
    prefix = os.urandom(6).hex()
    workers = [WorkerProcess(redis_server, prefix, tmp_path / f"w{i}.log", slots=1) for i in range(2)]
    for w in workers:
        w.env["CODEENV_SESSION_DRAIN_S"] = "4"
    await asyncio.gather(*(w.start() for w in workers))
    gateway = start_codeenv("serve", "--redis", redis_server.url, "--no-local-worker", "--processes", "2",
                            "--log-level", "warning", port=free_port(), env=workers[0].env, log=tmp_path / "gw.log")
    url = gateway.url
    try:
        await wait_for_workers(redis_server, prefix, 2)
        await gateway.await_ready(120)
        # Each gateway process sees both workers (its view refreshes every SNAPSHOT_EVERY_S): before
        # that, one that saw only the first worker sent every new session there.
        await per_worker(url, "session_room", lambda v: len(v) == 2)
        await asyncio.sleep(SNAPSHOT_EVERY_S * 1.5)
        # Spread over both workers, each holding its own: every cell reaches its session's worker.
        sessions = []
        for _ in range(4):
            made = await ask(url, "POST", "/v1/sessions", {"profile": "light"})
            assert made.status_code == 201, made.text
            sessions.append(made.json()["session_id"])
        by_worker = Counter(_tag(s) for s in sessions)
        assert len(by_worker) == 2, by_worker
        held = await per_worker(url, "sessions", lambda v: sum(v.values()) == 4 and len(v) == 2)
        assert sorted(held.values()) == sorted(by_worker.values())
        for i, sid in enumerate(sessions):
            assert (await cell(url, sid, f"n = {10 * i}"))["status"] == "ok"
        for i, sid in enumerate(sessions):
            assert await counts_from_every_process(url, sid, 3) == [str(10 * i + k) for k in (1, 2, 3)]
        fork = await ask(url, "POST", f"/v1/sessions/{sessions[0]}/fork")
        assert fork.status_code == 201 and _tag(fork.json()["session_id"]) == _tag(sessions[0]), fork.text
        listed = {s["session_id"] for s in (await ask(url, "GET", "/v1/sessions")).json()["sessions"]}
        assert listed == {*sessions, fork.json()["session_id"]}
        # Each worker's figures reach the gateway in its heartbeat: /metrics and the live page's data.
        await per_worker(url, "sessions_created", lambda v: sorted(v.values()) == sorted(
            [by_worker[_tag(sessions[0])] + 1, by_worker[next(t for t in by_worker if t != _tag(sessions[0]))]]))
        assert list((await per_worker(url, "up", lambda v: len(v) == 2)).values()) == [1, 1]
        seen = (await ask(url, "GET", "/v1/live")).json()["workers"]
        assert len(seen) == 2 and all(w["slots"] == 1 and w["up"] == 1 and w["calls_run"] >= 1 and
                                      0 <= w["heartbeat_age_s"] <= DEAD_AFTER_S and w["memory_bytes"] > 0
                                      for w in seen.values()), seen
        again = {"code": "n += 100; n", "cell_id": "the-same-cell"}  # a retried cell runs once, whoever takes it
        first = (await ask(url, "POST", f"/v1/sessions/{sessions[1]}/execute", again)).json()
        second = (await ask(url, "POST", f"/v1/sessions/{sessions[1]}/execute", again)).json()
        assert first["value"] == second["value"] == "113"
        assert (await ask(url, "GET", f"/v1/sessions/{_tag(sessions[0])}.0.1.{'A' * 24}")).status_code == 404
        await a_chosen_id_routes(url)

        # A worker SIGKILLed mid-cell: its sessions answer 410 soon; the other's go on.
        doomed_tag = _tag(sessions[0])
        doomed = [s for s in sessions if _tag(s) == doomed_tag]
        kept = [s for s in sessions if _tag(s) != doomed_tag]
        victim = next(w for w in workers if _owns(w, doomed_tag))
        running = asyncio.ensure_future(cell(url, doomed[0], "import time; time.sleep(60)"))
        await asyncio.sleep(1.5)
        victim.kill()
        killed_at = time.monotonic()
        answer = await asyncio.wait_for(running, DEAD_AFTER_S + 10)
        assert answer["http"] == 410 and answer["status"] == "session_lost", answer
        assert time.monotonic() - killed_at <= DEAD_AFTER_S + 2
        later = await cell(url, doomed[-1], "n")
        assert later["http"] == 410 and later["status"] == "session_lost", later
        assert (await ask(url, "POST", f"/v1/sessions/{doomed[-1]}/fork")).status_code == 410
        assert (await cell(url, kept[0], "n"))["status"] == "ok"
        assert (await ask(url, "POST", "/v1/execute", {"code": "print(6 * 7)"})).json()["stdout"] == "42\n"

        # Its replacement: the old ids still answer 410, never another session's state.
        replacement = WorkerProcess(redis_server, prefix, tmp_path / "w2.log", slots=1)
        replacement.env["CODEENV_SESSION_DRAIN_S"] = "4"
        workers.append(replacement)
        await replacement.start()
        await wait_for_workers(redis_server, prefix, 2)
        assert (await cell(url, doomed[-1], "n"))["http"] == 410

        # A draining worker serves its live sessions (and takes no new one), then ends them.
        survivor = next(w for w in workers[:2] if w is not victim)
        assert survivor.service is not None
        os.kill(survivor.service.pid, signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert (await cell(url, kept[0], "n += 1; n"))["status"] == "ok"
        for _ in range(3):
            made = await ask(url, "POST", "/v1/sessions", {"profile": "light"})
            assert made.status_code == 201 and _tag(made.json()["session_id"]) == _owns_tag(replacement), made.text
        assert await survivor.stop() == 0
        assert (await cell(url, kept[0], "n"))["http"] == 410
    finally:
        await gateway.stop_async(60)
        for w in workers:
            if w.service is not None and w.service.returncode is None:
                await w.stop()


def _owns_tag(worker: WorkerProcess) -> str:
    """The tag of a worker process (the last part of its name, in its start line)."""
    found = re.findall(r"worker [^ ]+:(\d+):([0-9a-f]{12})", worker.log.read_text())
    assert found, worker.log.read_text()[-2000:]
    return found[-1][1]


def _owns(worker: WorkerProcess, tag: str) -> bool:
    return _owns_tag(worker) == tag
