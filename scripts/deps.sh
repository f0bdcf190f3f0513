#!/usr/bin/env bash
# Installs what building and testing memtide needs, on a fresh Debian/Ubuntu machine or an
# existing one: Debian packages (when missing, via apt-get) and a Python virtual environment in
# .venv with torch and the build tools (via pip). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # sourced (test.sh, install.sh) or run: the repository root either way

log() { printf '\033[1m[deps]\033[0m %s\n' "$*"; }

# libnuma/hwloc: host-tier placement; jemalloc/mimalloc: PinnedHeap backends; liburing + xxHash:
# the NVMe tier (io_uring, checksums).
# clang + libclang-rt-14-dev: libFuzzer for scripts/fuzz.sh.
APT_PACKAGES=(cmake ninja-build g++ pkg-config libgtest-dev libgmock-dev libbenchmark-dev
  libnuma-dev libhwloc-dev hwloc libjemalloc-dev libmimalloc-dev liburing-dev libxxhash-dev clang libclang-rt-14-dev)
# What only one script needs (scripts/test.sh: chromium, the headless browser of the timeline test).
read -r -a extra <<< "${MEMTIDE_EXTRA_APT:-}"
APT_PACKAGES+=("${extra[@]}")
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ! python3 -m venv --help >/dev/null 2>&1; then missing+=(python3-venv); fi
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
# torch is the large one (~3 GB with its CUDA wheels); pip skips it when already present.
PIP_PACKAGES=(torch numpy pytest nanobind scikit-build-core)
if ! .venv/bin/python -c "import torch, numpy, pytest, nanobind, scikit_build_core" >/dev/null 2>&1; then
  log "installing Python packages into .venv: ${PIP_PACKAGES[*]}"
  start=$(date +%s)
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q --progress-bar off "${PIP_PACKAGES[@]}"
  log "Python packages installed in $(( $(date +%s) - start )) s"
fi
# Installs the packages named in $1 (a space-separated list) that .venv lacks, with pip's further
# arguments $2.. (e.g. --no-deps).
pip_missing() {
  local wanted missing=() p
  read -r -a wanted <<< "$1"
  shift
  for p in "${wanted[@]}"; do
    .venv/bin/python -m pip show -q "${p%%[=<>]*}" >/dev/null 2>&1 || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing Python packages into .venv${*:+ ($*)}: ${missing[*]}"
    .venv/bin/python -m pip install -q --progress-bar off "$@" "${missing[@]}"
  fi
}
# What only one script needs (scripts/test.sh: the frameworks TieredAdamW is tested under).
pip_missing "${MEMTIDE_EXTRA_PIP:-}"
# Packages whose own requirements are far more than what memtide's tests import of them
# (torchtitan: wandb, tensorboard, datasets, ...): installed without them; MEMTIDE_EXTRA_PIP names
# the few that are needed.
pip_missing "${MEMTIDE_EXTRA_PIP_NODEPS:-}" --no-deps

# nvcc is optional: CudaDevice is built when it is on PATH or in the usual toolkit location.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
