"""What a client's own HTTP stack adds to a call's latency: the part of a bench's end-to-end time that
no gateway can see (issue 42: the live page counts from the gateway's receipt of a request to its
answer's sending).

    python benchmarks/client_floor.py [--requests 300] [--rounds 3] [--json out.json]

Against one `codeenv serve` (embedded, 2 slots, idle but for this process), one request at a time on
one keep-alive connection, in turns within each round:

- **raw**: the request's bytes written on a plain socket (TCP_NODELAY) and the answer read to its
  last byte: the floor of any client;
- **httpx sync**: `httpx.Client`;
- **httpx async**: `httpx.AsyncClient` on asyncio's own loop (what the codeenv client and most RL
  trainers' agent loops use), and on uvloop's where uvloop is installed;
- **aiohttp**: `aiohttp.ClientSession` on asyncio's loop (what `codeenv bench`'s generators use).

For `GET /healthz` (no work) and `POST /v1/execute` of `print(1)`. Reported: each client's p50 per
round, the median over rounds, and each one's excess over raw (what the client itself costs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from codeenv.bench.services import free_port, start_codeenv

BODY = json.dumps({"code": "print(1)"}).encode()


class Raw:
    """HTTP/1.1 on a plain socket: write the request, read headers and Content-Length bytes."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        host = f"Host: 127.0.0.1:{port}\r\n"
        self.get = f"GET /healthz HTTP/1.1\r\n{host}\r\n".encode()
        self.post = (f"POST /v1/execute HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
                     f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY

    def request(self, data: bytes) -> bytes:
        self.sock.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got:
            got += self.sock.recv(65536)
        head, body = got.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += self.sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200"), head
        return body

    def close(self) -> None:
        self.sock.close()


def p50_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def timed(n: int, one: Callable[[], object]) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        one()
        samples.append(time.perf_counter() - t0)
    return p50_ms(samples)


async def timed_async(n: int, one: Callable[[], Awaitable[object]]) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await one()
        samples.append(time.perf_counter() - t0)
    return p50_ms(samples)


async def async_round(url: str, n: int) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(20):  # connected and warm
            (await client.get("/healthz")).raise_for_status()
        return {"healthz": await timed_async(n, lambda: client.get("/healthz")),
                "execute": await timed_async(n, lambda: client.post("/v1/execute", content=BODY,
                                                                   headers={"content-type": "application/json"}))}


async def aiohttp_round(url: str, n: int) -> dict[str, float]:
    import aiohttp

    async def get() -> bytes:
        async with session.get("/healthz") as response:
            return await response.read()

    async def post() -> bytes:
        async with session.post("/v1/execute", data=BODY, headers={"content-type": "application/json"}) as response:
            return await response.read()

    async with aiohttp.ClientSession(base_url=url) as session:
        for _ in range(20):
            await get()
        return {"healthz": await timed_async(n, get), "execute": await timed_async(n, post)}


def one_round(url: str, port: int, n: int) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    raw = Raw(port)
    try:
        for _ in range(20):
            raw.request(raw.get)
        figures["raw"] = {"healthz": timed(n, lambda: raw.request(raw.get)),
                          "execute": timed(n, lambda: raw.request(raw.post))}
    finally:
        raw.close()
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(20):
            client.get("/healthz").raise_for_status()
        figures["httpx sync"] = {"healthz": timed(n, lambda: client.get("/healthz")),
                                 "execute": timed(n, lambda: client.post("/v1/execute", content=BODY,
                                                                         headers={"content-type": "application/json"}))}
    figures["httpx async (asyncio)"] = asyncio.run(async_round(url, n))
    try:
        import uvloop
    except ImportError:
        pass
    else:
        figures["httpx async (uvloop)"] = uvloop.run(async_round(url, n))
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        pass
    else:
        figures["aiohttp (asyncio)"] = asyncio.run(aiohttp_round(url, n))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    port = free_port()
    server = start_codeenv("serve", "--slots", "2", "--log-level", "warning", port=port)
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        asyncio.run(server.await_ready(90))
        for _ in range(args.rounds):
            rounds.append(one_round(server.url, port, args.requests))
    finally:
        server.stop(30)
    medians: dict[str, Any] = {}
    for client in rounds[0]:
        medians[client] = {route: round(statistics.median(r[client][route] for r in rounds), 3)
                           for route in rounds[0][client]}
    excess = {client: {route: round(ms - medians["raw"][route], 3) for route, ms in figures.items()}
              for client, figures in medians.items() if client != "raw"}
    result = {"requests": args.requests, "rounds": rounds, "p50_ms": medians, "over_raw_ms": excess}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
