"""Live sessions: what they cost and what they save, in one run.

    python benchmarks/sessions.py trajectory [--mode embedded|processes|redis] [--cells 16] [--trajectories 4]
                                             [--rounds 5] [--json out.json]
    python benchmarks/sessions.py idle [--sessions 1000] [--json out.json]

trajectory: one `codeenv serve` (a real uvicorn process, embedded pool; `--mode processes`: `serve
--processes 2`; `--mode redis`: a private redis-server, one `codeenv worker` and `serve --redis
--processes 2`; `--engine`: a pool in this process, no HTTP). A trajectory is `--cells`
cells of about 10 ms of CPU each, every cell using the state the earlier ones left. It runs two
ways, taking turns round by round, `--trajectories` at a time:

- session: each cell is the next cell of one live session (`client.session()`, `s.run(cell)`);
- replay: each cell is a call of that cell with every earlier cell in front of it (`client.run`),
  as rStar2-Agent's tool does it (a fresh interpreter per call: the state is rebuilt by re-running).

Both through codeenv.client (micro-batched, as an RL trainer sends them).

It reports the ratio replay / session per round (median, min, max), and a 2x-long trajectory's time
over a 1x one, through sessions (linear: 2.0; replay is quadratic). Over HTTP also the service's
own CPU per cell (gateway, pool and worker processes, from /proc, the jails left out) against per
stateless call of the same code, both sent one at a time in the same run, round by round.

idle: at the engine (a SlotPool in this process, no HTTP). `--sessions` sessions are created in a
burst, each then runs a cell that imports sympy and builds a small state, and stays alive. Reported:
creation time per session (p50, p90) for the light and the math profile, fork time (p50), and memory
per idle session as (MemAvailable before - after) / sessions, so the kernel's memory (page tables,
namespaces, cgroups) counts too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rich.console import Console

from codeenv import ExecRequest, SandboxSettings, SlotPool
from codeenv.bench.services import free_port, start_codeenv, start_redis
from codeenv.client import AsyncClient
from codeenv.sandbox.sizing import meminfo_bytes

console = Console()

#: Cell i of a trajectory: ~10 ms of CPU that uses and extends the state of the cells before it.
CELL = "acc{i} = sum(k * k for k in range(120_000)) % 1009 + {prev}\nacc{i}"
STATE_CELL = ("import sympy\nx = sympy.Symbol('x')\nexpr = sympy.expand((x + 1) ** 6)\n"
              "state = {'n': 1, 'xs': list(range(200)), 'expr': expr}\nlen(state['xs'])")


def trajectory_cells(n: int) -> list[str]:
    return [CELL.format(i=i, prev=f"acc{i - 1}" if i else 0) for i in range(n)]


CELL_CPU_S: list[float] = []


async def through_session(client: AsyncClient, cells: list[str]) -> list[str]:
    values = []
    async with client.session(profile="light") as session:
        for code in cells:
            result = await session.run(code)
            assert result.status == "ok", result
            values.append(result.value or "")
            CELL_CPU_S.append(result.cpu_s)
    return values


async def replayed(client: AsyncClient, cells: list[str]) -> list[str]:
    values = []
    for i in range(len(cells)):
        result = await client.run("\n".join(cells[: i + 1]), display_last=True, profile="light")
        assert result.status == "ok", result
        values.append(result.value or "")
    return values


async def timed(run: Any, client: AsyncClient, cells: list[str], at_once: int) -> float:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(run(client, cells) for _ in range(at_once)))
    assert all(o == outs[0] for o in outs)
    return time.perf_counter() - t0


class EngineClient:
    """The same two ways at the engine: a SlotPool in this process, no HTTP (--engine)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @contextlib.asynccontextmanager
    async def session(self, profile: str) -> AsyncIterator[Any]:
        session = await self.pool.sessions.create(profile)
        pool = self.pool

        class Cells:
            async def run(self, code: str) -> Any:
                return await pool.run(ExecRequest(code=code, session=session.id, display_last=True))

        try:
            yield Cells()
        finally:
            await self.pool.sessions.delete(session.id)

    async def run(self, code: str, display_last: bool, profile: str) -> Any:
        return await self.pool.run(ExecRequest(code=code, display_last=display_last, profile=profile))


def _stat_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


def service_cpu_s(roots: list[int]) -> float:
    """CPU seconds used so far by the service's own processes: `roots` and their descendants, but
    no jail (an nsjail process and what runs under it)."""
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "nsjail":
                continue
            total += _stat_cpu_s(pid)
        except OSError:
            continue
        todo += _children(pid)
    return total


@contextlib.asynccontextmanager
async def a_client(args: argparse.Namespace) -> AsyncIterator[Any]:
    if args.engine:
        async with SlotPool(SandboxSettings(**({"slots": args.slots} if args.slots else {}))) as pool:
            yield EngineClient(pool)
        return
    env = {"PATH": "/usr/bin:/bin", **({"CODEENV_SLOTS": str(args.slots)} if args.slots else {})}
    started: list[Any] = []
    try:
        if args.mode == "redis":
            redis = start_redis()
            started.append(redis)
            started.append(start_codeenv("worker", "--redis", redis.url, env=env))
            service = start_codeenv("serve", "--redis", redis.url, "--no-local-worker", "--processes", "2",
                                    port=free_port(), env=env)
        elif args.mode == "processes":
            service = start_codeenv("serve", "--processes", "2", port=free_port(), env=env)
        else:
            service = start_codeenv("serve", port=free_port(), env=env)
        started.append(service)
        service.wait_ready(300)
        SERVICE_PIDS[:] = [s.pid for s in started if s.name != "redis-server"]
        async with AsyncClient(service.url) as client:
            yield client
    finally:
        for s in reversed(started):
            s.stop(30)  # SIGTERM: `serve --processes N` stops its gateway and pool processes (a SIGKILL orphans them)


SERVICE_PIDS: list[int] = []


async def cpu_per_cell_and_call(client: AsyncClient, code: str, n: int) -> tuple[float, float]:
    """The service's CPU per cell (one session, cells one at a time) and per stateless call of the
    same code (one at a time), in ms."""
    async with client.session(profile="light") as session:
        await session.run(code)
        t0 = service_cpu_s(SERVICE_PIDS)
        for _ in range(n):
            assert (await session.run(code)).status == "ok"
        cell = (service_cpu_s(SERVICE_PIDS) - t0) / n
    await client.run(code, profile="light")
    t0 = service_cpu_s(SERVICE_PIDS)
    for _ in range(n):
        assert (await client.run(code, profile="light")).status == "ok"
    call = (service_cpu_s(SERVICE_PIDS) - t0) / n
    return cell * 1000, call * 1000


async def trajectory(args: argparse.Namespace) -> dict[str, Any]:
    async with a_client(args) as client:
        cells = trajectory_cells(args.cells)
        assert await through_session(client, cells) == await replayed(client, cells)  # same answers
        alone = [(await client.run(cells[0], display_last=True, profile="light")).cpu_s for _ in range(20)]
        console.print(f"a cell alone (one call): {statistics.median(alone) * 1000:.1f} ms of CPU")
        CELL_CPU_S.clear()
        ratios, growth, rows = [], [], []
        cpu_rows: list[tuple[float, float]] = []
        for rnd in range(args.rounds):
            if not args.engine:
                cpu_rows.append(await cpu_per_cell_and_call(client, cells[0], 50))
                console.print(f"round {rnd}: service CPU per cell {cpu_rows[-1][0]:.2f} ms, per call "
                              f"{cpu_rows[-1][1]:.2f} ms")
            session_s = await timed(through_session, client, cells, args.trajectories)
            replay_s = await timed(replayed, client, cells, args.trajectories)
            double_s = await timed(through_session, client, trajectory_cells(2 * args.cells), args.trajectories)
            ratios.append(replay_s / session_s)
            growth.append(double_s / session_s)
            rows.append({"round": rnd, "session_s": session_s, "replay_s": replay_s, "double_session_s": double_s})
            console.print(f"round {rnd}: session {session_s:.2f}s, replay {replay_s:.2f}s "
                          f"({replay_s / session_s:.2f}x); {2 * args.cells} cells {double_s:.2f}s "
                          f"({double_s / session_s:.2f}x)")
    console.print(f"a cell's CPU time in its session: {statistics.median(CELL_CPU_S) * 1000:.1f} ms (median)")
    extra: dict[str, Any] = {}
    if cpu_rows:
        extra = {"service_cpu_ms_per_cell": summary([c for c, _ in cpu_rows]),
                 "service_cpu_ms_per_call": summary([c for _, c in cpu_rows]),
                 "cell_minus_call_ms": summary([c - d for c, d in cpu_rows])}
        console.print(extra)
    return {"through": "engine" if args.engine else f"http, {args.mode}", "cells": args.cells, **extra,
        "trajectories_at_once": args.trajectories, "rounds": rows,
        "cell_alone_cpu_ms": round(statistics.median(alone) * 1000, 2),
        "cell_in_session_cpu_ms": round(statistics.median(CELL_CPU_S) * 1000, 2),
        "replay_over_session": summary(ratios), "double_over_single": summary(growth)}


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def mem_available() -> int:
    available = meminfo_bytes("MemAvailable")
    if available is None:
        raise RuntimeError("no MemAvailable in /proc/meminfo")
    return available


async def idle(args: argparse.Namespace) -> dict[str, Any]:
    settings = SandboxSettings(slots=1, sessions_max=args.sessions + 64, session_min_available_mb=256)
    out: dict[str, Any] = {"sessions": args.sessions}
    async with SlotPool(settings) as pool:
        m = pool.sessions
        assert m is not None
        for profile in ("light", "math"):  # start each session jail outside the measurement
            await m.delete((await m.create(profile)).id)
        for profile in ("light", "math"):
            times = []
            made = []
            for _ in range(min(args.sessions, 200)):
                t0 = time.perf_counter()
                made.append(await m.create(profile))
                times.append(time.perf_counter() - t0)
            forks = []
            for _ in range(50):
                t0 = time.perf_counter()
                made.append(await m.fork(made[0].id))
                forks.append(time.perf_counter() - t0)
            for s in made:
                await m.delete(s.id)
            out[f"create_{profile}_ms"] = pct(times)
            out[f"fork_{profile}_ms"] = pct(forks)
            console.print(f"{profile}: create {out[f'create_{profile}_ms']}, fork {out[f'fork_{profile}_ms']}")
        await asyncio.sleep(2)
        before = mem_available()
        times = []
        sessions = []
        for i in range(args.sessions):
            t0 = time.perf_counter()
            s = await m.create("math")
            times.append(time.perf_counter() - t0)
            r = await pool.run(ExecRequest(code=STATE_CELL, session=s.id, display_last=True))
            assert r.status == "ok" and r.value == "200", r
            sessions.append(s)
            if (i + 1) % 100 == 0:
                console.print(f"{i + 1} sessions: {(before - mem_available()) / (i + 1) / 2**20:.2f} MiB each")
        await asyncio.sleep(2)
        after = mem_available()
        out["burst_create_math_ms"] = pct(times)
        out["memory_per_session_mib"] = round((before - after) / args.sessions / 2**20, 3)
        out["alive"] = len(m.sessions)
        check = await pool.run(ExecRequest(code="state['n'] += 1\nstate['n'], str(expr)[:10]",
                                           session=sessions[0].id, display_last=True))
        out["first_still_alive"] = check.value
        console.print(out)
    return out


def pct(xs: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(xs, n=10)
    return {"p50": round(statistics.median(xs) * 1000, 2), "p90": round(qs[-1] * 1000, 2), "n": len(xs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trajectory")
    t.add_argument("--cells", type=int, default=16)
    t.add_argument("--trajectories", type=int, default=4)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--slots", type=int, default=None)
    t.add_argument("--engine", action="store_true", help="at the engine (a pool in this process), not over HTTP")
    t.add_argument("--mode", choices=("embedded", "processes", "redis"), default="embedded",
                   help="over HTTP: which deployment serves it")
    t.add_argument("--json", type=Path)
    i = sub.add_parser("idle")
    i.add_argument("--sessions", type=int, default=1000)
    i.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(trajectory(args) if args.what == "trajectory" else idle(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
