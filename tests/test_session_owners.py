"""A session belongs to its creator (issue 31): another client (another session key, or none) can
neither list, run in, fork, show nor delete it, and gets the answer an id that never existed gets;
no session id reaches a log line. A real `codeenv serve`, real HTTP, the real client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from codeenv.bench.services import Service
from codeenv.client import AsyncClient
from codeenv.models import SESSION_KEY_HEADER
from tests.conftest import start_service

pytestmark = pytest.mark.jail


async def test_another_client_cannot_list_run_in_fork_show_or_delete_a_session(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"  # with the access log on (level info)
    service = start_service("serve", "--slots", "1", "--log-level", "info", log=log)
    try:
        await service.await_ready()
        sid, s_id = await _try_to_reach_the_session(service)
    finally:
        await service.stop_async()  # its log is complete once it has exited
    text = log.read_text()
    assert "/v1/sessions/<id>/execute" in text, text[-3000:]
    assert s_id not in text and sid not in text, "a session id is in the log"


async def _try_to_reach_the_session(service: Service) -> tuple[str, str]:
    async with AsyncClient(service.url) as owner, AsyncClient(service.url) as other:
        assert owner.session_key != other.session_key
        async with owner.session(profile="light") as s:
            assert (await s.run("SECRET = 'sesame'")).status == "ok"
            path = f"/v1/sessions/{s.id}"
            mine = httpx.AsyncClient(base_url=service.url, headers={SESSION_KEY_HEADER: owner.session_key})
            theirs = httpx.AsyncClient(base_url=service.url, headers={SESSION_KEY_HEADER: other.session_key})
            nobody = httpx.AsyncClient(base_url=service.url)
            async with mine, theirs, nobody:
                never = await theirs.get("/v1/sessions/1a.1.AAAAAAAAAAAAAAAAAAAAAAAA")
                assert never.status_code == 404
                for c in (theirs, nobody):
                    assert (await c.get("/v1/sessions")).json() == {"sessions": [], "snapshots": []}
                    for method, suffix, body in (("GET", "", None), ("POST", "/execute", {"code": "SECRET"}),
                                                 ("POST", "/fork", None), ("POST", "/fork", {"count": 2}),
                                                 ("POST", "/snapshot", None), ("DELETE", "", None)):
                        got = await c.request(method, path + suffix, json=body)
                        assert got.status_code == 404, (method, suffix, got.text)
                        assert "sesame" not in got.text and got.json()["detail"].startswith("no session")
                    one = await c.post("/v1/execute", json={"code": "SECRET", "session": s.id})
                    assert one.status_code == 404 and "sesame" not in one.text
                    batch = await c.post("/v1/execute/batch", json={"requests": [{"code": "SECRET", "session": s.id}]})
                    [result] = batch.json()["results"]
                    assert result["status"] == "rejected" and "sesame" not in batch.text
                    stream = await c.post("/v1/execute/stream", json={"requests": [{"code": "SECRET",
                                                                                    "session": s.id}]})
                    assert '"rejected"' in stream.text and "sesame" not in stream.text
                assert (await theirs.get("/v1/sessions", headers={SESSION_KEY_HEADER: "short"})).status_code == 422
                # Its owner still has it, untouched, and alone in its listing.
                listed = (await mine.get("/v1/sessions")).json()["sessions"]
                assert [x["session_id"] for x in listed] == [s.id]
                assert (await s.run("SECRET")).value == "'sesame'"
                fork = await s.fork()
                assert (await fork.run("SECRET")).value == "'sesame'"
                assert (await theirs.get(f"/v1/sessions/{fork.id}")).status_code == 404
                await fork.close()
                # Without a key, creation makes one and says it; only that key reaches the session.
                made = await nobody.post("/v1/sessions", json={"profile": "light"})
                assert made.status_code == 201, made.text
                key, sid = made.json()["session_key"], made.json()["session_id"]
                assert (await nobody.get(f"/v1/sessions/{sid}")).status_code == 404
                assert (await theirs.delete(f"/v1/sessions/{sid}")).status_code == 404
                assert (await nobody.delete(f"/v1/sessions/{sid}", headers={SESSION_KEY_HEADER: key})).status_code \
                    == 204
    return sid, s.id
