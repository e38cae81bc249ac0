"""Requests a web page in a browser on the same machine could forge: refused with a 4xx that says
what to change; the same calls with the right headers run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from codeenv import SlotPool
from codeenv.api import create_app
from codeenv.settings import GatewaySettings
from tests.test_api import SharedPoolQueue

pytestmark = pytest.mark.jail

CALL = b'{"code": "print(6 * 7)"}'
TOKEN = "a-token-of-sixteen-chars"


@asynccontextmanager
async def gateway(pool: SlotPool, base_url: str = "http://127.0.0.1:8000",
                  **settings: object) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewaySettings(slots=2, **settings)  # type: ignore[arg-type]
    app = create_app(config, SharedPoolQueue(pool, config.max_queued))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as client:
        yield client


@pytest.mark.parametrize(("content_type", "path"), [
    ("text/plain", "/v1/execute"),                            # fetch() with a string body: no preflight
    ("application/x-www-form-urlencoded", "/v1/execute"),     # a form post (and curl -d without -H)
    ("multipart/form-data; boundary=x", "/v1/execute/batch"),
    (None, "/run_code"),                                      # no type at all (a Blob body)
    ("text/plain;charset=UTF-8", "/run"),
])
async def test_json_endpoints_take_only_json(pool: SlotPool, content_type: str | None, path: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    async with gateway(pool) as client:
        r = await client.post(path, content=CALL, headers=headers)
        assert r.status_code == 415, r.text
        assert "Content-Type: application/json" in r.json()["detail"]
        ok = await client.post("/v1/execute", content=CALL, headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200 and ok.json()["stdout"] == "42\n"


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:9999", "https://127.0.0.1:8000"])
async def test_pages_of_other_origins_are_refused(pool: SlotPool, origin: str) -> None:
    async with gateway(pool) as client:
        r = await client.post("/v1/execute", json={"code": "print(1)"}, headers={"origin": origin})
        assert r.status_code == 403 and "CODEENV_ALLOWED_ORIGINS" in r.json()["detail"], r.text
        r = await client.get("/healthz", headers={"origin": origin})
        assert r.status_code == 403


async def test_its_own_origin_and_allowed_origins_are_accepted(pool: SlotPool) -> None:
    async with gateway(pool, allowed_origins=["https://notebook.example"]) as client:
        for origin in ("http://127.0.0.1:8000", "https://notebook.example"):
            r = await client.post("/v1/execute", json={"code": "print(1)"}, headers={"origin": origin})
            assert r.status_code == 200 and r.json()["stdout"] == "1\n", (origin, r.text)


@pytest.mark.parametrize("host", ["evil.example:8000", "evil.example", "192.0.2.7:8000"])
async def test_a_rebound_host_is_refused_without_a_token(pool: SlotPool, host: str) -> None:
    async with gateway(pool) as client:
        # DNS rebinding: the page's own name resolves to 127.0.0.1; its requests carry that name.
        r = await client.post("/v1/execute", json={"code": "print(1)"}, headers={"host": host})
        assert r.status_code == 403 and "CODEENV_ALLOWED_HOSTS" in r.json()["detail"], r.text
        r = await client.get("/healthz", headers={"host": host})
        assert r.status_code == 403


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000",
                                      "http://sandbox.internal:8000"])
async def test_its_own_names_are_accepted(pool: SlotPool, base_url: str) -> None:
    async with gateway(pool, base_url, allowed_hosts=["sandbox.internal"]) as client:
        r = await client.post("/v1/execute", json={"code": "print(1)"})
        assert r.status_code == 200 and r.json()["stdout"] == "1\n", r.text


async def test_with_a_token_service_names_work(pool: SlotPool) -> None:
    # Compose and Kubernetes reach the gateway by service name: with a token, the token protects it.
    async with gateway(pool, "http://codeenv-gateway:8000", token=TOKEN) as client:
        auth = {"authorization": f"Bearer {TOKEN}"}
        r = await client.post("/v1/execute", json={"code": "print(1)"}, headers=auth)
        assert r.status_code == 200 and r.json()["stdout"] == "1\n", r.text
        assert (await client.post("/v1/execute", json={"code": "print(1)"})).status_code == 401
        # A page still cannot post a form to it, token or not.
        r = await client.post("/v1/execute", content=CALL, headers={**auth, "content-type": "text/plain"})
        assert r.status_code == 415
