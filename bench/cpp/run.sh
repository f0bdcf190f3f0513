#!/usr/bin/env bash
# Builds a benchmark program (Release) and writes bench/results/<suite>/<date>-<machine>.md with
# the command, the machine, the build and every figure.
# Usage: bash bench/cpp/run.sh [machine-label]             (allocator benchmarks)
#        SUITE=host bash bench/cpp/run.sh [machine-label]  (host tier: pinning cost, HostArena latency)
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/deps.sh
label=${1:-$(nproc)core-$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || true) | tr ' ' '-' )}
label=${label%-}
suite=${SUITE:-allocator}
case "$suite" in
  allocator) name=allocator; title="Allocator benchmarks" ;;
  host) name=host-arena; title="Host tier benchmarks (HostArena)" ;;
  *) echo "SUITE=$suite is not accepted: expected allocator or host" >&2; exit 2 ;;
esac
cmake --preset release -DMEMTIDE_BUILD_TESTS=OFF >/dev/null
cmake --build --preset release --target "memtide_bench_$suite"
json=$(mktemp)
"build/release/bench/cpp/memtide_bench_$suite" --benchmark_format=console \
  --benchmark_out="$json" --benchmark_out_format=json
out="bench/results/$name/$(date +%Y-%m-%d)-${label:-cpu}.md"
mkdir -p "$(dirname "$out")"
prefix=""
[ "$suite" = allocator ] || prefix="SUITE=$suite "
.venv/bin/python bench/cpp/report.py "$json" "$out" --title "$title" --command "${prefix}bash bench/cpp/run.sh ${1:-}"
rm -f "$json"
log "wrote $out"
