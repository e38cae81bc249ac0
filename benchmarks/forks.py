"""What a session's fork costs, and a cell right after it: at the engine (a SlotPool in this process,
no HTTP), one session of the light profile forked `--forks` times; each fork runs one cell and is
deleted. Where the revision has `session_forks_apart`, forks alternate with it on and off (a Landlock
domain of their own, or their parent's), so both are measured in one run.

    python benchmarks/forks.py [--forks 40] [--json out.json]
    python benchmarks/forks.py --revisions REV_A REV_B [--rounds 5] [--json out.json]
    python benchmarks/forks.py --siblings 8 [--forks 20] [--profile math] [--json out.json]

With `--siblings N` (issue 37), one session of `--profile` with some state is, in turns, forked once,
forked N times in one request, forked N times by N requests one after the other, snapshotted, and its
snapshot forked once and N times, each from a quiet host; reported: each one's p50, N forks' p50 over
one fork's and over N single forks', and the memory an idle sibling adds (its family's growth per
fork, and its own cgroup's figure) once N siblings exist.

With `--revisions`, each revision is checked out in a worktree of its own and this script runs once
per round for each, their turns alternating (A B, B A, ...); reported: fork and cell p50 per round
for each, and B/A (< 1: B is faster) per round, median and spread. Needs root; about 20 s a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


async def measure(forks: int) -> dict[str, Any]:
    from codeenv import ExecRequest, SandboxSettings, SlotPool

    async with SlotPool(SandboxSettings(slots=1)) as pool:
        m = pool.sessions
        assert m is not None
        settings = m.settings
        can_part = hasattr(settings, "session_forks_apart")
        session = await m.create("light")
        await pool.run(ExecRequest(code="x = list(range(1000))", session=session.id))
        samples: dict[str, dict[str, list[float]]] = {}
        for i in range(forks):
            key = "default"
            if can_part:
                settings.session_forks_apart = i % 2 == 0
                key = "apart" if i % 2 == 0 else "shared"
            t0 = time.perf_counter()
            fork = await m.fork(session.id)
            t1 = time.perf_counter()
            result = await pool.run(ExecRequest(code="len(x)", session=fork.id))
            t2 = time.perf_counter()
            assert result.status == "ok", result
            await m.delete(fork.id)
            got = samples.setdefault(key, {"fork": [], "cell": []})
            got["fork"].append(t1 - t0)
            got["cell"].append(t2 - t1)
        await m.delete(session.id)
    return {key: {"fork_p50_ms": ms(s["fork"]), "cell_p50_ms": ms(s["cell"]), "n": len(s["fork"])}
            for key, s in samples.items()}


async def measure_siblings(n: int, rounds: int, profile: str) -> dict[str, Any]:
    from codeenv import ExecRequest, SandboxSettings, SlotPool
    from codeenv.sandbox.outside.family import SNAPSHOT

    async with SlotPool(SandboxSettings(slots=1)) as pool:
        m = pool.sessions
        assert m is not None
        session = await m.create(profile)
        setup = await pool.run(ExecRequest(code="import sympy\nx = sympy.Symbol('x')\n"
                                                "table = {i: i * i for i in range(200_000)}", session=session.id))
        assert setup.status == "ok", setup
        t: dict[str, list[float]] = {"fork_1": [], f"fork_{n}": [], f"fork_1_x{n}": [], "snapshot": [],
                                     "snapshot_fork_1": [], f"snapshot_fork_{n}": []}
        family_growth, own = [], []
        async def settled() -> float:  # each one timed from a quiet host: not while the last ones' processes exit
            await asyncio.sleep(0.3)
            return time.perf_counter()

        for _ in range(rounds):
            t0 = await settled()
            [one] = await m.forks(session.id, count=1)
            t["fork_1"].append(time.perf_counter() - t0)
            await m.delete(one.id)
            t0 = await settled()
            many = await m.forks(session.id, count=n)
            t[f"fork_{n}"].append(time.perf_counter() - t0)
            for fork in many:
                await m.delete(fork.id)
            t0 = await settled()
            many = [(await m.forks(session.id, count=1))[0] for _ in range(n)]
            t[f"fork_1_x{n}"].append(time.perf_counter() - t0)
            for fork in many:
                await m.delete(fork.id)
            t0 = await settled()
            snap = await m.snapshot(session.id)
            t["snapshot"].append(time.perf_counter() - t0)
            t0 = await settled()
            [one] = await m.forks(snap.id, count=1, kind=SNAPSHOT)
            t["snapshot_fork_1"].append(time.perf_counter() - t0)
            await m.delete(one.id)
            family = session.family.cgroup
            before = family.memory_usage()
            t0 = await settled()
            many = await m.forks(snap.id, count=n, kind=SNAPSHOT)
            t[f"snapshot_fork_{n}"].append(time.perf_counter() - t0)
            family_growth.append((family.memory_usage() - before) / n)
            own += [session.family.groups[f.index].memory_usage() for f in many]
            for fork in many:
                await m.delete(fork.id)
            await m.delete(snap.id, kind=SNAPSHOT)
        await m.delete(session.id)
    out: dict[str, Any] = {"siblings": n, "rounds": rounds, "profile": profile,
                           **{f"{k}_p50_ms": ms(v) for k, v in t.items()}}
    out[f"fork_{n}_over_fork_1"] = round(statistics.median(t[f"fork_{n}"]) / statistics.median(t["fork_1"]), 3)
    out[f"fork_{n}_over_fork_1_x{n}"] = round(statistics.median(t[f"fork_{n}"])
                                              / statistics.median(t[f"fork_1_x{n}"]), 3)
    out["snapshot_fork_1_over_fork_1"] = round(statistics.median(t["snapshot_fork_1"])
                                               / statistics.median(t["fork_1"]), 3)
    out["idle_sibling_family_growth_kb_p50"] = round(statistics.median(family_growth) / 1024, 1)
    out["idle_sibling_own_cgroup_kb_p50"] = round(statistics.median(own) / 1024, 1)
    return out


def run_revision(tree: Path, forks: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "forks.py"), "--forks", str(forks),
                           "--json", "-"], capture_output=True, text=True, env=env, cwd=tree, timeout=600,
                          check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def compare(revisions: list[str], rounds: int, forks: int) -> dict[str, Any]:
    out: dict[str, Any] = {"revisions": revisions, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="codeenv-forks-") as tmp:
        trees = []
        for i, rev in enumerate(revisions):
            tree = Path(tmp) / f"rev{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                           check=True, capture_output=True)
            trees.append(tree)
        try:
            for r in range(rounds):
                order = [0, 1] if r % 2 == 0 else [1, 0]
                got: dict[int, dict[str, Any]] = {}
                for i in order:
                    got[i] = run_revision(trees[i], forks)
                out["rounds"].append({"A": got[0], "B": got[1]})
                print(f"round {r + 1}: A {got[0]} B {got[1]}", file=sys.stderr)
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    # B's forks as the revision makes them by default (apart where it has the setting) against A's.
    ratios: dict[str, list[float]] = {"fork": [], "cell": []}
    for rnd in out["rounds"]:
        a = rnd["A"].get("default") or rnd["A"].get("apart")
        b = rnd["B"].get("apart") or rnd["B"].get("default")
        for what in ratios:
            ratios[what].append(b[f"{what}_p50_ms"] / a[f"{what}_p50_ms"])
    out["b_over_a"] = {what: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                              "max": round(max(v), 3)} for what, v in ratios.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forks", type=int, default=40)
    parser.add_argument("--revisions", nargs=2, metavar=("REV_A", "REV_B"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write the figures here (- for standard output)")
    parser.add_argument("--siblings", type=int, help="measure N forks in one request, and snapshots")
    parser.add_argument("--profile", default="math", help="with --siblings: the session's profile")
    args = parser.parse_args()
    if args.siblings:
        figures = asyncio.run(measure_siblings(args.siblings, args.forks, args.profile))
    elif args.revisions:
        figures = compare(args.revisions, args.rounds, args.forks)
    else:
        figures = asyncio.run(measure(args.forks))
    text = json.dumps(figures, indent=2)
    if args.json == "-":
        print(text)
        return
    print(text, file=sys.stderr)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
