#!/usr/bin/env bash
# Builds the update-phase simulator and writes bench/results/sim-update/<date>.{md,csv} and
# <date>-dram110.csv (+ <date>-time-vs-k.png when matplotlib is available). Virtual time: the build type and the
# machine do not change the figures. Usage: bash tools/simulator/run_sim_update.sh [build-preset]
set -euo pipefail
cd "$(dirname "$0")/../.."
preset=${1:-release}
cmake --preset "$preset" >/dev/null  # only the simulator target is built below
nice -n 19 cmake --build --preset "$preset" --target memtide_sim_update
bin="build/$preset/tools/simulator/memtide_sim_update"
mkdir -p bench/results/sim-update
stem="bench/results/sim-update/$(date +%Y-%m-%d)"
"$bin" --csv "$stem.csv"
"$bin" --dram-gbs 110 --csv "$stem-dram110.csv"
py=.venv/bin/python
[ -x "$py" ] || py=python3
"$py" tools/simulator/sim_update_report.py "$stem.csv" "$stem.md" --png "$stem-time-vs-k.png" \
  --command "bash tools/simulator/run_sim_update.sh $preset" \
  --extra-csv "$stem-dram110.csv" --extra-label "host DRAM 110 GB/s per GPU (one socket's ~220 GB/s shared by its 2 GPUs)"
echo "wrote $stem.md"
