#!/usr/bin/env bash
# The main job on its built-in default: installs memtide, then runs `memtide run` (real GPU when
# one is usable, SimDevice otherwise). Extra arguments go to `memtide run` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
log "memtide run $*"
exec .venv/bin/memtide run "$@"
