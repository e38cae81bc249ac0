"""A host function's round trip from a cell, against a direct HTTP call from the host.

    python benchmarks/host_calls.py [--calls 300] [--rounds 5] [--json out.json]

An echo endpoint (http.server in a process of its own, on 127.0.0.1) answers every call. In each
round, one after another:

- **from a cell**: one session cell (a SlotPool in this process, the `light` profile) calls its host
  function `echo` `--calls` times in a loop, timing each call with `time.perf_counter()` inside the
  jail: cell -> supervisor -> worker -> HTTP -> worker -> supervisor -> cell;
- **direct**: this process POSTs the same body to the same endpoint `--calls` times with httpx (one
  keep-alive connection, as the worker's client keeps), timed the same way.

Reported per round: p50 and p90 of each, and their ratio (cell / direct); then the median and spread
of the ratios. The worker's share is the difference: two extra hops over Unix sockets, the checks
and the accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.bench.services import free_port
from codeenv.models import HostFunctions

ENDPOINT = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: without it, 40 ms (delayed ACK)

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps(json.loads(body)["args"]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""

CELL = """
import time
times = []
for i in range({calls}):
    t0 = time.perf_counter()
    echo(i)
    times.append(time.perf_counter() - t0)
times
"""


def quantiles(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"p50_ms": round(1000 * ordered[len(ordered) // 2], 3),
            "p90_ms": round(1000 * ordered[int(len(ordered) * 0.9)], 3)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    endpoint = subprocess.Popen([sys.executable, "-c", ENDPOINT, str(port)])
    url = f"http://127.0.0.1:{port}/echo"
    rounds: list[dict[str, Any]] = []
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            for _ in range(100):  # until it listens
                try:
                    await http.post(url, json={"args": [0]})
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
        async with SlotPool(SandboxSettings(slots=1)) as pool:
            manager = pool.sessions
            assert manager is not None
            host = HostFunctions.model_validate({"functions": {"echo": {"url": url}},
                                                 "budget": {"cell_calls": args.calls, "session_calls": 10**6}})
            session = await manager.create("light", host=host)
            request = ExecRequest(code=CELL.format(calls=args.calls), session=session.id,
                                  limits={"wall_s": 120, "cpu_s": 120})
            await manager.execute(request.model_copy(update={"code": "echo(0)"}), time.monotonic())  # warm
            async with httpx.AsyncClient(trust_env=False) as http:
                for _ in range(args.rounds):
                    result = await manager.execute(request, time.monotonic())
                    assert result.status.value == "ok" and result.value is not None, result
                    from_cell = [float(x) for x in result.value.strip("[]").split(",")]
                    direct = []
                    for i in range(args.calls):
                        body = {"function": "echo", "args": [i], "kwargs": {}, "session_id": session.id}
                        t0 = time.perf_counter()
                        answer = await http.post(url, json=body)
                        answer.json()
                        direct.append(time.perf_counter() - t0)
                    cell_q, direct_q = quantiles(from_cell), quantiles(direct)
                    rounds.append({"from_cell": cell_q, "direct": direct_q,
                                   "ratio_p50": round(cell_q["p50_ms"] / direct_q["p50_ms"], 3)})
                    print(rounds[-1], flush=True)
            await manager.delete(session.id)
    finally:
        endpoint.terminate()
        endpoint.wait()
    ratios = [r["ratio_p50"] for r in rounds]
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "calls_per_round": args.calls, "rounds": rounds,
            "ratio_p50": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "from_cell_p50_ms": statistics.median(r["from_cell"]["p50_ms"] for r in rounds),
            "direct_p50_ms": statistics.median(r["direct"]["p50_ms"] for r in rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
