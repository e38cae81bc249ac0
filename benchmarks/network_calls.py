"""What a call that touches the network costs the calls after it (security review finding 9).

The review's attack: two clients send short calls that import scipy and send one UDP datagram to
loopback, while a third measures its `print(1)`. Before, each such call recycled its jail (a
restart and a fresh preload, 1.3 to 3 s of the slot's time); now the zygote makes a fresh network
namespace. Measured in one run, on one pool: the victim's latency alone, then beside the attack
(the phases alternate, round after round), and the pool's restart counter. And the issue's own
measure, with no queueing in it: on one slot, the latency of a `print(1)` right after a call that
sent a datagram, against one right after a call that did not (the pairs alternate).

    python benchmarks/network_calls.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from rich.console import Console

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.sandbox.image import ensure_image

VICTIM = "print(1)"
ATTACK = "import scipy, socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))"


async def victim_latencies(pool: SlotPool, n: int, attack: bool) -> list[float]:
    """`n` victim calls, one at a time, each timed; with `attack`, two clients send ATTACK calls
    back to back meanwhile."""
    stop = asyncio.Event()
    attacks = 0

    async def attacker() -> None:
        nonlocal attacks
        while not stop.is_set():
            result = await pool.run(ExecRequest(code=ATTACK, profile="scientific"))
            assert result.status == "ok", result
            attacks += 1

    tasks = [asyncio.create_task(attacker()) for _ in range(2 if attack else 0)]
    samples = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            result = await pool.run(ExecRequest(code=VICTIM, profile="light"))
            samples.append(time.perf_counter() - t0)
            assert result.stdout == "1\n", result
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    return samples


NETWORK = "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))"
PLAIN = "import socket"


async def next_latencies(pool: SlotPool, n: int) -> tuple[list[float], list[float]]:
    """On slot 0, `n` pairs of each kind, alternating: NETWORK then a timed VICTIM, PLAIN then a timed
    VICTIM (the victim meets the namespace the first call left, or its renewal)."""
    after: dict[str, list[float]] = {NETWORK: [], PLAIN: []}
    for i in range(2 * n):
        first = NETWORK if i % 2 == 0 else PLAIN
        result = await pool.run(ExecRequest(code=first, profile="light"), slot_index=0)
        assert result.status == "ok", result
        t0 = time.perf_counter()
        result = await pool.run(ExecRequest(code=VICTIM, profile="light"), slot_index=0)
        after[first].append(time.perf_counter() - t0)
        assert result.stdout == "1\n", result
    return after[NETWORK], after[PLAIN]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="victim calls per phase")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console()
    settings = SandboxSettings(slots=2)
    ensure_image(settings, progress=lambda m: console.print(f"image: {m}"))
    alone: list[float] = []
    beside: list[float] = []
    ratios: list[float] = []
    after_network: list[float] = []
    after_plain: list[float] = []
    next_ratios: list[float] = []
    async with SlotPool(settings) as pool:
        await victim_latencies(pool, 10, attack=True)  # warm-up
        start = pool.restarts
        for i in range(args.rounds):
            a = await victim_latencies(pool, args.calls, attack=False)
            b = await victim_latencies(pool, args.calls, attack=True)
            alone += a
            beside += b
            ratios.append(statistics.median(b) / statistics.median(a))
            net, plain = await next_latencies(pool, args.calls)
            after_network += net
            after_plain += plain
            next_ratios.append(statistics.median(net) / statistics.median(plain))
            console.print(f"round {i + 1}: victim p50 alone {1000 * statistics.median(a):.1f} ms, "
                          f"beside the attack {1000 * statistics.median(b):.1f} ms; next on its slot after "
                          f"a network call {1000 * statistics.median(net):.1f} ms, after a plain one "
                          f"{1000 * statistics.median(plain):.1f} ms")
        restarts = pool.restarts - start
    figures = {
        "victim_p50_ms_alone": round(1000 * statistics.median(alone), 2),
        "victim_p50_ms_beside_attack": round(1000 * statistics.median(beside), 2),
        "victim_max_ms_beside_attack": round(1000 * max(beside), 2),
        "ratio_p50_median": round(statistics.median(ratios), 2),
        "ratio_p50_min_max": [round(min(ratios), 2), round(max(ratios), 2)],
        "restarts": restarts,
        "next_p50_ms_after_network": round(1000 * statistics.median(after_network), 2),
        "next_p50_ms_after_plain": round(1000 * statistics.median(after_plain), 2),
        "next_ratio_p50_median": round(statistics.median(next_ratios), 2),
        "next_ratio_p50_min_max": [round(min(next_ratios), 2), round(max(next_ratios), 2)],
    }
    console.print(figures)
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "calls_per_phase": args.calls,
                                         "figures": figures}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
