"""C++ (issue 38): what a test, a compile and a cached compile cost, against their physical limits.

    python benchmarks/cpp.py [--rounds 5] [--tests 50] [--json out.json]

Four measures, each in turns within one run (needs root and the cpp-gcc12 toolchain built):

- per test: one judge call of `--tests` + 1 tests of a trivial program (read two numbers, print their
  sum) and one of 1 test, at the engine (a SlotPool of one slot, no HTTP); the per-test cost is their
  difference over `--tests`. Its physical limit: the same static binary started `--tests` times on
  the host by posix_spawn with a pipe for stdin and stdout, waited for, no jail. Reported: limit /
  judge (1 is the limit; the issue's bound is 0.8).
- compile in the jail against the host: one `bits/stdc++.h` program (a new comment each time, so no
  cache), compiled in the compile jail (`Compiler._run`: nsjail, cgroup, uid) and by the same
  toolchain's g++ with the same flags on the host (chroot into the toolchain's root, in a mount
  namespace of its own: no user namespace, no cgroup, no limits). Reported: host wall / jail wall
  (the issue's bound: >= 0.9).
- precompiled header: the same jail compile with the preset's header and without it (the preset's
  flags less its include dir). Reported: with / without (bound: <= 0.5).
- verl's per-test pattern: one submission with `--tests` different stdins sent as that many
  concurrent SandboxFusion `/run_code` requests to a real `codeenv serve`, compile cache on against a
  second one with CODEENV_CPP_CACHE_MB=0; each round's source is new. Reported: on / off wall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

SUM = """#include <bits/stdc++.h>
using namespace std;
int main() { long long a, b; cin >> a >> b; cout << a + b << "\\n"; }
"""


def spread(samples: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(samples), 3), "min": round(min(samples), 3),
            "max": round(max(samples), 3), "rounds": len(samples)}


def spawn_per_run_s(binary: Path, runs: int) -> float:
    """The physical limit of a test: the binary started, fed, read and waited for, `runs` times."""
    t0 = time.perf_counter()
    for i in range(runs):
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        pid = os.posix_spawn(str(binary), ["solution"], {}, file_actions=[
            (os.POSIX_SPAWN_DUP2, stdin_r, 0), (os.POSIX_SPAWN_DUP2, stdout_w, 1)])
        os.close(stdin_r)
        os.close(stdout_w)
        os.write(stdin_w, f"{i} 2\n".encode())
        os.close(stdin_w)
        out = b""
        while chunk := os.read(stdout_r, 65536):
            out += chunk
        os.close(stdout_r)
        os.waitpid(pid, 0)
        assert out == f"{i + 2}\n".encode(), out
    return (time.perf_counter() - t0) / runs


def tests_of(n: int) -> list[dict[str, str]]:
    return [{"stdin": f"{i} 2", "expected_stdout": f"{i + 2}"} for i in range(n)]


async def engine_measures(rounds: int, tests: int) -> dict[str, Any]:
    from codeenv import ExecRequest, SandboxSettings, SlotPool
    from codeenv.models import JudgeRequest

    async with SlotPool(SandboxSettings(slots=1)) as pool:
        compiler = pool.compiler
        assert compiler is not None and pool._tree is not None
        group = pool._tree.group("slot0-compile")
        uid = pool.uid_base
        flags = compiler.flags("codeforces", None)
        no_pch = [f for f in flags if not f.startswith("-I/")]
        toolchain = compiler.toolchain()

        async def judged(n: int) -> float:
            request = JudgeRequest(code=SUM, language="cpp", tests=tests_of(n), limits={"cpu_s": 1}).to_call()
            t0 = time.perf_counter()
            result = await pool.run(request)
            wall = time.perf_counter() - t0
            assert result.judge is not None and result.judge.passed == n, result
            return wall

        await pool.run(ExecRequest(code=SUM, language="cpp", stdin="1 2"))  # compiled and cached
        cached = compiler.cache.get(compiler.key(SUM.encode(), flags))
        assert cached is not None and cached[0] is not None
        work = Path(tempfile.mkdtemp(prefix="codeenv-cpp-bench-"))
        binary = work / "solution"
        binary.write_bytes(cached[0])
        binary.chmod(0o755)
        count = 0

        async def jail_compile(use: list[str]) -> float:
            nonlocal count
            count += 1
            source = f"{SUM}// {os.getpid()} {count} {time.time_ns()}\n".encode()
            t0 = time.perf_counter()
            compiled = await compiler._run(source, use, uid, group)
            wall = time.perf_counter() - t0
            assert compiled.binary is not None, compiled.info
            return wall

        def host_compile() -> float:
            nonlocal count
            count += 1
            src = work / f"src{count}"
            src.mkdir()
            (src / "solution.cpp").write_text(f"{SUM}// host {count} {time.time_ns()}\n")
            script = ('mount --bind "$1" "$2/work" && mount -t tmpfs tmpfs "$2/tmp" && shift 2 && '
                      'exec chroot "$ROOT" "$@"')
            argv = ["unshare", "--mount", "sh", "-c", script, "sh", str(src), str(toolchain.root),
                    toolchain.spec.compiler, *flags, "-o", "/work/solution", "/work/solution.cpp"]
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, env={"ROOT": str(toolchain.root), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
            wall = time.perf_counter() - t0
            assert (src / "solution").is_file()
            return wall

        samples: dict[str, list[float]] = {k: [] for k in (
            "judge_per_test_ms", "limit_per_test_ms", "jail_compile_s", "host_compile_s", "pch_compile_s",
            "no_pch_compile_s")}
        try:
            for r in range(rounds):
                first = r % 2 == 0
                for turn in ((0, 1) if first else (1, 0)):
                    if turn == 0:
                        one, many = await judged(1), await judged(tests + 1)
                        samples["judge_per_test_ms"].append((many - one) / tests * 1000)
                    else:
                        samples["limit_per_test_ms"].append(spawn_per_run_s(binary, tests) * 1000)
                for turn in ((0, 1) if first else (1, 0)):
                    if turn == 0:
                        samples["jail_compile_s"].append(await jail_compile(flags))
                    else:
                        samples["host_compile_s"].append(await asyncio.to_thread(host_compile))
                for turn in ((0, 1) if first else (1, 0)):
                    key = "pch_compile_s" if turn == 0 else "no_pch_compile_s"
                    samples[key].append(await jail_compile(flags if turn == 0 else no_pch))
        finally:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    ratios = {
        "per_test_limit_over_judge": [lim / j for lim, j in zip(samples["limit_per_test_ms"],
                                                                samples["judge_per_test_ms"], strict=True)],
        "compile_host_over_jail": [h / j for h, j in zip(samples["host_compile_s"], samples["jail_compile_s"],
                                                         strict=True)],
        "compile_pch_over_without": [p / n for p, n in zip(samples["pch_compile_s"], samples["no_pch_compile_s"],
                                                           strict=True)],
    }
    return {"samples": {k: [round(x, 4) for x in v] for k, v in samples.items()},
            "medians": {k: round(statistics.median(v), 4) for k, v in samples.items()},
            "ratios": {k: spread(v) for k, v in ratios.items()}}


async def verl_pattern(rounds: int, tests: int) -> dict[str, Any]:
    from codeenv.bench.services import free_port, start_codeenv

    slots = str(os.cpu_count() or 1)
    on = start_codeenv("serve", "--slots", slots, "--log-level", "warning", port=free_port())
    off = start_codeenv("serve", "--slots", slots, "--log-level", "warning", port=free_port(),
                        env={**os.environ, "CODEENV_CPP_CACHE_MB": "0"})
    samples: dict[str, list[float]] = {"cache_on_s": [], "cache_off_s": []}
    try:
        await on.await_ready(120)
        await off.await_ready(120)

        async def submission(url: str, tag: str) -> float:
            code = f"{SUM}// {tag} {time.time_ns()}\n"
            gate = asyncio.Semaphore(2 * int(slots))
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                async def one(i: int) -> None:
                    async with gate:
                        r = await client.post("/run_code", json={"code": code, "language": "cpp",
                                                                 "stdin": f"{i} 2", "run_timeout": 5})
                    body = r.json()
                    assert body["status"] == "Success" and body["run_result"]["stdout"] == f"{i + 2}\n", body

                t0 = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(tests)))
                return time.perf_counter() - t0

        await submission(on.url, "warm")
        await submission(off.url, "warm")
        for r in range(rounds):
            for which in (("on", "off") if r % 2 == 0 else ("off", "on")):
                url = on.url if which == "on" else off.url
                samples[f"cache_{which}_s"].append(await submission(url, f"{which}{r}"))
    finally:
        on.stop(60)
        off.stop(60)
    ratios = [a / b for a, b in zip(samples["cache_on_s"], samples["cache_off_s"], strict=True)]
    return {"samples": {k: [round(x, 3) for x in v] for k, v in samples.items()},
            "medians": {k: round(statistics.median(v), 3) for k, v in samples.items()},
            "ratio_on_over_off": spread(ratios)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tests", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engine = await engine_measures(args.rounds, args.tests)
    verl = await verl_pattern(args.rounds, args.tests)
    console = Console()
    m, r = engine["medians"], engine["ratios"]
    console.print(f"per test: judge {m['judge_per_test_ms']} ms, limit {m['limit_per_test_ms']} ms; "
                  f"limit/judge {r['per_test_limit_over_judge']}")
    console.print(f"compile: jail {m['jail_compile_s']} s, host {m['host_compile_s']} s; host/jail "
                  f"{r['compile_host_over_jail']}")
    console.print(f"header: with {m['pch_compile_s']} s, without {m['no_pch_compile_s']} s; with/without "
                  f"{r['compile_pch_over_without']}")
    console.print(f"verl, {args.tests} /run_code: cache on {verl['medians']['cache_on_s']} s, off "
                  f"{verl['medians']['cache_off_s']} s; on/off {verl['ratio_on_over_off']}")
    if args.json:
        args.json.write_text(json.dumps({"tests": args.tests, "rounds": args.rounds, "engine": engine,
                                         "verl": verl}, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
