"""Two configurations of this codeenv, A and B (CODEENV_* settings), measured in one run with their
turns alternating: `codeenv bench` throughput and latency for each workload, a ratio per round
(> 1: B is better), then the median and spread (min to max) over the rounds.

    python benchmarks/ab_settings.py --a CODEENV_SECCOMP=legacy --b CODEENV_SECCOMP=allowlist \\
        --rounds 6 --json benchmarks/results-ab-seccomp.json

Both services run side by side (`codeenv serve`, 2 slots each); only the one being measured gets
calls. Takes about 40 s per round on 2 cores with the default workloads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_revisions import spread  # this directory: run as a script

from codeenv.bench.services import free_port, start_codeenv

#: workload -> `codeenv bench` arguments for one measurement.
WORKLOADS = {
    "print": ["--workload", "print", "--mode", "concurrency", "--concurrency", "16", "--calls", "600"],
    "math": ["--workload", "math", "--mode", "concurrency", "--concurrency", "16", "--calls", "150"],
}


def setting(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    if not name.startswith("CODEENV_") or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give CODEENV_NAME=VALUE")
    return name, value


def bench(url: str, args: list[str], out: Path) -> dict[str, float]:
    subprocess.run([sys.executable, "-m", "codeenv.cli", "bench", "--target", url, *args, "--out", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    target = next(iter(json.loads(sorted(out.glob("bench-*.json"))[-1].read_text())["targets"].values()))
    for report in out.glob("bench-*"):
        report.unlink()
    return {"throughput_per_s": target["throughput_per_s"], "p50_ms": target["latency_ms"]["p50"],
            "answered": target["calls_answered"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=setting, action="append", default=[], help="a setting of A (repeatable)")
    parser.add_argument("--b", type=setting, action="append", default=[], help="a setting of B (repeatable)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sides = {"a": dict(args.a), "b": dict(args.b)}
    services = {side: start_codeenv("serve", "--slots", "2", "--log-level", "warning", port=free_port(),
                                    env={**os.environ, **extra}) for side, extra in sides.items()}
    raw: dict[str, dict[str, list[dict[str, float]]]] = {w: {"a": [], "b": []} for w in WORKLOADS}
    try:
        for service in services.values():
            service.wait_ready(120)
        with tempfile.TemporaryDirectory(prefix="codeenv-ab-") as tmp:
            for n in range(args.rounds):
                order = ("a", "b") if n % 2 == 0 else ("b", "a")
                for workload, bench_args in WORKLOADS.items():
                    for side in order:
                        url = services[side].url
                        assert url is not None
                        raw[workload][side].append(bench(url, bench_args, Path(tmp)))
                line = []
                for workload in WORKLOADS:
                    a, b = raw[workload]["a"][-1], raw[workload]["b"][-1]
                    line.append(f"{workload} {b['throughput_per_s'] / a['throughput_per_s']:.3f}")
                print(f"round {n + 1}: throughput b/a " + ", ".join(line), flush=True)
    finally:
        for service in services.values():
            service.stop()
    ratios = {}
    for workload in WORKLOADS:
        a, b = raw[workload]["a"], raw[workload]["b"]
        ratios[f"{workload} throughput b/a"] = spread(
            [y["throughput_per_s"] / x["throughput_per_s"] for x, y in zip(a, b, strict=True)])
        ratios[f"{workload} p50 a/b"] = spread([x["p50_ms"] / y["p50_ms"] for x, y in zip(a, b, strict=True)])
    report = {"a": sides["a"], "b": sides["b"], "rounds": args.rounds, "workloads": WORKLOADS,
              "ratios": ratios, "raw": raw}
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
