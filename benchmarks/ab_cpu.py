"""Two revisions of codeenv, A and B, compared by the whole machine's CPU time per call, their turns
alternating: each turn starts `codeenv serve --slots 2` of one revision, sends 20 batches of 100
print(1) calls through HTTP, and reads the CPU the machine spent meanwhile (/proc/stat: user, nice,
system, irq, softirq). CPU per call moves less with a shared machine's load than throughput does,
though both are reported. Ratios per round A/B for CPU and B/A for throughput (> 1: B is better),
then their median and spread.

    python benchmarks/ab_cpu.py REV_A REV_B [--rounds 6] [--json out.json]

Each revision runs from a worktree of its own with this environment's packages (`PYTHONPATH`),
its slots on a uid base of its own. About 30 s per round on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from ab_revisions import ROOT, spread, wait_ready, worktree  # this directory: run as a script

BATCHES, BATCH = 20, 100


def machine_cpu_s() -> float:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2]) + int(fields[5]) + int(fields[6])) / os.sysconf(
        "SC_CLK_TCK")


def measure(tree: Path, port: int, uid_base: int) -> tuple[float, float]:
    """(CPU ms per call, calls/s) of one turn."""
    env = dict(os.environ, PYTHONPATH=str(tree), CODEENV_UID_BASE=str(uid_base))
    proc = subprocess.Popen([sys.executable, "-m", "codeenv.cli", "serve", "--port", str(port), "--slots", "2",
                             "--log-level", "warning"], env=env, cwd=tree, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        body = {"requests": [{"code": "print(1)"}] * BATCH}
        with httpx.Client(base_url=url, timeout=120) as client:
            client.post("/v1/execute/batch", json=body).raise_for_status()  # warm
            cpu0, t0 = machine_cpu_s(), time.perf_counter()
            for _ in range(BATCHES):
                client.post("/v1/execute/batch", json=body).raise_for_status()
            cpu1, t1 = machine_cpu_s(), time.perf_counter()
        calls = BATCHES * BATCH
        return (cpu1 - cpu0) / calls * 1e3, calls / (t1 - t0)
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev_a")
    parser.add_argument("rev_b")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    raw: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="codeenv-ab-") as tmp:
        trees = {"a": worktree(args.rev_a, Path(tmp)), "b": worktree(args.rev_b, Path(tmp))}
        try:
            for n in range(args.rounds):
                for side in ("a", "b") if n % 2 == 0 else ("b", "a"):
                    port, base = (19131, 1_600_000_000) if side == "a" else (19132, 1_600_100_000)
                    raw[side].append(measure(trees[side], port, base))
                a, b = raw["a"][-1], raw["b"][-1]
                print(f"round {n + 1}: CPU/call a/b {a[0] / b[0]:.3f}, calls/s b/a {b[1] / a[1]:.3f}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    report = {
        "a": args.rev_a, "b": args.rev_b, "rounds": args.rounds,
        "ratios": {"cpu per call a/b": spread([a[0] / b[0] for a, b in zip(raw["a"], raw["b"], strict=True)]),
                   "calls/s b/a": spread([b[1] / a[1] for a, b in zip(raw["a"], raw["b"], strict=True)])},
        "raw": {side: [{"cpu_ms_per_call": round(c, 4), "calls_per_s": round(r, 1)} for c, r in values]
                for side, values in raw.items()},
    }
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
