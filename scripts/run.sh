#!/usr/bin/env bash
# The main job on its built-in default: installs memtide, then runs `memtide run`, which trains a
# small GPT-style model with memtide.optim.TieredAdamW (on the GPU when one is usable, on CPU
# tensors otherwise). Extra arguments go to `memtide run` (see --help; --trace replays the
# allocation trace instead).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install.sh
log "memtide run $*"
exec .venv/bin/memtide run "$@"
