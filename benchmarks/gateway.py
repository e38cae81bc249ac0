"""The HTTP gateway (embedded and Redis Streams) against the slot pool called directly, in one run.

    python benchmarks/gateway.py [--slots N] [--rounds R] [--json out.json]

Throughput of `print(1)` in batches of 32 from 8 concurrent clients, through `codeenv serve` (a real
uvicorn process, real HTTP on 127.0.0.1), through `codeenv serve --redis` (a private redis-server,
the worker in the gateway's process) and through `SlotPool.run` in this process; single-call
round-trip p50 over HTTP against a bare `python3 -c pass`; and the server's (and Redis's) CPU per
call (from /proc). The two take turns, round after round; figures are medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.bench.services import start_codeenv, start_redis

CLIENTS, BATCH, BATCHES_PER_CLIENT = 8, 32, 8


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def direct_throughput(pool: SlotPool) -> float:
    async def client() -> None:
        for _ in range(BATCHES_PER_CLIENT):
            await asyncio.gather(*(pool.run(ExecRequest(code="print(1)")) for _ in range(BATCH)))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return CLIENTS * BATCHES_PER_CLIENT * BATCH / (time.perf_counter() - t0)


async def http_throughput(c: httpx.AsyncClient, server_pid: int) -> tuple[float, float]:
    body = {"requests": [{"code": "print(1)"}] * BATCH}

    async def client() -> None:
        for _ in range(BATCHES_PER_CLIENT):
            r = await c.post("/v1/execute/batch", json=body)
            r.raise_for_status()

    cpu0, t0 = _cpu_s(server_pid), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    calls = CLIENTS * BATCHES_PER_CLIENT * BATCH
    return calls / (time.perf_counter() - t0), (_cpu_s(server_pid) - cpu0) / calls


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18931, help="embedded gateway; +1: Redis gateway, +2: Redis")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    redis_server = start_redis(args.port + 2)
    serve = ["serve", "--slots", str(args.slots), "--log-level", "warning"]
    servers = {
        "http": start_codeenv(*serve, port=args.port),
        # Redis Streams with the worker in the gateway's process: one pool, as in the embedded case.
        "redis": start_codeenv(*serve, "--redis", redis_server.url, port=args.port + 1),
    }
    samples: dict[str, list[float]] = {}
    try:
        async with httpx.AsyncClient(base_url=servers["http"].url, timeout=120) as c, \
                httpx.AsyncClient(base_url=servers["redis"].url, timeout=120) as rc, \
                SlotPool(SandboxSettings(slots=args.slots)) as pool:
            for server in servers.values():
                await server.await_ready(90)
            for _ in range(args.rounds):
                samples.setdefault("direct_per_s", []).append(await direct_throughput(pool))
                for name, client in (("http", c), ("redis", rc)):
                    redis_cpu0 = _cpu_s(redis_server.pid)
                    per_s, cpu = await http_throughput(client, servers[name].pid)
                    samples.setdefault(f"{name}_per_s", []).append(per_s)
                    samples.setdefault(f"{name}_service_cpu_ms_per_call", []).append(1000 * cpu)
                    if name == "redis":
                        calls = CLIENTS * BATCHES_PER_CLIENT * BATCH
                        samples.setdefault("redis_db_cpu_ms_per_call", []).append(
                            1000 * (_cpu_s(redis_server.pid) - redis_cpu0) / calls)
                rtts = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    (await c.post("/v1/execute", json={"code": "print(1)"})).raise_for_status()
                    rtts.append(time.perf_counter() - t0)
                samples.setdefault("http_p50_ms", []).append(1000 * statistics.median(rtts))
                rtts = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    (await rc.post("/v1/execute", json={"code": "print(1)"})).raise_for_status()
                    rtts.append(time.perf_counter() - t0)
                samples.setdefault("redis_p50_ms", []).append(1000 * statistics.median(rtts))
                bare = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, "-c", "pass"], check=True)
                    bare.append(time.perf_counter() - t0)
                samples.setdefault("bare_python_ms", []).append(1000 * statistics.median(bare))
    finally:
        for server in servers.values():
            server.stop(60)
        redis_server.stop(10)
    figures = {k: statistics.median(v) for k, v in samples.items()}
    figures["http_vs_direct"] = figures["http_per_s"] / figures["direct_per_s"]
    figures["redis_vs_direct"] = figures["redis_per_s"] / figures["direct_per_s"]
    figures["http_p50_vs_bare_python"] = figures["http_p50_ms"] / figures["bare_python_ms"]
    for k, v in figures.items():
        console.print(f"{k}: [bold]{v:.2f}[/]")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "samples": samples}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
