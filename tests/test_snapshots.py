"""N siblings in one request, and snapshots that outlive their session (issue 37): POST
/v1/sessions/{id}/fork {"count": N}, POST /v1/sessions/{id}/snapshot, POST /v1/snapshots/{id}/fork,
DELETE /v1/snapshots/{id}; over HTTP in embedded and Redis mode (the `client` fixture), at the engine
for the budget, and through the Python client."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest

from codeenv import SlotPool
from codeenv.client import AsyncClient, Client
from codeenv.errors import SessionError, SessionErrorKind
from codeenv.models import ExecRequest
from codeenv.sandbox.outside.family import SNAPSHOT
from tests.conftest import Served

pytestmark = pytest.mark.jail


def owned(code: str, session: str, owner: bytes) -> ExecRequest:
    request = ExecRequest(code=code, session=session)
    request._owner = owner
    return request


def key() -> dict[str, str]:
    return {"X-Codeenv-Session-Key": f"snapshots-{uuid.uuid4().hex}"}


async def new_session(client: httpx.AsyncClient, headers: dict[str, str]) -> str:
    r = await client.post("/v1/sessions", json={"profile": "light"}, headers=headers)
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


async def cell(client: httpx.AsyncClient, sid: str, code: str, headers: dict[str, str]) -> dict[str, Any]:
    r = await client.post(f"/v1/sessions/{sid}/execute", json={"code": code}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    assert answer["status"] == "ok", answer
    return answer


async def test_a_fork_with_a_count_gives_n_independent_sessions(client: httpx.AsyncClient) -> None:
    mine = key()
    sid = await new_session(client, mine)
    await cell(client, sid, "x = [0]\nopen('f.txt', 'w').write('parent')", mine)
    r = await client.post(f"/v1/sessions/{sid}/fork", json={"count": 4}, headers=mine)
    assert r.status_code == 201, r.text
    made = r.json()
    assert len(set(made["session_ids"])) == 4 and [s["session_id"] for s in made["sessions"]] == made["session_ids"]
    assert all(s["kind"] == "session" and s["worker"] for s in made["sessions"])
    for i, fork in enumerate(made["session_ids"]):  # each from the parent's state, none sees another's
        await cell(client, fork, f"x.append({i + 1})\nopen('f.txt', 'a').write('{i}')", mine)
    values = [(await cell(client, f, "x, open('f.txt').read()", mine))["value"] for f in made["session_ids"]]
    assert values == [f"([0, {i + 1}], 'parent{i}')" for i in range(4)]
    assert (await cell(client, sid, "x, open('f.txt').read()", mine))["value"] == "([0], 'parent')"
    one = await client.post(f"/v1/sessions/{sid}/fork", headers=mine)  # without a count: one, as a session
    assert one.status_code == 201 and one.json()["kind"] == "session" and "session_ids" not in one.json()
    assert (await client.post(f"/v1/sessions/{sid}/fork", json={"count": 0}, headers=mine)).status_code == 422
    too_many = await client.post(f"/v1/sessions/{sid}/fork", json={"count": 1000}, headers=mine)
    assert too_many.status_code == 409 and "CODEENV_SESSION_FORKS_MAX" in too_many.text, too_many.text
    listed = (await client.get("/v1/sessions", headers=mine)).json()
    assert {s["session_id"] for s in listed["sessions"]} == {sid, one.json()["session_id"], *made["session_ids"]}
    assert all(s["worker"] and s["cpu_s"] >= 0 and s["memory_bytes"] is not None for s in listed["sessions"])
    assert (await client.delete(f"/v1/sessions/{sid}", headers=mine)).status_code == 204
    for fork in made["session_ids"]:  # forks live on after their parent
        await cell(client, fork, "x", mine)
        assert (await client.delete(f"/v1/sessions/{fork}", headers=mine)).status_code == 204
    await client.delete(f"/v1/sessions/{one.json()['session_id']}", headers=mine)


async def test_a_snapshot_is_forked_after_its_source_was_deleted(client: httpx.AsyncClient) -> None:
    mine = key()
    sid = await new_session(client, mine)
    await cell(client, sid, "base = 41\nopen('data.txt', 'w').write('prefix')", mine)
    r = await client.post(f"/v1/sessions/{sid}/snapshot", json={"ttl_s": 600}, headers=mine)
    assert r.status_code == 201, r.text
    snap = r.json()["snapshot_id"]
    assert r.headers["location"] == f"/v1/snapshots/{snap}" and 0 < r.json()["expires_in_s"] <= 600
    # What the session does after it, in its globals and in its dir, is not the snapshot's.
    await cell(client, sid, "base = 0\nopen('data.txt', 'w').write('changed')", mine)
    listed = (await client.get("/v1/sessions", headers=mine)).json()
    assert [s["snapshot_id"] for s in listed["snapshots"]] == [snap]
    assert listed["snapshots"][0]["memory_bytes"] is not None and listed["snapshots"][0]["worker"]
    assert [s["session_id"] for s in listed["sessions"]] == [sid]
    ran = await client.post(f"/v1/sessions/{snap}/execute", json={"code": "base"}, headers=mine)
    assert ran.status_code == 404, ran.text  # a snapshot runs no cell
    assert (await client.delete(f"/v1/sessions/{sid}", headers=mine)).status_code == 204

    r = await client.post(f"/v1/snapshots/{snap}/fork", json={"count": 2}, headers=mine)
    assert r.status_code == 201, r.text
    first, second = r.json()["session_ids"]
    assert (await cell(client, first, "base + 1, open('data.txt').read()", mine))["value"] == "(42, 'prefix')"
    await cell(client, first, "open('data.txt', 'w').write('mine')\nimport os\nos.remove('data.txt')", mine)
    assert (await cell(client, second, "base + 1, open('data.txt').read()", mine))["value"] == "(42, 'prefix')"
    one = await client.post(f"/v1/snapshots/{snap}/fork", headers=mine)  # after a fork removed its file
    assert one.status_code == 201, one.text
    assert (await cell(client, one.json()["session_id"], "open('data.txt').read()", mine))["value"] == "'prefix'"

    assert (await client.delete(f"/v1/snapshots/{snap}", headers=mine)).status_code == 204
    assert (await client.post(f"/v1/snapshots/{snap}/fork", headers=mine)).status_code == 410
    assert (await client.delete(f"/v1/snapshots/{snap}", headers=mine)).status_code == 410
    for fork in (first, second, one.json()["session_id"]):  # forks live on after their snapshot
        assert (await cell(client, fork, "base", mine))["value"] == "41"
        await client.delete(f"/v1/sessions/{fork}", headers=mine)


async def test_a_snapshot_ends_with_its_ttl_and_is_only_its_owners(client: httpx.AsyncClient) -> None:
    mine, theirs = key(), key()
    sid = await new_session(client, mine)
    await cell(client, sid, "secret = 'mine'", mine)
    r = await client.post(f"/v1/sessions/{sid}/snapshot", json={"ttl_s": 1}, headers=mine)
    assert r.status_code == 201, r.text
    snap = r.json()["snapshot_id"]
    assert (await client.post(f"/v1/snapshots/{snap}/fork", headers=theirs)).status_code == 404
    assert (await client.delete(f"/v1/snapshots/{snap}", headers=theirs)).status_code == 404
    assert (await client.post(f"/v1/sessions/{sid}/snapshot", headers=theirs)).status_code == 404
    assert (await client.get("/v1/sessions", headers=theirs)).json() == {"sessions": [], "snapshots": []}
    assert (await client.post(f"/v1/sessions/{snap}/fork", headers=mine)).status_code == 404  # not a session
    assert (await client.delete(f"/v1/sessions/{snap}", headers=mine)).status_code == 404
    bad = await client.post(f"/v1/sessions/{sid}/snapshot", json={"ttl_s": 0}, headers=mine)
    assert bad.status_code == 422, bad.text
    deadline = time.monotonic() + 10
    while (gone := await client.post(f"/v1/snapshots/{snap}/fork", headers=mine)).status_code == 201:
        await client.delete(f"/v1/sessions/{gone.json()['session_id']}", headers=mine)
        assert time.monotonic() < deadline, "the snapshot outlived its TTL"
        await asyncio.sleep(0.3)
    assert gone.status_code == 410 and "TTL" in gone.text, gone.text
    assert (await client.get("/v1/sessions", headers=mine)).json()["snapshots"] == []
    await cell(client, sid, "secret", mine)  # its session lives on
    await client.delete(f"/v1/sessions/{sid}", headers=mine)


async def test_the_budget_counts_snapshots(pool: SlotPool) -> None:
    """A snapshot holds a process, a cgroup and memory: it counts against the worker's most and the
    client's, and in the worker's figures."""
    m = pool.sessions
    assert m is not None
    owner = uuid.uuid4().bytes
    before = m.figures()["sessions"]
    s = await m.create("light", owner=owner)
    saved = m.client_max
    try:
        await pool.run(owned("x = bytearray(8 << 20)", s.id, owner))
        snap = await m.snapshot(s.id, owner, 600)
        assert snap.kind == SNAPSHOT and m.figures()["sessions"] == before + 2
        m.client_max = 3
        with pytest.raises(SessionError) as full:
            await m.forks(snap.id, owner, 2, SNAPSHOT)
        assert full.value.kind is SessionErrorKind.full
        [fork] = await m.forks(snap.id, owner, 1, SNAPSHOT)
        with pytest.raises(SessionError):
            await m.snapshot(s.id, owner)
        m.client_max = saved
        info = {i["session_id"]: i for i in m.describe(owner)}
        assert info[snap.id]["kind"] == "snapshot" and info[snap.id]["memory_bytes"] > 0
        assert (await pool.run(owned("len(x)", fork.id, owner))).value == str(8 << 20)
    finally:
        m.client_max = saved
        for sid in [i["session_id"] for i in m.describe(owner)]:
            session = m.sessions.get(sid)
            if session is not None:
                await m.delete(sid, owner, session.kind)
    assert m.figures()["sessions"] == before


async def test_the_client_forks_n_and_snapshots(served: Served) -> None:
    async with served() as url, AsyncClient(url) as client:
        async with client.session(profile="light") as s:
            await s.run("import random\nrandom.seed(3)\nacc = []")
            async with s.fork(count=3) as forks:
                results = await asyncio.gather(*(f.run(f"acc.append({i}); acc, random.random()")
                                                  for i, f in enumerate(forks)))
                assert [r.value.split("]")[0] for r in results if r.value] == ["([0", "([1", "([2"]
                assert len({r.value.split(", ")[-1] for r in results if r.value}) == 1  # one random state
            assert all(f.closed for f in forks)
            snap = await s.snapshot(ttl_s=300)
        async with snap:
            siblings = await client.from_snapshot(snap.id, count=2)
            assert [(await f.run("acc")).value for f in siblings] == ["[]", "[]"]
            for f in siblings:
                await f.close()
            async with snap.fork() as one:
                assert (await one.run("len(acc)")).value == "0"
        assert snap.closed

        def blocking() -> list[str | None]:
            with Client(url) as sync, sync.session(profile="light") as t:
                t.run("y = 5")
                with t.snapshot() as taken:
                    made = sync.from_snapshot_many(taken.id, 2) + t.forks(2)
                    values = [f.run("y * 2").value for f in made]
                    for f in made:
                        f.close()
                    return values

        assert await asyncio.to_thread(blocking) == ["10"] * 4
