"""What the trainer-side client costs: overhead per call at 5,000 concurrent calls, and one call on
an idle service through the client against a direct HTTP request.

    python benchmarks/client.py [--calls 5000] [--slots N] [--rounds R] [--json out.json]

Against `codeenv serve` (a real uvicorn process, embedded pool). Overhead per call = latency
through the client - the queue wait and run time the service reports for it, so what is left is
batching, HTTP, encoding and the event loops. The idle single-call comparison takes turns with a
plain httpx POST /v1/execute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Console

from codeenv.bench.services import start_codeenv
from codeenv.client import AsyncClient


async def burst(url: str, calls: int, **options: float) -> dict[str, float]:
    async with AsyncClient(url, **options) as client:  # type: ignore[arg-type]
        await client.run("pass")  # connected, as a trainer's client is after its first call
        async def one(i: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            result = await client.run(f"print({i})")
            latency = time.perf_counter() - t0
            assert result.stdout == f"{i}\n", result
            return latency, latency - result.queue_s - result.wall_s

        t0 = time.perf_counter()
        measured = await asyncio.gather(*(one(i) for i in range(calls)))
        elapsed = time.perf_counter() - t0
        overheads = sorted(m[1] for m in measured)
        return {"calls_per_s": calls / elapsed, "requests": client.requests_sent - 1,
                "overhead_p50_ms": 1000 * overheads[len(overheads) // 2],
                "overhead_p90_ms": 1000 * overheads[int(len(overheads) * 0.9)],
                "latency_p50_ms": 1000 * statistics.median(m[0] for m in measured)}


async def idle(url: str, n: int = 50) -> dict[str, float]:
    through, direct = [], []
    async with AsyncClient(url) as client, httpx.AsyncClient(base_url=url) as plain:
        for _ in range(n):
            t0 = time.perf_counter()
            await client.run("print(1)")
            through.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            (await plain.post("/v1/execute", json={"code": "print(1)"})).raise_for_status()
            direct.append(time.perf_counter() - t0)
    return {"idle_client_p50_ms": 1000 * statistics.median(through),
            "idle_direct_p50_ms": 1000 * statistics.median(direct)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18961)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = start_codeenv("serve", "--slots", str(args.slots), "--log-level", "warning", port=args.port)
    url = server.url
    samples: dict[str, list[float]] = {}
    try:
        await server.await_ready(90)
        for _ in range(args.rounds):
            for key, value in (await burst(url, args.calls) | await idle(url)).items():
                samples.setdefault(key, []).append(value)
    finally:
        server.stop(60)
    figures = {k: statistics.median(v) for k, v in samples.items()}
    figures["idle_client_vs_direct"] = figures["idle_client_p50_ms"] / figures["idle_direct_p50_ms"]
    console = Console()
    for k, v in figures.items():
        console.print(f"{k}: [bold]{v:.2f}[/]")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "samples": samples}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
