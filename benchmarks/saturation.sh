#!/usr/bin/env bash
# Overhead per call at 80% of saturation against the idle single call (issue 44), in one run against
# one `codeenv serve --slots 2`: per workload (print, then math) idle (1 in flight), saturated
# (closed loop), 80% of that rate (open loop, Poisson arrivals), idle again. `codeenv bench` reports
# (JSON + PNG) go to the directory given (default: benchmarks/results-saturation). About 3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:-benchmarks/results-saturation}")"
mkdir -p "$OUT"
PORT=$(.venv/bin/python -c "from codeenv.bench.services import free_port; print(free_port())")
.venv/bin/codeenv serve --slots 2 --log-level warning --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill $SERVE; wait $SERVE' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/readyz" > /dev/null && break; sleep 0.5; done
URL="http://127.0.0.1:$PORT"
# A wrong answer makes `codeenv bench` exit 1; its report says so, and the run goes on.
bench() { .venv/bin/codeenv bench --target "$URL" --out "$OUT/$1" "${@:2}" > "$OUT/$1.txt" 2>&1 || true; }
throughput() {  # calls/s of the newest report under $OUT/$1
    .venv/bin/python -c "import json,glob; r=json.load(open(sorted(glob.glob('$OUT/$1/*.json'))[-1]));
print(next(iter(r['targets'].values()))['throughput_per_s'])"
}
for w in print math; do
    if [ "$w" = math ]; then idle=60 calls=300 inflight=16; else idle=300 calls=1500 inflight=32; fi
    bench "$w-idle" --workload "$w" --mode concurrency --concurrency 1 --calls "$idle"
    bench "$w-sat" --workload "$w" --mode concurrency --concurrency "$inflight" --calls "$calls"
    rate=$(.venv/bin/python -c "print(round(0.8 * $(throughput "$w-sat"), 2))")
    bench "$w-80" --workload "$w" --mode rate --rate "$rate" --calls "$calls" --poisson
    bench "$w-idle2" --workload "$w" --mode concurrency --concurrency 1 --calls "$idle"
    echo "$w: saturated at $(throughput "$w-sat") calls/s; 80% = $rate calls/s"
done
