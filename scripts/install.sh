#!/usr/bin/env bash
# Builds memtide (Release, CUDA when nvcc is available) and installs it into .venv:
# libmemtide.so, the memtide Python package and the `memtide` command.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
log "building and installing memtide into .venv (pip install .)"
start=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  .venv/bin/python -m pip install -q --no-build-isolation . 
log "memtide installed in $(( $(date +%s) - start )) s"
