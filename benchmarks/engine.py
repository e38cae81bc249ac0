"""The slot pool against the two designs it replaces, measured in one run on this machine.

    (a) naive:        a fresh `python3 -c CODE` per call, no jail (the rStar2-Agent paper's service)
    (b) naive-jail:   a fresh nsjail + `python3 -c CODE` per call (the naive secure design)
    (c) codeenv:      the slot pool (warm zygotes in reused jails, a fork per call)

(a) and (b) are `codeenv.bench.baseline`, the baselines `codeenv bench --target naive` runs, called
here without the gateway.

For each: throughput with every slot busy, for `print(1)` and for a sympy factorisation; single-call
p50 latency; and the time from dispatch to the first line of user code. All three use the same
interpreter and the same packages (the built image's), and the baselines run as many calls at once
as the pool has slots.

    python benchmarks/engine.py [--slots N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.bench.baseline import BaselineQueue, host_python_env
from codeenv.sandbox.image import ensure_image

PRINT = "print(1)"
SYMPY = "import sympy\nprint(sympy.factorint(2**64 - 1))"
FIRST_LINE = "import time\nprint(repr(time.time()))"

Runner = Callable[[str], Awaitable[str]]


async def subprocess_runner(argv_prefix: list[str], env: dict[str, str]) -> Runner:
    async def run(code: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            *argv_prefix, code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env)
        out, _ = await proc.communicate()
        return out.decode()
    return run


def queue_runner(queue: BaselineQueue | SlotPool) -> Runner:
    async def run(code: str) -> str:
        if isinstance(queue, SlotPool):
            return (await queue.run(ExecRequest(code=code))).stdout
        [result] = await queue.submit([ExecRequest(code=code)])
        return result.stdout
    return run


async def throughput(run: Runner, code: str, calls: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            await run(code)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    return calls / (time.perf_counter() - t0)


async def latency_p50(run: Runner, code: str, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await run(code)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def first_line_p50(run: Runner, calls: int) -> float:
    samples = []
    for _ in range(calls):
        t0 = time.time()
        out = await run(FIRST_LINE)
        samples.append(float(out.strip()) - t0)
    return statistics.median(samples)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply call counts")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per figure")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    console = Console()
    settings = SandboxSettings(slots=args.slots)
    image = ensure_image(settings, progress=lambda m: console.print(f"image: {m}"))
    n = lambda k: max(4, int(k * args.scale))  # noqa: E731

    # (a) and (b): the naive designs `codeenv bench` measures too (codeenv.bench.baseline), each on
    # as many calls at once as the pool has slots.
    baselines = {design: BaselineQueue(design, settings) for design in ("naive", "naive-jail")}
    host_python, env = host_python_env(image)
    bare = await subprocess_runner([host_python, "-c"], env)
    console.print(f"measuring on {os.cpu_count()} cores, {args.slots} slots, {args.rounds} alternating rounds ...")
    samples: dict[str, dict[str, list[float]]] = {}

    def record(name: str, metric: str, value: float) -> None:
        samples.setdefault(name, {}).setdefault(metric, []).append(value)

    for queue in baselines.values():
        await queue.start()
    try:
        async with SlotPool(settings) as pool:
            pooled = queue_runner(pool)
            await throughput(pooled, SYMPY, 20, args.slots)  # warm-up
            # The machine is shared and noisy: the designs take turns, round after round, and each
            # figure is the median of its rounds, so drift hits all three alike.
            for _ in range(args.rounds):
                record("bare python3 -c pass", "p50_ms", 1000 * await latency_p50(bare, "pass", n(20)))
                for name, run, big in (("naive", queue_runner(baselines["naive"]), False),
                                       ("naive-jail", queue_runner(baselines["naive-jail"]), False),
                                       ("codeenv", pooled, True)):
                    concurrency = 10_000 if big else args.slots
                    record(name, "print_per_s", await throughput(run, PRINT, n(1500 if big else 60), concurrency))
                    record(name, "sympy_per_s", await throughput(run, SYMPY, n(400 if big else 8), concurrency))
                    record(name, "p50_ms", 1000 * await latency_p50(run, PRINT, n(200 if big else 20)))
                    record(name, "first_line_ms", 1000 * await first_line_p50(run, n(200 if big else 20)))
    finally:
        for queue in baselines.values():
            await queue.close()
    figures = {name: {m: statistics.median(v) for m, v in metrics.items()} for name, metrics in samples.items()}

    c, a, b = figures["codeenv"], figures["naive"], figures["naive-jail"]
    table = Table(title=f"slot pool vs. per-call interpreters ({args.slots} slots, {os.cpu_count()} cores)")
    for col in ("", "print(1)/s", "sympy/s", "p50 ms", "dispatch→first line ms"):
        table.add_column(col, justify="right")
    for name in ("naive", "naive-jail", "codeenv"):
        f = figures[name]
        table.add_row(name, f"{f['print_per_s']:.0f}", f"{f['sympy_per_s']:.1f}", f"{f['p50_ms']:.2f}",
                      f"{f['first_line_ms']:.2f}")
    console.print(table)
    ratios = {
        "print vs naive": c["print_per_s"] / a["print_per_s"],
        "print vs naive-jail": c["print_per_s"] / b["print_per_s"],
        "sympy vs naive": c["sympy_per_s"] / a["sympy_per_s"],
        "p50 vs bare python3 -c pass": c["p50_ms"] / figures["bare python3 -c pass"]["p50_ms"],
    }
    for k, v in ratios.items():
        console.print(f"{k}: [bold]{v:.2f}x[/]")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "ratios": ratios, "samples": samples}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
