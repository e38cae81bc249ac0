"""What a bench sends and when: GRPO-shaped rollouts, fixed concurrency, or an open-loop rate.

- ``grpo``: each step starts P prompts x G samples at once; each sample is a trajectory of 1..T
  tool calls, and before each call the model "thinks" for a gap drawn from a distribution. A step
  ends when its last trajectory ends (the step's makespan), and only then does the next begin:
  the way a rollout phase of GRPO waits for its slowest sample.
- ``concurrency``: N calls, C in flight at any time (closed loop: saturation).
- ``rate``: N calls sent at R calls/s whatever the answers (open loop); evenly spaced or Poisson.
  Latency is measured from each call's scheduled send time.

The plan is made up front from a seed, so every round and every target gets the same traffic; it
is split across generator processes by trajectory (or by call).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Think:
    """A thinking-gap distribution: ``2`` (constant), ``0-2`` (uniform), ``exp:1.5`` (exponential mean)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Think:
        text = text.strip()
        if m := re.fullmatch(r"exp:(\d+(?:\.\d*)?)", text):
            return cls("exp", float(m[1]))
        if m := re.fullmatch(r"(\d+(?:\.\d*)?)\s*-\s*(\d+(?:\.\d*)?)", text):
            low, high = float(m[1]), float(m[2])
            if high < low:
                raise ValueError(f"think range {text!r}: the upper bound is below the lower one")
            return cls("uniform", low, high)
        if m := re.fullmatch(r"\d+(?:\.\d*)?", text):
            return cls("const", float(text))
        raise ValueError(f"think gap {text!r}: write a number of seconds (2), a range (0-2) or exp:MEAN (exp:1)")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "exp":
            return rng.expovariate(1 / self.a) if self.a > 0 else 0.0
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        return self.a

    def __str__(self) -> str:
        return {"exp": f"exp:{self.a:g}", "uniform": f"{self.a:g}-{self.b:g}"}.get(self.kind, f"{self.a:g}")


@dataclass(frozen=True, slots=True)
class Scenario:
    mode: str = "grpo"
    prompts: int = 8
    samples: int = 8
    turns: int = 4
    steps: int = 3
    think: Think = Think("uniform", 0.0, 2.0)
    concurrency: int = 32
    calls: int = 400
    rate: float = 10.0
    poisson: bool = False
    seed: int = 0

    def describe(self) -> str:
        if self.mode == "grpo":
            return (f"GRPO: {self.steps} steps x {self.prompts} prompts x {self.samples} samples, up to "
                    f"{self.turns} tool calls per trajectory, thinking {self.think} s before each")
        if self.mode == "concurrency":
            return f"saturation: {self.calls} calls, {self.concurrency} in flight"
        return f"open loop: {self.calls} calls at {self.rate:g}/s ({'Poisson' if self.poisson else 'evenly spaced'})"


#: One call to make: (step, trajectory, turn, workload index, think gap before it or send offset).
Item = tuple[int, int, int, int, float]


def plan(scenario: Scenario, workload_size: int) -> list[Item]:
    """Every call of the scenario, in order; the same for the same scenario and workload size."""
    rng = random.Random(scenario.seed)
    order = list(range(workload_size))
    rng.shuffle(order)
    items: list[Item] = []
    n = 0
    if scenario.mode == "grpo":
        for step in range(scenario.steps):
            for traj in range(scenario.prompts * scenario.samples):
                for turn in range(rng.randint(1, scenario.turns)):
                    items.append((step, traj, turn, order[n % workload_size], scenario.think.draw(rng)))
                    n += 1
    elif scenario.mode == "concurrency":
        items = [(0, i, 0, order[i % workload_size], 0.0) for i in range(scenario.calls)]
    elif scenario.mode == "rate":
        t = 0.0
        for i in range(scenario.calls):
            items.append((0, i, 0, order[i % workload_size], t))
            t += rng.expovariate(scenario.rate) if scenario.poisson else 1 / scenario.rate
    else:
        raise ValueError(f"unknown mode {scenario.mode!r}")
    return items


def split(items: list[Item], parts: int) -> list[list[Item]]:
    """Items shared among `parts` generator processes: whole trajectories (or single calls) each."""
    return [[item for item in items if item[1] % parts == k] for k in range(parts)]
