"""Requests a web page in a browser on the same machine could forge: refused with a 4xx that says
what to change; the same calls with the right headers run. The gateway's own checks: its queue is
tests.fakes.FakeQueue, which records the calls that reach it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from tests.conftest import GatewayClient
from tests.fakes import FakeQueue

pytestmark = pytest.mark.unit

CALL = b'{"code": "print(6 * 7)"}'
TOKEN = "a-token-of-sixteen-chars"


@pytest.fixture
def queue() -> FakeQueue:
    return FakeQueue()


@pytest.fixture
def browser(gateway: GatewayClient, queue: FakeQueue) -> Any:
    """`browser(base_url, **settings)`: a client of the gateway over `queue`, as a page on `base_url` sees it."""

    @asynccontextmanager
    async def make(base_url: str = "http://127.0.0.1:8000", **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
        async with gateway(queue=queue, base_url=base_url, **settings) as client:
            yield client

    return make


def ran(queue: FakeQueue, code: str = "print(1)") -> bool:
    """Whether the last call that reached the queue is `code`."""
    return bool(queue.calls) and queue.calls[-1].code == code


@pytest.mark.parametrize(("content_type", "path"), [
    ("text/plain", "/v1/execute"),                            # fetch() with a string body: no preflight
    ("application/x-www-form-urlencoded", "/v1/execute"),     # a form post (and curl -d without -H)
    ("multipart/form-data; boundary=x", "/v1/execute/batch"),
    (None, "/run_code"),                                      # no type at all (a Blob body)
    ("text/plain;charset=UTF-8", "/run"),
])
async def test_json_endpoints_take_only_json(browser: Any, queue: FakeQueue, content_type: str | None,
                                             path: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    async with browser() as client:
        r = await client.post(path, content=CALL, headers=headers)
        assert r.status_code == 415, r.text
        assert "Content-Type: application/json" in r.json()["detail"] and not queue.calls
        ok = await client.post("/v1/execute", content=CALL, headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200 and ran(queue, "print(6 * 7)")


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:9999", "https://127.0.0.1:8000"])
async def test_pages_of_other_origins_are_refused(browser: Any, queue: FakeQueue, origin: str) -> None:
    async with browser() as client:
        r = await client.post("/v1/execute", json={"code": "print(1)"}, headers={"origin": origin})
        assert r.status_code == 403 and "CODEENV_ALLOWED_ORIGINS" in r.json()["detail"], r.text
        r = await client.get("/healthz", headers={"origin": origin})
        assert r.status_code == 403 and not queue.calls


async def test_its_own_origin_and_allowed_origins_are_accepted(browser: Any, queue: FakeQueue) -> None:
    async with browser(allowed_origins=["https://notebook.example"]) as client:
        for origin in ("http://127.0.0.1:8000", "https://notebook.example"):
            r = await client.post("/v1/execute", json={"code": "print(1)"}, headers={"origin": origin})
            assert r.status_code == 200 and ran(queue), (origin, r.text)


@pytest.mark.parametrize("host", ["evil.example:8000", "evil.example", "192.0.2.7:8000"])
async def test_a_rebound_host_is_refused_without_a_token(browser: Any, queue: FakeQueue, host: str) -> None:
    async with browser() as client:
        # DNS rebinding: the page's own name resolves to 127.0.0.1; its requests carry that name.
        r = await client.post("/v1/execute", json={"code": "print(1)"}, headers={"host": host})
        assert r.status_code == 403 and "CODEENV_ALLOWED_HOSTS" in r.json()["detail"], r.text
        r = await client.get("/healthz", headers={"host": host})
        assert r.status_code == 403 and not queue.calls


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000",
                                      "http://sandbox.internal:8000"])
async def test_its_own_names_are_accepted(browser: Any, queue: FakeQueue, base_url: str) -> None:
    async with browser(base_url, allowed_hosts=["sandbox.internal"]) as client:
        r = await client.post("/v1/execute", json={"code": "print(1)"})
        assert r.status_code == 200 and ran(queue), r.text


async def test_with_a_token_service_names_work(browser: Any, queue: FakeQueue) -> None:
    # Compose and Kubernetes reach the gateway by service name: with a token, the token protects it.
    async with browser("http://codeenv-gateway:8000", token=TOKEN) as client:
        auth = {"authorization": f"Bearer {TOKEN}"}
        r = await client.post("/v1/execute", json={"code": "print(1)"}, headers=auth)
        assert r.status_code == 200 and ran(queue), r.text
        assert (await client.post("/v1/execute", json={"code": "print(2)"})).status_code == 401
        # A page still cannot post a form to it, token or not.
        r = await client.post("/v1/execute", content=CALL, headers={**auth, "content-type": "text/plain"})
        assert r.status_code == 415 and len(queue.calls) == 1
