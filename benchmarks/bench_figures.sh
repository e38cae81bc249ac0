#!/usr/bin/env bash
# Every figure of the "codeenv bench" section of benchmarks/README.md, in one go (about 20 minutes
# on 2 cores). Reports (JSON + PNG) go to the directory given (default: benchmarks/results-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:-benchmarks/results-bench}")"
mkdir -p "$OUT"
bench() { .venv/bin/codeenv bench --out "$OUT/$1" "${@:2}"; }
saturated() {  # the calls/s of the first target in the newest report under $OUT/$1
    .venv/bin/python -c "import json,glob,sys; r=json.load(open(sorted(glob.glob('$OUT/$1/*.json'))[-1]));
print(next(iter(r['targets'].values()))['throughput_per_s'])"
}
SAT="--mode concurrency --concurrency 16 --calls 400 --rounds 2"
bench math-embedded --target codeenv --compare naive --workload math $SAT --limit
bench math-redis --target codeenv-redis --compare naive --workload math $SAT --limit
bench print --target codeenv --compare naive --workload print --mode concurrency --concurrency 32 --calls 2000 --rounds 2
# The same through codeenv's own client, which batches the calls in flight (both targets).
bench print-client --target codeenv --compare naive --api codeenv-client --workload print --mode concurrency \
    --concurrency 64 --calls 2000 --rounds 2
# Overhead per call at 80% of the saturated throughput just measured (open loop, Poisson arrivals).
for w in math print; do
    rate=$(.venv/bin/python -c "print(round(0.8 * $(saturated $( [ $w = math ] && echo math-embedded || echo print)), 2))")
    calls=$( [ $w = math ] && echo 400 || echo 2000 )
    bench "$w-80pct" --target codeenv --workload $w --mode rate --rate "$rate" --calls "$calls" --poisson
done
bench grpo-default --target codeenv --compare naive   # the default GRPO scenario
