"""A whole problem in one judge call against one request per test, in one run.

    python benchmarks/judge.py [--tests 50] [--submissions 40] [--rounds 5] [--slots N] [--json out.json]

One `codeenv serve` (a real uvicorn process, embedded pool). A stdin problem of `--tests` tests,
each a few milliseconds of CPU; `--submissions` submissions of it (correct and wrong alternating),
judged two ways, taking turns round by round:

- judge: each submission is one POST /v1/judge;
- per test: each submission's tests go as concurrent POST /run_code requests (SandboxFusion's API,
  what verl's, SkyRL's and rLLM's reward functions send), the outputs compared here.

Both keep as many submissions in flight as the service has slots. The figure is submissions judged
per second; the ratio judge / per test is reported per round (median, min, max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from codeenv.bench.services import start_codeenv
from codeenv.compare import same_output
from codeenv.models import Compare

SOLUTION = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(x * x for x in xs) % 1000003)"
WRONG = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(x * x for x in xs[1:]) % 1000003)"


def problem(tests: int, seed: int = 7) -> list[dict[str, str]]:
    r = random.Random(seed)
    out = []
    for _ in range(tests):
        xs = [r.randint(-1000, 1000) for _ in range(r.randint(1, 3000))]
        out.append({"stdin": f"{len(xs)}\n{' '.join(map(str, xs))}",
                    "expected_stdout": f"{sum(x * x for x in xs) % 1000003}\n"})
    return out


async def judged(client: httpx.AsyncClient, code: str, tests: list[dict[str, str]]) -> int:
    r = await client.post("/v1/judge", json={"code": code, "tests": tests, "limits": {"cpu_s": 2}})
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    assert body["status"] in ("passed", "failed"), body
    return int(body["passed"])


async def per_test(client: httpx.AsyncClient, code: str, tests: list[dict[str, str]]) -> int:
    async def one(test: dict[str, str]) -> bool:
        r = await client.post("/run_code", json={"code": code, "stdin": test["stdin"], "language": "python",
                                                 "run_timeout": 2})
        r.raise_for_status()
        run = r.json().get("run_result") or {}
        return run.get("status") == "Finished" and same_output(run.get("stdout") or "", test["expected_stdout"],
                                                                 Compare.lines, 1e-6)

    return sum(await asyncio.gather(*(one(t) for t in tests)))


async def rate(url: str, how: str, submissions: int, tests: list[dict[str, str]], in_flight: int) -> float:
    fn = judged if how == "judge" else per_test
    limits = httpx.Limits(max_connections=in_flight * len(tests), max_keepalive_connections=in_flight * len(tests))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await fn(client, SOLUTION, tests[:2])  # connected and warm
        gate = asyncio.Semaphore(in_flight)

        async def submission(i: int) -> int:
            async with gate:
                return await fn(client, SOLUTION if i % 2 == 0 else WRONG, tests)

        t0 = time.perf_counter()
        passed = await asyncio.gather(*(submission(i) for i in range(submissions)))
        elapsed = time.perf_counter() - t0
    assert passed[0] == len(tests) and passed[1] < len(tests), passed[:2]
    return submissions / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=50)
    parser.add_argument("--submissions", type=int, default=40)
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=18962)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tests = problem(args.tests)
    server = start_codeenv("serve", "--slots", str(args.slots), "--log-level", "warning", port=args.port)
    samples: dict[str, list[float]] = {"judge": [], "per_test": []}
    try:
        await server.await_ready(90)
        for r in range(args.rounds):
            order = ["judge", "per_test"] if r % 2 == 0 else ["per_test", "judge"]
            for how in order:
                samples[how].append(await rate(server.url, how, args.submissions, tests, args.slots))
    finally:
        server.stop(60)
    ratios = [j / p for j, p in zip(samples["judge"], samples["per_test"], strict=True)]
    figures = {"judge_submissions_per_s": statistics.median(samples["judge"]),
               "per_test_submissions_per_s": statistics.median(samples["per_test"]),
               "ratio": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                         "max": round(max(ratios), 3), "rounds": len(ratios)}}
    console = Console()
    console.print(f"{args.tests} tests per submission, {args.submissions} submissions, {args.slots} slots")
    console.print(f"judge: [bold]{figures['judge_submissions_per_s']:.2f}[/] submissions/s; per test: "
                  f"[bold]{figures['per_test_submissions_per_s']:.2f}[/]; ratio {figures['ratio']}")
    if args.json:
        args.json.write_text(json.dumps({"tests": args.tests, "submissions": args.submissions, "slots": args.slots,
                                         "figures": figures, "samples": samples}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
