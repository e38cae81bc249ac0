"""Two revisions of codeenv, A and B, measured in one run with their turns alternating: the engine
(`benchmarks/engine.py`), the gateway (`benchmarks/gateway.py`), the judge (`benchmarks/judge.py`),
session cells (`benchmarks/sessions.py trajectory --engine`) and `codeenv bench`'s math workload.
Engine and gateway figures are ratios per round (> 1: B is better), then their median and spread
(min to max); the math workload is one `codeenv bench --compare` run (its rounds alternate A B, B A)
whose pooled throughput and p50 latency are compared.

    python benchmarks/ab_revisions.py REV_A REV_B [--rounds 5] [--json out.json]

Each revision is checked out in a worktree of its own and run with this environment's packages
(`PYTHONPATH` puts its code first), with its own copy of each benchmark script. Takes about 5
minutes per round on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
#: The figures compared, from each script's JSON: (script, path in its "figures", higher is better).
FIGURES = {
    "engine print(1)/s": ("engine", ("figures", "codeenv", "print_per_s"), True),
    "engine sympy/s": ("engine", ("figures", "codeenv", "sympy_per_s"), True),
    "engine p50 ms": ("engine", ("figures", "codeenv", "p50_ms"), False),
    "engine first line ms": ("engine", ("figures", "codeenv", "first_line_ms"), False),
    "gateway HTTP calls/s": ("gateway", ("figures", "http_per_s"), True),
    "gateway Redis calls/s": ("gateway", ("figures", "redis_per_s"), True),
    "gateway HTTP p50 ms": ("gateway", ("figures", "http_p50_ms"), False),
    "judge submissions/s": ("judge", ("figures", "judge_submissions_per_s"), True),
    "session 16-cell trajectories s": ("sessions", ("rounds", 0, "session_s"), False),
}
#: Each script's arguments for one round.
SCRIPTS = {
    "engine": ["--rounds", "1"],
    "gateway": ["--rounds", "1"],
    "judge": ["--rounds", "1", "--submissions", "20", "--tests", "20"],
    "sessions": ["trajectory", "--engine", "--rounds", "1"],
}


def worktree(rev: str, into: Path) -> Path:
    path = into / rev
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), rev],
                   check=True, capture_output=True)
    return path


def run_script(tree: Path, script: str, out: Path) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(tree / "benchmarks" / f"{script}.py"), *SCRIPTS[script], "--json", str(out)],
                   check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    report: dict[str, object] = json.loads(out.read_text())
    return report


def pick(figures: dict[str, object], path: tuple[str | int, ...]) -> float:
    value: object = figures
    for key in path:
        assert isinstance(value, dict) if isinstance(key, str) else isinstance(value, list)
        value = value[key]  # type: ignore[index]
    assert isinstance(value, int | float)
    return float(value)


def serve(tree: Path, port: int, uid_base: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(tree), CODEENV_UID_BASE=str(uid_base))
    return subprocess.Popen([sys.executable, "-m", "codeenv.cli", "serve", "--port", str(port), "--slots", "2",
                             "--log-level", "warning"], env=env, cwd=tree, stderr=subprocess.DEVNULL)


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not become ready")


def spread(ratios: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
            "max": round(max(ratios), 4), "rounds": len(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev_a")
    parser.add_argument("rev_b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, object] = {"a": args.rev_a, "b": args.rev_b, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="codeenv-ab-") as tmp:
        trees = {"a": worktree(args.rev_a, Path(tmp)), "b": worktree(args.rev_b, Path(tmp))}
        try:
            ratios: dict[str, list[float]] = {name: [] for name in FIGURES}
            raw: dict[str, list[dict[str, float]]] = {"a": [], "b": []}
            for n in range(args.rounds):
                order = ("a", "b") if n % 2 == 0 else ("b", "a")
                got: dict[str, dict[str, float]] = {"a": {}, "b": {}}
                for script in SCRIPTS:
                    for side in order:
                        figures = run_script(trees[side], script, Path(tmp) / f"{side}-{script}.json")
                        for name, (source, path, _) in FIGURES.items():
                            if source == script:
                                got[side][name] = pick(figures, path)
                for name, (_, _, higher) in FIGURES.items():
                    a, b = got["a"][name], got["b"][name]
                    ratios[name].append(b / a if higher else a / b)  # > 1: B is better
                raw["a"].append(got["a"])
                raw["b"].append(got["b"])
                print(f"round {n + 1}: " + ", ".join(f"{k} {ratios[k][-1]:.3f}" for k in FIGURES), flush=True)
            # The math workload through `codeenv bench`, the two services taking turns (A B, B A, ...).
            procs = {"a": serve(trees["a"], 18971, 1_500_000_000 + 30_000),
                     "b": serve(trees["b"], 18972, 1_500_000_000 + 30_100)}
            try:
                for port in (18971, 18972):
                    wait_ready(f"http://127.0.0.1:{port}")
                out = Path(tmp) / "bench"
                env = dict(os.environ, PYTHONPATH=str(trees["b"]))
                subprocess.run([sys.executable, "-m", "codeenv.cli", "bench", "--target", "http://127.0.0.1:18971",
                                "--compare", "http://127.0.0.1:18972", "--workload", "math", "--mode", "concurrency",
                                "--concurrency", "16", "--calls", "200", "--rounds", str(args.rounds),
                                "--out", str(out)], check=True, env=env, cwd=trees["b"], stdout=subprocess.DEVNULL)
                bench = json.loads(sorted(out.glob("*.json"))[-1].read_text())
            finally:
                for proc in procs.values():
                    proc.terminate()
                    proc.wait(60)
            targets = list(bench["targets"].values())  # A, then B (the --compare target)
            report["bench_math"] = {
                side: {k: t.get(k) for k in ("target", "throughput_per_s", "latency_ms", "correctness")}
                for side, t in zip("ab", targets, strict=True)}
            report["bench_math"]["throughput b/a"] = round(
                targets[1]["throughput_per_s"] / targets[0]["throughput_per_s"], 4)
            report["bench_math"]["p50 a/b"] = round(
                targets[0]["latency_ms"]["p50"] / targets[1]["latency_ms"]["p50"], 4)
            report["ratios"] = {name: spread(values) for name, values in ratios.items()}
            report["raw"] = raw
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
