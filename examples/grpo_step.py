"""One simulated GRPO-RoC step against a running codeenv, on a CPU machine.

    scripts/codeenv serve &                  # in another shell
    .venv/bin/python examples/grpo_step.py [--url http://127.0.0.1:8000] [--prompts 8] [--group 4]

P prompts x 2G rollouts; each rollout is a short "trajectory" of tool calls (sympy, brute force,
now and then a bug or a runaway loop) made through the micro-batching client, then a final answer
checked against the prompt's. RoC keeps G rollouts per prompt, GRPO advantages are computed over
them, and the step's statistics are printed: tool-error ratio before and after RoC, calls/s,
latency, HTTP requests used.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import numpy as np

from codeenv.client import AsyncClient, format_feedback
from codeenv.rl import Rollout, ToolLedger, grpo_advantages, resample_on_correct

# Toy prompts: "the number of divisors of N", answered by a tool call.
PROMPTS = [360, 1001, 2**10, 9973, 5040, 123456, 65536, 99991, 720720, 30030, 4096, 1_000_000]


def divisors(n: int) -> int:
    return sum(1 for d in range(1, n + 1) if n % d == 0)


def tool_calls(n: int, rng: random.Random) -> list[tuple[str, dict[str, float]]]:
    """What a sampled trajectory does: 1-3 tool calls, some of them bad."""
    choices = [
        (f"import sympy\nprint(sympy.divisor_count({n}))", {}),
        (f"print(sum(1 for d in range(1, {n} + 1) if {n} % d == 0))", {}),
        (f"import sympy\nprint(len(sympy.divisors({n}))", {}),  # a syntax error
        ("while True:\n    pass", {"wall_s": 0.5}),  # a runaway loop
        (f"print({n} // 0)", {}),  # a crash
    ]
    weights = [5, 3, 1, 1, 1]
    return [rng.choices(choices, weights)[0] for _ in range(rng.randint(1, 3))]


async def trajectory(client: AsyncClient, n: int, rng: random.Random, latencies: list[float]) -> Rollout:
    ledger = ToolLedger()
    answer: int | None = None
    for code, limits in tool_calls(n, rng):
        t0 = time.perf_counter()
        result = await client.run(code, limits=limits, ledger=ledger)
        latencies.append(time.perf_counter() - t0)
        format_feedback(result)  # what the model would read next
        if result.status == "ok" and result.stdout.strip().isdigit():
            answer = int(result.stdout)
    if rng.random() < 0.15:
        answer = None  # the model ignored its tool
    return Rollout(reward=1.0 if answer == divisors(n) else 0.0, ledger=ledger)


def error_ratio(rollouts: list[Rollout]) -> float:
    calls = sum(r.ledger.calls - r.ledger.service_faults for r in rollouts)
    return sum(r.ledger.tool_errors for r in rollouts) / calls if calls else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="G: rollouts kept per prompt (2G are sampled)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    latencies: list[float] = []
    async with AsyncClient(args.url) as client:
        t0 = time.perf_counter()
        groups = await asyncio.gather(*(
            asyncio.gather(*(trajectory(client, n, random.Random(rng.random()), latencies)
                             for _ in range(2 * args.group)))
            for n in prompts))
        elapsed = time.perf_counter() - t0
        requests = client.requests_sent
    np_rng = np.random.default_rng(args.seed)
    kept: list[Rollout] = []
    advantages: list[float] = []
    dropped = 0
    for group in groups:
        keep = resample_on_correct(group, args.group, rng=np_rng)
        if keep is None:
            dropped += 1
            continue
        chosen = [group[i] for i in keep]
        kept += chosen
        advantages += grpo_advantages([r.reward for r in chosen]).tolist()
    sampled = [r for g in groups for r in g]
    calls = len(latencies)
    print(f"rollouts: {len(sampled)} sampled, {len(kept)} kept by RoC, {dropped} groups dropped (all equal)")
    print(f"tool calls: {calls} in {elapsed:.2f}s ({calls / elapsed:.0f}/s) over {requests} HTTP requests")
    print(f"latency: p50 {1000 * statistics.median(latencies):.1f} ms, max {1000 * max(latencies):.1f} ms")
    print(f"tool-error ratio: {error_ratio(sampled):.3f} sampled -> {error_ratio(kept):.3f} kept")
    print(f"accuracy: {statistics.mean(r.reward for r in sampled):.3f} sampled -> "
          f"{statistics.mean(r.reward for r in kept) if kept else 0:.3f} kept")
    if advantages:
        print(f"advantages: mean {statistics.mean(advantages):+.3f}, "
              f"min {min(advantages):+.2f}, max {max(advantages):+.2f}")


if __name__ == "__main__":
    asyncio.run(main())
