#!/usr/bin/env bash
# Writes bench/results/sim-update/<date>.{md,csv} and <date>-dram110.csv (+ <date>-time-vs-k.png
# when matplotlib is available) with `memtide simulate --update-sweep`. Virtual time: the machine
# does not change the figures (only wall_ms). Usage: bash tools/simulator/run_sim_update.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
[ -x "$py" ] || py=python3
mkdir -p bench/results/sim-update
stem="bench/results/sim-update/$(date +%Y-%m-%d)"
"$py" -m memtide simulate --update-sweep --csv "$stem.csv"
"$py" -m memtide simulate --update-sweep --dram 110 --csv "$stem-dram110.csv"
"$py" tools/simulator/sim_update_report.py "$stem.csv" "$stem.md" --png "$stem-time-vs-k.png" \
  --command "bash tools/simulator/run_sim_update.sh" \
  --extra-csv "$stem-dram110.csv" --extra-label "host DRAM 110 GB/s per GPU (one socket's ~220 GB/s shared by its 2 GPUs)"
echo "wrote $stem.md"
