"""Slow clients (issue 31): a request body that stalls, or trickles, is answered 408 and its
connection closed after `body_timeout_s`; one gateway process serves at most `max_connections`
connections at once (503 beyond). A real `codeenv serve`, raw sockets."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from codeenv.bench.services import Service
from tests.conftest import start_service

pytestmark = pytest.mark.jail

BODY_TIMEOUT_S = 1
MAX_CONNECTIONS = 4
#: A POST whose body says 1,000 bytes and brings 7.
PARTIAL = (b"POST /v1/execute HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: 1000\r\n\r\n{\"code\"")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("slow") / "serve.log"
    served = start_service("serve", "--slots", "1", "--log-level", "warning", log=log,
                           CODEENV_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S), CODEENV_MAX_CONNECTIONS=str(MAX_CONNECTIONS))
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


def connect(service: Service, first: bytes) -> socket.socket:
    assert service.port is not None
    s = socket.create_connection(("127.0.0.1", service.port), timeout=10)
    s.sendall(first)
    return s


def answer_and_close(s: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and after how long."""
    t0 = time.monotonic()
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got, time.monotonic() - t0


def test_a_stalled_body_is_answered_408_and_its_connection_closed(service: Service) -> None:
    with connect(service, PARTIAL) as s:
        got, after_s = answer_and_close(s)
    assert got.startswith(b"HTTP/1.1 408"), got[:300]
    assert b"body_timeout_s" in got and after_s < BODY_TIMEOUT_S + 3, after_s


def test_a_trickling_body_is_dropped_as_well(service: Service) -> None:
    with connect(service, PARTIAL) as s:
        s.settimeout(0.3)
        t0, got = time.monotonic(), b""
        while time.monotonic() - t0 < BODY_TIMEOUT_S + 5:  # a byte every 0.3 s keeps no timer from firing
            try:
                s.sendall(b" ")
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset: it was closed
                break
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 408"), got[:300]
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3


def test_connections_past_the_cap_get_503_until_the_stalled_ones_are_dropped(service: Service) -> None:
    stalled = [connect(service, PARTIAL) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # they are accepted (no event to wait on from here)
        refused = httpx.get(f"{service.url}/healthz", timeout=10)
        assert refused.status_code == 503, refused.text
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + BODY_TIMEOUT_S + 5
    while httpx.get(f"{service.url}/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not serve again after its stalled clients left"
        time.sleep(0.05)
    ok = httpx.post(f"{service.url}/v1/execute", json={"code": "print(1)"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["stdout"] == "1\n"


def test_stalled_clients_are_dropped_without_closing_them_first(service: Service) -> None:
    stalled = [connect(service, PARTIAL) for _ in range(MAX_CONNECTIONS - 1)]  # the last one is 503 already
    try:
        for s in stalled:  # each is answered 408 and closed by the server, by itself
            got, _ = answer_and_close(s)
            assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert httpx.get(f"{service.url}/healthz", timeout=10).status_code == 200
    finally:
        for s in stalled:
            s.close()
