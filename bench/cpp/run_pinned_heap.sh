#!/usr/bin/env bash
# Builds the PinnedHeap benchmark (Release) and writes bench/results/pinned-heap/<date>-<machine>.md
# with the command, the machine, the build and every figure. Usage: bash bench/cpp/run_pinned_heap.sh [machine-label]
# Needs only python3's standard library for the report (not the .venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
label=${1:-$(nproc)core-$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true) | tr ' ' '-' )}
label=${label%-}
cmake --preset release -DMEMTIDE_BUILD_TESTS=OFF >/dev/null
cmake --build --preset release --target memtide_bench_pinned_heap
json=$(mktemp)
build/release/bench/cpp/memtide_bench_pinned_heap --benchmark_format=console \
  --benchmark_out="$json" --benchmark_out_format=json
out="bench/results/pinned-heap/$(date +%Y-%m-%d)-${label:-cpu}.md"
mkdir -p "$(dirname "$out")"
python3 bench/cpp/report.py "$json" "$out" --title "PinnedHeap benchmarks" --command "bash bench/cpp/run_pinned_heap.sh ${1:-}"
rm -f "$json"
echo "wrote $out"
