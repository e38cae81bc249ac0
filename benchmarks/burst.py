"""One RL step's worth of tool calls at once: 45,000 calls (the rStar2-Agent report's per-step figure).

    python benchmarks/burst.py [--calls 45000] [--batch 500] [--slots N] [--json out.json]

All batches are sent at once to `codeenv serve` (embedded) and to `codeenv serve --redis` (a private
redis-server; the worker in the gateway's process). Reported per mode: time to finish, calls/s,
status counts, the service's peak RSS (VmHWM), and for Redis its memory before, at the end of the
burst, and once the keys a burst leaves have expired (they all carry a TTL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import redis
from rich.console import Console
from rich.progress import Progress

from codeenv.bench.services import start_codeenv, start_redis
from codeenv.queue.redis_protocol import DONE_TTL_S


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


async def burst(port: int, calls: int, batch: int) -> tuple[float, Counter[str]]:
    statuses: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=calls // batch + 1)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1800, limits=limits) as c:
        with Progress() as progress:
            task = progress.add_task(f"{calls} calls", total=calls)

            async def send(n: int) -> None:
                body = {"requests": [{"code": f"print({n * batch + i})"} for i in range(batch)]}
                r = await c.post("/v1/execute/batch", json=body)
                r.raise_for_status()
                for i, x in enumerate(r.json()["results"]):
                    ok = x["status"] == "ok" and x["stdout"] == f"{n * batch + i}\n"
                    statuses[x["status"] if ok or x["status"] != "ok" else "wrong_output"] += 1
                progress.advance(task, batch)

            t0 = time.perf_counter()
            await asyncio.gather(*(send(n) for n in range(calls // batch)))
            return time.perf_counter() - t0, statuses


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=45_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--port", type=int, default=18951, help="gateway port; +1: Redis")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    figures: dict[str, dict[str, object]] = {}
    redis_server = start_redis(args.port + 1)
    db = redis.Redis(port=args.port + 1)
    try:
        for mode in ("embedded", "redis"):
            extra = ["--redis", redis_server.url] if mode == "redis" else []
            server = start_codeenv("serve", "--slots", str(args.slots), "--log-level", "warning", *extra,
                                   port=args.port)
            try:
                await server.await_ready(90)
                rss_before = _vm(server.pid, "VmRSS")
                mem_before = int(db.info("memory")["used_memory"]) if mode == "redis" else 0
                seconds, statuses = await burst(args.port, args.calls, args.batch)
                fig: dict[str, object] = {
                    "calls": sum(statuses.values()), "seconds": round(seconds, 1),
                    "calls_per_s": round(sum(statuses.values()) / seconds, 1), "statuses": dict(statuses),
                    "service_rss_before_mb": round(rss_before / 2**20, 1),
                    "service_peak_rss_mb": round(_vm(server.pid, "VmHWM") / 2**20, 1),
                }
                if mode == "redis":
                    fig["redis_used_memory_before_mb"] = round(mem_before / 2**20, 2)
                    fig["redis_used_memory_after_burst_mb"] = round(int(db.info("memory")["used_memory"]) / 2**20, 2)
                    fig["redis_peak_memory_mb"] = round(int(db.info("memory")["used_memory_peak"]) / 2**20, 2)
                    console.print(f"waiting {DONE_TTL_S + 5}s for the burst's keys to expire")
                    await asyncio.sleep(DONE_TTL_S + 5)
                    fig["redis_used_memory_after_expiry_mb"] = round(int(db.info("memory")["used_memory"]) / 2**20, 2)
                    fig["redis_keys_after_expiry"] = int(db.dbsize())
                figures[mode] = fig
                console.print(mode, fig)
            finally:
                server.stop(120)
    finally:
        db.close()
        redis_server.stop(10)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
