"""Simulated multi-turn trajectories through verl's tool interface, with codeenv as the code tool.

    scripts/codeenv serve &                                   # in another shell
    .venv/bin/python examples/verl_multiturn.py [--url http://127.0.0.1:8000] [--trajectories 8]

Each trajectory stands in for a model solving "the sum of the primes below N" in a few turns: a
first attempt (sometimes buggy, sometimes a runaway loop), then a fix after reading the feedback.
Every turn goes through `codeenv.integrations.verl.CodeenvTool` exactly as verl's tool agent loop
calls a tool (create, execute with the trajectory's `agent_data`, release), built by verl's own
tool registry from `examples/verl_config/codeenv_tool.yaml`. At the end each trajectory's ledger (what
GRPO-RoC reads, from the extra fields the tool wrote, as `codeenv.rl.ledgers_from_batch` reads them
from verl's batch) and the tool's metrics are printed.

It needs verl's tool modules: with verl installed (`pip install verl`), or `--from-wheel`, which
loads them from verl's PyPI wheel without torch (the test suite's loader, tests/frameworks.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

FIRST_TRIES = [
    "n = {n}\nprint(sum(p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))))",
    "n = {n}\nprimes = [p for p in range(2, n) if all(p % d for d in range(2, p))]\nprint(sum(primes)",  # typo
    "n = {n}\ns, p = 0, 2\nwhile p < n:\n    s += p\nprint(s)",  # never ends: the tool stops it
    "import sympy\nprint(sum(sympy.primerange(2, {n})))",
]
FIX = "import sympy\nprint(sum(sympy.primerange(2, {n})))"


def load_verl(from_wheel: bool) -> None:
    if from_wheel:
        sys.path.insert(0, str(ROOT))
        from tests.frameworks import load_verl as load

        load()


async def trajectory(tool: Any, k: int, rng: random.Random) -> tuple[list[str], dict[str, Any]]:
    n = rng.choice([100, 1000, 10_000, 50_000])
    agent_data = SimpleNamespace(request_id=f"trajectory-{k}", extra_fields={})  # as verl's AgentData
    turns = [rng.choice(FIRST_TRIES), FIX]
    seen = []
    for code in turns:
        await asyncio.sleep(rng.uniform(0, 0.3))  # the model thinks
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response, _, metrics = await tool.execute(instance_id, {"code": code.format(n=n)}, agent_data=agent_data)
        finally:
            await tool.release(instance_id)
        seen.append(f"  [{metrics['status']}, {metrics['cpu_s']:.3f}s CPU] {response.text.strip()[:90]!r}")
        if metrics["status"] == "ok":
            break
    return seen, agent_data.extra_fields


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--from-wheel", action="store_true", help="load verl's tool modules from its wheel")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    load_verl(args.from_wheel)
    from verl.tools.tool_registry import initialize_tools_from_config

    config = (ROOT / "examples" / "verl_config" / "codeenv_tool.yaml").read_text().replace("http://127.0.0.1:8000", args.url)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(config.replace("wall_s: 5", "wall_s: 2"))
        f.flush()
        [tool] = initialize_tools_from_config(f.name)
    rng = random.Random(args.seed)
    from codeenv.rl import ledgers_from_batch

    logs = await asyncio.gather(*(trajectory(tool, k, rng) for k in range(args.trajectories)))
    ledgers = ledgers_from_batch([extra_fields for _, extra_fields in logs])  # as from verl's batch
    for k, ((lines, _), ledger) in enumerate(zip(logs, ledgers, strict=True)):
        print(f"trajectory {k}: {ledger.calls} calls, {ledger.tool_errors} tool errors, "
              f"{ledger.service_faults} service faults, tool-error ratio {ledger.tool_error_ratio}")
        print("\n".join(lines))


if __name__ == "__main__":
    asyncio.run(main())
