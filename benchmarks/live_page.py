"""The live page against the bench: does it show what the load generator sent and saw?

    python benchmarks/live_page.py [--rate 20] [--seconds 30] [--workload print] [--json out.json]
    python benchmarks/live_page.py --read-cost 1000 [--json out.json]

Starts a private redis-server, two `codeenv worker --redis` (one slot each) and `codeenv serve
--redis --no-local-worker --processes 2`, then runs `codeenv bench --mode rate` against the gateway
while reading GET /v1/live every 1.5 s, as the page does, and computes the page's figures as its
script does (live.js): calls/s done over 10 s windows (differences between readings), and p50/p99 of
queue wait, run time, overhead and end to end from the histograms' differences over the run
(interpolated inside a bucket, as Prometheus's histogram_quantile). Reported against the bench's own
figures: the generator's rate (the page's steady windows: within 10%), the bench's latency
percentiles (within 25%), and both workers' rows.

With `--read-cost N`: the data endpoint's cost alone, the gateway's own CPU (/proc) per GET /v1/live
over N reads one after another against an idle `codeenv serve` (the bound: 2 ms each), twice, in
turns with as many GET /readyz (what the HTTP path and a route cost without the page's data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from codeenv.bench.services import Service, free_port, start_codeenv, start_redis

EVERY_S = 1.5
WINDOW_S = 10.0


def quantile(le: list[float], counts: list[float], total: float, q: float) -> float | None:
    """live.js's quantile(): linear inside the bucket the rank falls in (inf past the last bound)."""
    if total <= 0:
        return None
    rank = q * total
    for i, (bound, count) in enumerate(zip(le, counts, strict=True)):
        if count >= rank:
            below, low = (counts[i - 1], le[i - 1]) if i else (0.0, 0.0)
            inside = count - below
            return low + (bound - low) * (rank - below) / inside if inside > 0 else bound
    return float("inf")


def window(first: dict[str, Any], last: dict[str, Any], key: str) -> tuple[list[float], list[float], float]:
    a, b = last["latency"][key], first["latency"][key]
    before = b["count"] or [0.0] * len(a["count"])  # no calls yet: no buckets
    return last["le"], [x - y for x, y in zip(a["count"], before, strict=True)], a["total"] - b["total"]


def done(reading: dict[str, Any]) -> float:
    return float(sum(reading["calls"].values()))


async def read_live(url: str, readings: list[dict[str, Any]], stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while not stop.is_set():
            readings.append((await http.get("/v1/live")).json())
            try:
                await asyncio.wait_for(stop.wait(), EVERY_S)
            except TimeoutError:
                pass
        readings.append((await http.get("/v1/live")).json())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CODEENV_SLOTS": "1"}
    started: list[Service] = []
    out = Path(tempfile.mkdtemp(prefix="codeenv-live-bench-"))
    try:
        redis = start_redis()
        started.append(redis)
        for i in range(2):
            started.append(start_codeenv("worker", "--redis", redis.url, env=env, log=out / f"worker{i}.log"))
        gateway = start_codeenv("serve", "--redis", redis.url, "--no-local-worker", "--processes", "2",
                                port=free_port(), env=env, log=out / "gateway.log")
        started.append(gateway)
        await asyncio.to_thread(gateway.wait_ready, 300)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as http:
            deadline = time.monotonic() + 60
            while len((await http.get("/v1/live")).json()["workers"]) < 2:
                assert time.monotonic() < deadline, "the gateway never saw both workers"
                await asyncio.sleep(0.5)
        readings: list[dict[str, Any]] = []
        stop = asyncio.Event()
        reader = asyncio.ensure_future(read_live(gateway.url, readings, stop))
        await asyncio.sleep(2 * EVERY_S)
        calls = int(args.rate * args.seconds)
        bench = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "codeenv.cli", "bench", "--target", gateway.url, "--mode", "rate",
            "--rate", str(args.rate), "--calls", str(calls), "--workload", args.workload, "--out", str(out),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        bench_start = time.time()
        # 1: a wrong answer (a math call near its limit timing out on these shared cores) or a
        # call the service did not run; the comparison holds for what was answered (reported below).
        assert await bench.wait() in (0, 1), f"the bench failed (see {out})"
        bench_end = time.time()
        await asyncio.sleep(2 * EVERY_S)
        stop.set()
        await reader
    finally:
        for s in reversed(started):
            s.stop(30)
    [report] = [json.loads(p.read_text()) for p in out.glob("bench-*.json")]
    [target] = report["targets"].values()
    # The page's calls/s: 10 s windows wholly inside the bench's steady part (its first and last
    # seconds ramp), as live.js computes them (the reading >= 10 s older).
    rates = []
    for i, now in enumerate(readings):
        then = next((r for r in reversed(readings[:i]) if now["time"] - r["time"] >= WINDOW_S), None)
        if then is not None and then["time"] >= bench_start + 1 and now["time"] <= bench_end - 1:
            rates.append((done(now) - done(then)) / (now["time"] - then["time"]))
    first, last = readings[0], readings[-1]
    page: dict[str, Any] = {"calls": done(last) - done(first), "calls_per_s_windows": [round(r, 2) for r in rates],
                            "worker_rows": len(last["workers"])}
    names = {"queue": "queue_wait_ms", "run": "run_time_ms", "overhead": "overhead_ms", "end_to_end": "latency_ms"}
    compared: dict[str, Any] = {}
    for key, bench_key in names.items():
        le, counts, total = window(first, last, key)
        for q in (0.5, 0.99):
            mine = quantile(le, counts, total, q)
            theirs = target[bench_key][f"p{int(q * 100)}"]
            compared[f"{key}_p{int(q * 100)}"] = {
                "page_ms": None if mine is None else round(1000 * mine, 3), "bench_ms": theirs,
                "ratio": None if mine is None or not theirs else round(1000 * mine / theirs, 3)}
    steady = statistics.median(rates) if rates else None
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": {"cores": os.cpu_count()},
            "setup": {"gateway_processes": 2, "redis_workers": 2, "slots_per_worker": 1, "workload": args.workload,
                      "rate": args.rate, "calls": calls},
            "bench": {"throughput_per_s": target["throughput_per_s"], "statuses": target["statuses"],
                      "calls_answered": target["calls_answered"], "correctness": target["correctness"],
                      "service_errors": target["service_errors"]},
            "page": page,
            "calls_per_s": {"generator": args.rate, "page_median_window": None if steady is None else round(steady, 3),
                            "ratio": None if steady is None else round(steady / args.rate, 3),
                            "page_windows_min_max": [round(min(rates), 3), round(max(rates), 3)] if rates else None},
            "latency": compared}


def gateway_pids(pid: int, processes: int) -> list[int]:
    """`codeenv serve`'s process, or under --processes N its N pool processes (its children that run
    Python; the slot pool's jails are theirs, not its)."""
    if processes == 1:
        return [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = [int(c) for c in children if b"python" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) >= processes, f"expected {processes} gateway processes under {pid}, found {found}"
    return found


def own_cpu_s(pid: int) -> float:
    """A process's own CPU time (user + system, every thread's), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def read_cost(reads: int, processes: int) -> dict[str, Any]:
    """The data endpoint's cost: the gateway's own CPU per GET /v1/live, `reads` of them one after
    another against an idle `codeenv serve` (embedded, 2 slots) that has answered a few calls; with
    `processes` > 1, every gateway process's CPU (each reads the others' files)."""
    gateway = start_codeenv("serve", "--slots", "2", "--log-level", "warning", "--processes", str(processes),
                            port=free_port())
    try:
        await asyncio.to_thread(gateway.wait_ready, 300)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            for code in ("print(1)", "1 / 0", "print(2)"):
                (await http.post("/v1/execute", json={"code": code})).raise_for_status()
            for _ in range(20):
                (await http.get("/v1/live")).raise_for_status()
            figures: dict[str, Any] = {"reads": reads, "processes": processes}
            for path in ("/v1/live", "/readyz", "/v1/live", "/readyz"):  # /readyz: the HTTP path and a route alone
                pids = gateway_pids(gateway.pid, processes)
                before, t0 = sum(map(own_cpu_s, pids)), time.monotonic()
                for _ in range(reads):
                    (await http.get(path)).raise_for_status()
                cpu, wall = sum(map(own_cpu_s, pids)) - before, time.monotonic() - t0
                figures.setdefault(path, {"gateway_cpu_ms_per_read": [], "wall_ms_per_read": []})
                figures[path]["gateway_cpu_ms_per_read"].append(round(1000 * cpu / reads, 3))
                figures[path]["wall_ms_per_read"].append(round(1000 * wall / reads, 3))
    finally:
        gateway.stop(30)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--workload", default="print")
    parser.add_argument("--read-cost", type=int, metavar="N",
                        help="measure only the data endpoint's cost: the gateway's CPU per read over N reads")
    parser.add_argument("--processes", type=int, default=1, help="with --read-cost: serve --processes N")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(read_cost(args.read_cost, args.processes) if args.read_cost else run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
