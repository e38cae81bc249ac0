"""The service's own CPU per `print(1)` call, by role, from /proc: what a request costs the gateway,
the worker and the jails (zygotes, supervisors, nsjail), the call's child excluded, and redis-server.

    python benchmarks/service_cpu.py [--calls 2000] [--concurrency 16] [--rounds 5] [--json out.json]
    python benchmarks/service_cpu.py --revisions REV_A REV_B [...]   # A/B, turns alternating

Two deployments on 2 slots each: embedded (`codeenv serve`: the gateway and the pool share a process)
and Redis (a private redis-server, `codeenv serve --redis --no-local-worker`, `codeenv worker`).
Each turn sends `--calls` single `/v1/execute` calls from `--concurrency` coroutines of this process
(an RL rollout's agent loops: one tool call per request), after a warm-up, and reads utime + stime
of every process of the service that lived through the whole window (/proc/PID/stat, a process's
own time, not its reaped children's): the call's children come and go within it and are excluded,
as are its own reaped children's times. CPU per call is the sum over a role, in microseconds, with
its minor page faults per call (`jail_faults`: mostly the zygote's copy-on-write faults after each
fork); `child` and `child_faults` are the same for the calls' children (reaped by the jails);
`machine` is the whole machine's CPU per call (/proc/stat: children and this client included).
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_revisions import ROOT, spread, worktree  # noqa: E402  (this directory)

from codeenv.bench.services import Service, free_port, start_codeenv, start_redis  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


Stat = tuple[int, float, int, float, int]


def _stat(pid: int) -> Stat | None:
    """(parent pid, own CPU seconds, own minor page faults, the same two of its reaped children) of
    a live process."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(f[1]), (int(f[11]) + int(f[12])) / TICK, int(f[7]), (int(f[13]) + int(f[14])) / TICK, int(f[8])


def _machine_cpu_s() -> float:
    """The whole machine's busy CPU seconds (user, nice, system, irq, softirq): children included."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / TICK


Tree = dict[int, tuple[str, Stat]]


def _tree(roots: dict[str, int]) -> Tree:
    """Every process under `roots` (role -> pid): pid -> (role, its figures). A root's descendants
    are the role `jail`."""
    stats: dict[int, Stat] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    role_of = {pid: role for role, pid in roots.items()}
    found: Tree = {}
    for pid, stat in stats.items():
        at, seen = pid, 0
        while at not in role_of and at in stats and seen < 64:
            at, seen = stats[at][0], seen + 1
        if at in role_of:
            found[pid] = (role_of[pid] if pid in role_of else "jail", stat)
    return found


def _per_role(before: Tree, after: Tree, calls: int) -> dict[str, float]:
    """Role -> µs of CPU per call, and role_faults -> minor faults per call, over the processes that
    lived through the window; `child`: what the jails' processes reaped meanwhile (the calls' children)."""
    figures: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        figures[key] = figures.get(key, 0.0) + value / calls

    for pid, (role, (_, cpu, faults, reaped_cpu, reaped_faults)) in after.items():
        if pid in before and before[pid][0] == role:
            was = before[pid][1]
            add(role, (cpu - was[1]) * 1e6)
            add(f"{role}_faults", faults - was[2])
            if role == "jail":
                add("child", (reaped_cpu - was[3]) * 1e6)
                add("child_faults", reaped_faults - was[4])
    return figures


async def _send(url: str, calls: int, concurrency: int, code: str = "print(1)") -> float:
    left = calls

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            r = await client.post("/v1/execute", json={"code": code})
            r.raise_for_status()
            assert r.json()["status"] == "ok", r.text

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
        return time.perf_counter() - t0


def turn(deployment: str, calls: int, concurrency: int, code: str, env: dict[str, str] | None = None
         ) -> dict[str, float]:
    """One deployment started, warmed, measured and stopped: role -> µs per call, and calls/s."""
    services: list[Service] = []
    serve = ["--log-level", "warning"]
    try:
        if deployment == "embedded":
            gateway = start_codeenv("serve", "--slots", "2", *serve, port=free_port(), env=env)
            services.append(gateway)
            roots = {"gateway": gateway.pid}
        else:
            redis = start_redis()
            services.append(redis)
            gateway = start_codeenv("serve", "--redis", redis.url, "--no-local-worker", *serve, port=free_port(),
                                    env=env)
            worker = start_codeenv("worker", "--redis", redis.url, "--slots", "2", "--log-level", "warning",
                                   env=env)
            services += [gateway, worker]
            roots = {"gateway": gateway.pid, "worker": worker.pid, "redis": redis.pid}
        gateway.wait_ready()
        asyncio.run(_send(gateway.url, 200, concurrency, code))  # warm: connections, zygotes, caches
        before, machine0 = _tree(roots), _machine_cpu_s()
        wall = asyncio.run(_send(gateway.url, calls, concurrency, code))
        after, machine1 = _tree(roots), _machine_cpu_s()
        figures = _per_role(before, after, calls)
        figures["service"] = sum(v for k, v in figures.items() if k in ("gateway", "worker", "jail"))
        figures["machine"] = (machine1 - machine0) / calls * 1e6
        figures["calls_per_s"] = calls / wall
        return {k: round(v, 1) for k, v in figures.items()}
    finally:
        for service in reversed(services):
            service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--code", default="print(1)", help="the program of every call")
    parser.add_argument("--deployments", nargs="+", default=["embedded", "redis"], choices=["embedded", "redis"])
    parser.add_argument("--revisions", nargs=2, metavar=("REV_A", "REV_B"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        trees: dict[str, Path | None] = {"here": None}
        if args.revisions:
            trees = {rev: worktree(rev, Path(scratch)) for rev in args.revisions}
        rounds: list[dict[str, dict[str, dict[str, float]]]] = []
        try:
            for r in range(args.rounds):
                this: dict[str, dict[str, dict[str, float]]] = {}
                for name, tree in trees.items():
                    env = None if tree is None else dict(os.environ, PYTHONPATH=str(tree))
                    # `python -m codeenv.cli` imports from its working directory first (before
                    # PYTHONPATH, and before the editable install's finder): the tree's own.
                    os.chdir(tree or ROOT)
                    this[name] = {d: turn(d, args.calls, args.concurrency, args.code, env) for d in args.deployments}
                    print(f"round {r + 1} {name}: {json.dumps(this[name])}", flush=True)
                rounds.append(this)
        finally:
            os.chdir(ROOT)
            for tree in trees.values():
                if tree is not None:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    report: dict[str, Any] = {"calls": args.calls, "concurrency": args.concurrency, "code": args.code, "rounds": rounds,
                              "medians": {}}
    for name in trees:
        for d in args.deployments:
            keys = rounds[0][name][d].keys()
            report["medians"].setdefault(name, {})[d] = {
                k: round(statistics.median(x[name][d][k] for x in rounds), 1) for k in keys}
    if args.revisions:
        a, b = args.revisions
        report["b_over_a"] = {d: {k: spread([x[b][d][k] / x[a][d][k] for x in rounds])
                                  for k in rounds[0][a][d] if all(x[a][d].get(k) for x in rounds)}
                              for d in args.deployments}
    print(json.dumps(report["medians"], indent=1))
    if args.revisions:
        print(json.dumps(report["b_over_a"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
