"""Problem packages (issue 39): a 40-test problem judged by reference against sent inline, per submission.

    python benchmarks/problems.py [--rounds 5] [--tests 40] [--test-kb 256] [--group 8] [--json out.json]

A real `codeenv serve` (embedded mode, every core). A problem of `--tests` tests, each an input of
about `--test-kb` KiB of integers and its sum as the answer (CodeContests-O averages 40 tests and
~61 MB a problem; the default is a smaller one of ~10 MB). Each round judges a GRPO group of
`--group` submissions at once (a Python program summing its input), sent as `/v1/judge` requests
with the tests inline, then as requests naming the uploaded package; the two alternate in order
round by round. Reported: per submission wall time (the group's wall over its size) by reference
over inline, the bytes each request sent, the upload's one-off time, and the gateway's RSS growth.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

SUM = "import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))\n"


def spread(samples: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(samples), 3), "min": round(min(samples), 3),
            "max": round(max(samples), 3), "rounds": len(samples)}


def problem_of(tests: int, test_kb: int) -> dict[str, Any]:
    rng = random.Random(39)
    cases = []
    for _ in range(tests):
        numbers = [rng.randrange(10**6) for _ in range(test_kb * 1024 // 7)]
        cases.append({"stdin": " ".join(map(str, numbers)) + "\n", "expected_stdout": f"{sum(numbers)}\n"})
    return {"tests": cases, "limits": {"cpu_s": 5, "memory_mb": 512}}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tests", type=int, default=40)
    parser.add_argument("--test-kb", type=int, default=256)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from codeenv.bench.services import free_port, start_codeenv

    problem = problem_of(args.tests, args.test_kb)
    body = json.dumps(problem).encode()
    sha = hashlib.sha256(body).hexdigest()
    service = start_codeenv("serve", "--log-level", "warning", port=free_port())
    samples: dict[str, list[float]] = {"inline_s": [], "by_reference_s": []}
    sent: dict[str, int] = {}
    try:
        await service.await_ready(180)
        assert service.url is not None and service.pid is not None
        async with httpx.AsyncClient(base_url=service.url, timeout=600) as client:
            async def group(tag: str, by_reference: bool) -> float:
                def request(i: int) -> bytes:
                    code = f"{SUM}# {tag} {i}\n"
                    fields = {"code": code, "problem": sha} if by_reference else {"code": code, **problem}
                    return json.dumps(fields).encode()

                payloads = [request(i) for i in range(args.group)]
                sent["by_reference" if by_reference else "inline"] = len(payloads[0])
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(client.post(
                    "/v1/judge", content=p, headers={"content-type": "application/json"}) for p in payloads))
                wall = time.perf_counter() - t0
                for a in answers:
                    assert a.status_code == 200 and a.json()["status"] == "passed", a.text[:500]
                return wall / args.group

            rss0 = rss_kb(service.pid)
            t0 = time.perf_counter()
            put = await client.put(f"/v1/problems/{sha}", content=body, headers={"content-type": "application/json"})
            upload_s = time.perf_counter() - t0
            assert put.status_code in (200, 201), put.text
            await group("warm", True)
            await group("warm", False)
            for r in range(args.rounds):
                for by_reference in ((True, False) if r % 2 == 0 else (False, True)):
                    key = "by_reference_s" if by_reference else "inline_s"
                    samples[key].append(await group(f"{key}{r}", by_reference))
            rss1 = rss_kb(service.pid)
    finally:
        service.stop(60)
    ratios = [a / b for a, b in zip(samples["by_reference_s"], samples["inline_s"], strict=True)]
    result = {"tests": args.tests, "package_bytes": len(body), "group": args.group, "rounds": args.rounds,
              "request_bytes": sent, "upload_s": round(upload_s, 3),
              "gateway_rss_growth_mb": round((rss1 - rss0) / 1024),
              "samples": {k: [round(x, 4) for x in v] for k, v in samples.items()},
              "medians_per_submission_s": {k: round(statistics.median(v), 4) for k, v in samples.items()},
              "by_reference_over_inline": spread(ratios)}
    Console().print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
