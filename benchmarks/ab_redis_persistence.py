"""What Redis persistence costs codeenv's Redis mode: no persistence (A) against an append-only file
written every second (B, `--appendonly yes --appendfsync everysec`), in one run, turns alternating.

    python benchmarks/ab_redis_persistence.py [--rounds 5] [--batches 20] [--json out.json]

Two redis-servers side by side, each behind its own `codeenv serve --redis URL --slots 2` (gateway
and a local worker); each turn sends `--batches` batches of 100 print(1) calls to one of them
through POST /v1/execute/batch. B/A of calls/s per round, median (min to max): > 1 means
persistence costs nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_revisions import spread  # this directory: run as a script  # noqa: E402

from codeenv.bench.services import Service, free_port, start_codeenv  # noqa: E402

CONFIGS = {"a": ["--appendonly", "no"], "b": ["--appendonly", "yes", "--appendfsync", "everysec"]}


def redis(config: list[str], data: Path) -> Service:
    port = free_port()
    argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--dir", str(data), *config]
    return Service("redis-server", argv, port=port, url=f"redis://127.0.0.1:{port}/0").start().wait_ready(30)


def turn(url: str, batches: int) -> float:
    body = {"requests": [{"code": "print(1)"} for _ in range(100)]}
    with httpx.Client(base_url=url, timeout=120) as client:
        t0 = time.perf_counter()
        for _ in range(batches):
            results = client.post("/v1/execute/batch", json=body).json()["results"]
            assert all(r["status"] == "ok" for r in results), results[:2]
        return batches * 100 / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory(prefix="codeenv-ab-redis-") as tmp:
        servers, services = {}, {}
        try:
            for side, config in CONFIGS.items():
                (Path(tmp) / side).mkdir()
                servers[side] = redis(config, Path(tmp) / side)
                services[side] = start_codeenv("serve", "--redis", servers[side].url, "--slots", "2",
                                               "--log-level", "warning", port=free_port())
            for service in services.values():
                service.wait_ready(120)
                turn(service.url, 2)  # warm
            for r in range(args.rounds):
                for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                    samples[side].append(turn(services[side].url, args.batches))
                print(f"round {r + 1}: a {samples['a'][-1]:.0f} calls/s, b {samples['b'][-1]:.0f} calls/s")
        finally:
            for service in services.values():
                service.stop(60)
            for server in servers.values():
                server.kill()
    ratios = [b / a for a, b in zip(samples["a"], samples["b"], strict=True)]
    report = {"a": "no persistence", "b": "appendonly everysec", "rounds": args.rounds,
              "calls_per_s": {k: statistics.median(v) for k, v in samples.items()},
              "ratio_b_over_a": spread(ratios), "samples": samples}
    print(json.dumps(report["ratio_b_over_a"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
