"""Per-step figures of a client's calls, for the trainer's logger (issue 40's third part).

Every result a client gets (calls, judged submissions, session cells) is counted here; the trainer
takes the figures of the calls since its last step and starts the next:

    metrics.update(client.step_metrics())      # {"codeenv/calls": 512, "codeenv/tool_error_ratio": ...}

The keys are flat, slash-separated and numeric, as verl's and W&B's metrics dicts take them.
"""

from __future__ import annotations

import random
from collections import Counter

from codeenv.models import PROGRAM_FAILURES, SERVICE_FAULTS, ExecResult

#: Times kept per step for the percentiles: past this, a uniform sample of them (reservoir).
SAMPLES_MAX = 100_000


class StepFigures:
    """What the calls since the last step did: how many, their statuses, the share of tool errors
    (the program's failures) and service faults, their queue and run times, the slowest."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._reset()

    def _reset(self) -> None:
        self.calls = 0
        self.statuses: Counter[str] = Counter()
        self.queue_s: list[float] = []
        self.run_s: list[float] = []
        self.slowest_s = 0.0

    def record(self, result: ExecResult) -> None:
        self.calls += 1
        self.statuses[result.status.value] += 1
        self.slowest_s = max(self.slowest_s, result.queue_s + result.wall_s)
        if len(self.run_s) < SAMPLES_MAX:
            self.queue_s.append(result.queue_s)
            self.run_s.append(result.wall_s)
        else:  # reservoir sampling: each call of the step kept with the same chance
            slot = self._rng.randrange(self.calls)
            if slot < SAMPLES_MAX:
                self.queue_s[slot], self.run_s[slot] = result.queue_s, result.wall_s

    def take(self, prefix: str = "codeenv/") -> dict[str, float]:
        """The figures since the last take, and a fresh start."""
        calls = self.calls
        figures: dict[str, float] = {f"{prefix}calls": float(calls)}
        if calls:
            failures = sum(n for s, n in self.statuses.items() if s in PROGRAM_FAILURES)
            faults = sum(n for s, n in self.statuses.items() if s in SERVICE_FAULTS)
            figures[f"{prefix}tool_error_ratio"] = failures / calls
            figures[f"{prefix}service_fault_ratio"] = faults / calls
            for status, n in sorted(self.statuses.items()):
                figures[f"{prefix}status/{status}"] = float(n)
            for name, samples in (("queue_s", self.queue_s), ("run_s", self.run_s)):
                ordered = sorted(samples)
                for label, q in (("p50", 0.5), ("p99", 0.99)):
                    figures[f"{prefix}{name}/{label}"] = ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            figures[f"{prefix}slowest_s"] = self.slowest_s
        self._reset()
        return figures
