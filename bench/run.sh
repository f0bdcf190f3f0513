#!/usr/bin/env bash
# Builds the benchmarks (Release) and writes bench/results/<date>-<machine>-allocator.md with the
# command, the machine, the build and every figure. Usage: bash bench/run.sh [machine-label]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
label=${1:-$(nproc)core-$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true) | tr ' ' '-' )}
label=${label%-}
cmake --preset release -DMEMTIDE_BUILD_TESTS=OFF >/dev/null
cmake --build --preset release --target memtide_bench_allocator
json=$(mktemp)
build/release/bench/memtide_bench_allocator --benchmark_format=console \
  --benchmark_out="$json" --benchmark_out_format=json
out="bench/results/$(date +%Y-%m-%d)-${label:-cpu}-allocator.md"
.venv/bin/python bench/report.py "$json" "$out" --command "bash bench/run.sh ${1:-}"
rm -f "$json"
log "wrote $out"
