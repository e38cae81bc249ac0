"""What the kernel alone charges for a fork on this machine: the floor under a session's fork (issue 37).

    python benchmarks/fork_floor.py [--mb 0 64 256] [--dict 200000] [--rounds 5] [--json out.json]

A plain Python process of this interpreter (no jail, no cgroup of its own, no codeenv) holding
`--dict` entries in a dict (as `forks.py --siblings` gives its session) and a bytearray of each
`--mb` size, every page written, forks 8 times in a row; each child exits at once and is reaped
after the 8th fork. Reported per size: its resident size, and the p50 over rounds of one fork and of
the 8 forks. A fork copies the parent's page tables (one entry per 4 kB page it has written) and
write-protects them, so its cost grows with the resident size; `forks.py --siblings` forks a session
of some 100 MB eight times in a row in the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def eight_forks() -> list[float]:
    """Eight forks in a row, each child exiting at once; each fork's own time, in seconds."""
    times, pids = [], []
    for _ in range(8):
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append(time.perf_counter() - t0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[0, 64, 256])
    parser.add_argument("--dict", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    table = {i: i * i for i in range(args.dict)}
    figures = []
    for mb in args.mb:
        ballast = bytearray(mb << 20)
        for i in range(0, len(ballast), 4096):
            ballast[i] = 1
        one, eight = [], []
        for _ in range(args.rounds):
            times = eight_forks()
            one.append(statistics.median(times))
            eight.append(sum(times))
            time.sleep(0.1)
        figures.append({"ballast_mb": mb, "dict_entries": len(table), "resident_mb": resident_mb(),
                        "fork_p50_ms": round(statistics.median(one) * 1000, 3),
                        "forks_8_p50_ms": round(statistics.median(eight) * 1000, 3)})
        del ballast
    text = json.dumps({"rounds": args.rounds, "figures": figures}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
