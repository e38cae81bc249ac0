"""The API contract: schemathesis, every check, against a real running codeenv in both queue modes.

    python scripts/contract.py [--max-examples N] [--mode embedded|redis]...

Starts `codeenv serve` on a free port in each mode (embedded: its own pool; redis: a private
redis-server and a gateway with its local worker), one after the other, then runs `schemathesis run
URL/openapi.json --checks all` against them side by side (settings in schemathesis.toml), stops
what it started by PID, and exits non-zero if any run failed. Every operation in the document is
tested: a new endpoint joins by being in it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from codeenv.bench.services import Service, free_port, start_codeenv, start_redis

ROOT = Path(__file__).resolve().parent.parent


def start(mode: str, logs: Path, started: list[Service]) -> Service:
    # A small max_batch keeps the biggest batches the fuzzer sends to seconds; the document says it.
    env = {"PATH": "/usr/bin:/bin", "CODEENV_MAX_BATCH": "32", "CODEENV_SESSION_IDLE_TTL_S": "30"}
    if mode == "redis":
        redis = start_redis()
        started.append(redis)
        env["CODEENV_REDIS_URL"] = redis.url
        env["CODEENV_REDIS_PREFIX"] = f"contract-{os.getpid()}"
    service = start_codeenv("serve", "--log-level", "warning", port=free_port(), env=env, log=logs / f"{mode}.log")
    started.append(service)
    return service.wait_ready(300)


def check(mode: str, url: str, max_examples: int, seed: int) -> tuple[int, str]:
    t0 = time.monotonic()
    command = [str(Path(sys.executable).parent / "schemathesis"), "run", f"{url}/openapi.json",
               "--checks", "all", "--max-examples", str(max_examples), "--seed", str(seed),
               "--request-timeout", "60", "--max-failures", "20"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "contract_hooks",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, env=env)
    return done.returncode, (f"== {mode}: {' '.join(command)}\n{done.stdout}{done.stderr}"
                             f"== {mode}: exit status {done.returncode} in {time.monotonic() - t0:.0f}s\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-examples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--mode", action="append", choices=["embedded", "redis"])
    args = parser.parse_args()
    modes = args.mode or ["embedded", "redis"]
    started: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="codeenv-contract-") as logs:
        try:
            try:
                urls = [start(mode, Path(logs), started).url for mode in modes]
            except Exception:
                for log in Path(logs).glob("*.log"):
                    print(f"== {log.name}:\n{log.read_text()[-4000:]}", file=sys.stderr)
                raise
            with ThreadPoolExecutor(len(modes)) as pool:  # side by side: half the wall time
                runs = list(pool.map(lambda m: check(*m, args.max_examples, args.seed),
                                     zip(modes, urls, strict=True)))
        finally:
            for svc in reversed(started):
                svc.kill()
    for _, output in runs:
        print(output, flush=True)
    failed = [mode for mode, (status, _) in zip(modes, runs, strict=True) if status]
    if failed:
        sys.exit(f"the API contract failed in: {', '.join(failed)}")


if __name__ == "__main__":
    main()
