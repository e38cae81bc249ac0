"""From records to figures: throughput, latency split into queue wait, run time and overhead,
GRPO step makespans and their straggler tail, correctness, and the generator's own CPU.

Overhead per call = latency - queue wait - run time: what the service adds on top of running the
program and of waiting for a free slot (queueing grows with load by nature, so it is reported on
its own). APIs that do not report a queue wait (code-judge, SandboxFusion) count it in the overhead.
In open-loop runs latency counts from each call's scheduled time, but overhead from when the call
was actually sent, so that a generator running late is not blamed on the service (the send lag is
reported beside it). Throughput counts the calls the service ran; calls it did not run (an HTTP
failure, overloaded, rejected) are reported as service errors.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from codeenv.bench.apis import SERVICE_ERRORS
from codeenv.bench.runner import Record, RoundResult

PERCENTILES = (50, 90, 99)
#: A generator process busier than this share of one core may be what limits the figures.
GENERATOR_BUSY = 0.7


def _ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values) * 1000
    out = {f"p{p}": round(float(np.percentile(a, p)), 3) for p in PERCENTILES}
    out["max"] = round(float(a.max()), 3)
    out["mean"] = round(float(a.mean()), 3)
    return out


def _steps(records: list[Record]) -> list[dict[str, float]]:
    """Per GRPO step: makespan (start to the end of its last trajectory) and the straggler tail
    (makespan minus the median trajectory's time: how long the step waits on its slowest samples)."""
    ends: dict[int, dict[int, float]] = {}
    origins: dict[int, float] = {}
    for r in records:
        step, traj, origin, done = r[0], r[1], r[3], r[6]
        origins[step] = min(origins.get(step, origin), origin)
        ends.setdefault(step, {})[traj] = max(ends.get(step, {}).get(traj, 0.0), done)
    out = []
    for step in sorted(ends):
        durations = np.asarray([t - origins[step] for t in ends[step].values()])
        makespan = float(durations.max())
        out.append({"step": step, "trajectories": len(durations), "makespan_s": round(makespan, 4),
                    "trajectory_p50_s": round(float(np.percentile(durations, 50)), 4),
                    "trajectory_p90_s": round(float(np.percentile(durations, 90)), 4),
                    "straggler_tail_s": round(makespan - float(np.percentile(durations, 50)), 4)})
    return out


class RunningThroughput:
    """The throughput of a round so far, as `summarize` counts it at the end (calls the service ran,
    over the time from the round's first call to its latest answer), so that the progress bar and
    the table show the same figure: counting from when the bench started the round instead took
    in the generators' start-up, and a short run read 90 calls/s live and 289 in the table."""

    def __init__(self) -> None:
        self.ran = 0
        self.first: float | None = None
        self.last: float | None = None

    def add(self, records: list[Record]) -> None:
        if not records:
            return
        self.ran += sum(1 for r in records if r[7] not in SERVICE_ERRORS)
        first, last = min(r[3] for r in records), max(r[6] for r in records)
        self.first = first if self.first is None else min(self.first, first)
        self.last = last if self.last is None else max(self.last, last)

    @property
    def per_s(self) -> float:
        span = (self.last - self.first) if self.first is not None and self.last is not None else 0.0
        return self.ran / span if span > 0 else 0.0


def summarize(rounds: list[RoundResult], planned: int, mode: str, cores: int) -> dict[str, Any]:
    """The figures of one target's rounds (records of several rounds are pooled)."""
    records = [r for one in rounds for r in one.records]
    duration = sum(_span(one.records) for one in rounds)
    statuses = Counter(r[7] for r in records)
    latency = [r[6] - r[4] for r in records]
    queue = [r[8] for r in records if r[8] is not None]
    run = [r[9] for r in records if r[9] is not None]
    ran = [r for r in records if r[7] not in SERVICE_ERRORS]
    overhead = [r[6] - r[5] - (r[8] or 0.0) - r[9] for r in ran if r[9] is not None]
    checked = [r for r in records if r[10] >= 0]
    errors = Counter(r[11] for r in records if r[11])
    cpu = [c for one in rounds for c in one.generator_cpu_s]
    wall = sum(one.wall_s for one in rounds)
    busiest = max((c / (wall / len(rounds)) for c in cpu), default=0.0) if wall > 0 else 0.0
    figures: dict[str, Any] = {
        "calls_planned": planned * len(rounds),
        "calls_answered": len(records),
        "calls_ran": len(ran),
        "statuses": dict(sorted(statuses.items())),
        "service_errors": sum(statuses[s] for s in SERVICE_ERRORS),
        "duration_s": round(duration, 4),
        "throughput_per_s": round(len(ran) / duration, 3) if duration > 0 else 0.0,
        "latency_ms": _ms(latency),
        "queue_wait_ms": _ms(queue),
        "run_time_ms": _ms(run),
        "overhead_ms": _ms(overhead),
        "overhead_includes_queue_wait": len(queue) < len(run),
        "correctness": {"checked": len(checked), "mismatches": sum(1 for r in checked if r[10] == 0)},
        "top_errors": [{"count": n, "error": e} for e, n in errors.most_common(3)],
        "generator": {"processes": len(cpu) // max(1, len(rounds)), "cpu_s": round(sum(cpu), 3),
                      "watcher_cpu_s": round(sum(one.watcher_cpu_s for one in rounds), 3),
                      "busiest_process_core_share": round(busiest, 3),
                      "machine_share": round(sum(cpu) / (wall * cores), 3) if wall > 0 else 0.0},
    }
    if mode == "grpo":
        steps = [s for one in rounds for s in _steps(one.records)]
        figures["steps"] = steps
        if steps:
            figures["makespan_s"] = round(float(np.mean([s["makespan_s"] for s in steps])), 4)
            figures["straggler_tail_s"] = round(float(np.mean([s["straggler_tail_s"] for s in steps])), 4)
    if mode == "rate":
        figures["send_lag_ms"] = _ms([r[5] - r[4] for r in records])
    return figures


def _span(records: list[Record]) -> float:
    if not records:
        return 0.0
    return max(r[6] for r in records) - min(r[3] for r in records)


def warnings(figures: dict[str, Any], target_is_local: bool) -> list[str]:
    out = []
    gen = figures["generator"]
    if gen["busiest_process_core_share"] > GENERATOR_BUSY:
        out.append(f"a generator process was busy {100 * gen['busiest_process_core_share']:.0f}% of a core: the "
                   "generator may be the bottleneck; spread it with --procs N")
    if target_is_local and gen["machine_share"] > 0.1:
        out.append(f"the generator used {100 * gen['machine_share']:.0f}% of this machine's CPU, which a target on "
                   "this machine could not use")
    lag = figures.get("send_lag_ms")
    if lag and lag["p99"] > 50:
        out.append(f"calls left up to {lag['max']:.0f} ms after their scheduled time (p99 {lag['p99']:.0f} ms): "
                   "the generator fell behind the rate; latencies still count from the schedule")
    if figures["service_errors"]:
        out.append(f"{figures['service_errors']} of {figures['calls_answered']} calls were not run by the service "
                   "(HTTP failures, overloaded or rejected; see the errors above): throughput counts only the "
                   f"{figures['calls_ran']} that ran")
    return out


def ratios(target: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """How many times better `target` did than `other` (>1: target is better) on each figure."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    def pick(figs: dict[str, Any], key: str, sub: str) -> float | None:
        value = figs.get(key)
        return value.get(sub) if isinstance(value, dict) else None

    out: dict[str, float | None] = {
        "throughput": ratio(target["throughput_per_s"], other["throughput_per_s"]),
        "latency_p50": ratio(pick(other, "latency_ms", "p50"), pick(target, "latency_ms", "p50")),
        "latency_p99": ratio(pick(other, "latency_ms", "p99"), pick(target, "latency_ms", "p99")),
    }
    if "makespan_s" in target and "makespan_s" in other:
        out["makespan"] = ratio(other["makespan_s"], target["makespan_s"])
    return out


#: Bins of the throughput-over-time plot in a round, about.
PLOT_BINS = 40


def _nice(seconds: float) -> float:
    """The 1, 2 or 5 x 10^k at or above `seconds` (at least a millisecond): a bin width to read."""
    seconds = max(seconds, 1e-3)
    power = 10.0 ** np.floor(np.log10(seconds))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= seconds * (1 - 1e-9)))


def throughput_series(records: list[Record], bin_s: float | None = None) -> tuple[list[float], list[float]]:
    """Answered calls per second over time, from the round's start, in bins of `bin_s` (default:
    about PLOT_BINS bins a round, a 1-2-5 width however short the round: a run under a second
    gets bins of milliseconds, not one bin that draws no line)."""
    if not records:
        return [], []
    start = min(r[3] for r in records)
    done = np.asarray([r[6] - start for r in records])
    bin_s = bin_s or _nice(float(done.max()) / PLOT_BINS)
    bins = np.arange(0, float(done.max()) + bin_s, bin_s)
    counts, _ = np.histogram(done, bins=bins)
    return [float(b) for b in bins[:-1]], [float(c) / bin_s for c in counts]


def plot(path: Path, runs: dict[str, list[RoundResult]], title: str) -> bool:
    """Latency CDF and throughput over time per target; False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (cdf, tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rounds in runs.items():
        records = [r for one in rounds for r in one.records]
        lat = np.sort(np.asarray([1000 * (r[6] - r[4]) for r in records]))
        if lat.size:
            cdf.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=label)
        for i, one in enumerate(rounds):
            xs, ys = throughput_series(one.records)
            tput.plot(xs, ys, label=f"{label} (round {i + 1})" if len(rounds) > 1 else label)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms, log scale)")
    cdf.set_ylabel("fraction of calls")
    cdf.set_title("latency CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend()
    tput.set_xlabel("time since the round started (s)")
    tput.set_ylabel("answered calls / s")
    tput.set_title("throughput over time")
    tput.grid(True, alpha=0.3)
    tput.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
