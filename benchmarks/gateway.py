"""The HTTP gateway (embedded mode) against the slot pool called directly, in one run.

    python benchmarks/gateway.py [--slots N] [--rounds R] [--json out.json]

Throughput of `print(1)` in batches of 32 from 8 concurrent clients, through `codeenv serve` (a real
uvicorn process, real HTTP on 127.0.0.1) and through `SlotPool.run` in this process; single-call
round-trip p50 over HTTP against a bare `python3 -c pass`; and the gateway's CPU per call (from
/proc). The two take turns, round after round; figures are medians.
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
    parser.add_argument("--port", type=int, default=18931)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    base = SandboxSettings()
    env = dict(os.environ, CODEENV_UID_BASE=str(base.uid_base + 700))
    server = subprocess.Popen(
        [sys.executable, "-m", "codeenv.cli", "serve", "--port", str(args.port), "--slots", str(args.slots),
         "--log-level", "warning"], env=env, stderr=subprocess.DEVNULL)
    samples: dict[str, list[float]] = {}
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", timeout=120) as c, \
                SlotPool(SandboxSettings(slots=args.slots)) as pool:
            for _ in range(600):
                try:
                    if (await c.get("/readyz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            for _ in range(args.rounds):
                samples.setdefault("direct_per_s", []).append(await direct_throughput(pool))
                per_s, cpu = await http_throughput(c, server.pid)
                samples.setdefault("http_per_s", []).append(per_s)
                samples.setdefault("gateway_cpu_ms_per_call", []).append(1000 * cpu)
                rtts = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    (await c.post("/v1/execute", json={"code": "print(1)"})).raise_for_status()
                    rtts.append(time.perf_counter() - t0)
                samples.setdefault("http_p50_ms", []).append(1000 * statistics.median(rtts))
                bare = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    subprocess.run([sys.executable, "-c", "pass"], check=True)
                    bare.append(time.perf_counter() - t0)
                samples.setdefault("bare_python_ms", []).append(1000 * statistics.median(bare))
    finally:
        server.terminate()
        server.wait(60)
    figures = {k: statistics.median(v) for k, v in samples.items()}
    figures["http_vs_direct"] = figures["http_per_s"] / figures["direct_per_s"]
    figures["http_p50_vs_bare_python"] = figures["http_p50_ms"] / figures["bare_python_ms"]
    for k, v in figures.items():
        console.print(f"{k}: [bold]{v:.2f}[/]")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "samples": samples}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
