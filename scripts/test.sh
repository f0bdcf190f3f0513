#!/usr/bin/env bash
# Every test: the C++ suites under ASan+UBSan, the multi-threaded stress test under TSan, a short
# fuzz run of the parsers, then the Python and torch suites against the installed package. CUDA suites run when a GPU answers
# and are skipped (with the reason) otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
export MEMTIDE_EXTRA_APT="chromium"  # the timeline report is opened in a headless browser
# The frameworks TieredAdamW is tested under (test_frameworks.py, docs/distributed.md); of torchtitan
# the tests import its optimizer container and Llama 3 model, which need only the five beside it.
export MEMTIDE_EXTRA_PIP="accelerate transformers lightning tyro spmd_types==0.2.3 einops torch_checkpointing torchdata"
export MEMTIDE_EXTRA_PIP_NODEPS="torchtitan"
source scripts/deps.sh
# They were deps.sh's to read; left in the environment, every memtide process would name them as
# variables that are no memtide option.
unset MEMTIDE_EXTRA_APT MEMTIDE_EXTRA_PIP MEMTIDE_EXTRA_PIP_NODEPS
jobs=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
t0=$(date +%s)

log "C++: configure + build (asan: -fsanitize=address,undefined)"
cmake --preset asan >/dev/null
cmake --build --preset asan -j "$jobs"
log "C++: ctest under ASan+UBSan"
ctest --preset asan -j "$jobs"

log "C++: stress tests under TSan (caching allocator; PinnedHeap on jemalloc and mimalloc; updates during backward; the thread pool and the CPU step's shared tiles; the checkpoint writer)"
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j "$jobs" --target memtide_stress_test memtide_pinned_heap_test memtide_tiering_tests memtide_core_tests
# setarch -R: TSan's shadow mapping cannot cope with high-entropy ASLR on newer kernels.
setarch "$(uname -m)" -R build/tsan/tests/allocator/memtide_stress_test
setarch "$(uname -m)" -R build/tsan/tests/allocator/memtide_pinned_heap_test --gtest_filter='*Stress*:*Thread*'
# BackwardUpdates' worker steps the engine's arrays while the hooks' thread goes on.
setarch "$(uname -m)" -R build/tsan/tests/tiering/memtide_tiering_tests --gtest_filter='BackwardUpdates*' --gtest_repeat=10
# Teams: a worker that wakes after the caller took all the work skips the job, and must not touch the next one.
setarch "$(uname -m)" -R build/tsan/tests/core/memtide_core_tests --gtest_filter='ThreadPool.*'
setarch "$(uname -m)" -R build/tsan/tests/tiering/memtide_tiering_tests --gtest_filter='AdamwCpu.ThreadCounts*:AdamwCpu.NonFinite*'
# A checkpoint's writer thread beside the step's protect(): copies, copies of the rest handed over mid-subgroup.
setarch "$(uname -m)" -R build/tsan/tests/tiering/memtide_tiering_tests --gtest_filter='StateSnapshot*:CopyBuffers*:FrozenState*'

log "C++: a short libFuzzer run of the options table and the hwloc XML loader (ASan+UBSan)"
bash scripts/fuzz.sh --runs 20000

log "Python: install memtide into .venv and run pytest"
CMAKE_BUILD_PARALLEL_LEVEL=$jobs .venv/bin/python -m pip install -q --no-build-isolation .
.venv/bin/python -m pytest tests -q -rs

log "all tests passed in $(( $(date +%s) - t0 )) s"
