// memtide's CPU kernels on torch's intra-op threads: a memtide::ParallelExecutor over
// at::parallel_for, set by memtide.torch_bridge.use_torch_threads() (TieredAdamW does it).
//
// Why: torch's OpenMP workers spin for a while after every parallel region (libgomp's default
// wait policy), so when the optimizer step follows backward, a second team of threads (memtide's
// own pool) shares the cores with spinning threads and loses bandwidth to them: on 2 cores the
// step ran at 0.77-0.92x of torch's fused AdamW in a training loop, while ahead of it cold.
// Handing the step's chunks to the team that is already awake leaves nobody to fight, whatever
// OMP_WAIT_POLICY says. Only ATen APIs that have been stable for years are used (torch 2.11 on).

#include <ATen/Parallel.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "memtide/core/log.hpp"
#include "memtide/core/thread_pool.hpp"

// With the OpenMP backend at::parallel_for is inline code whose `omp parallel` only exists when
// this file is compiled with OpenMP; without it torch's header quietly runs everything on the
// caller. Such a build offers no executor rather than a serial one.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#define MEMTIDE_TORCH_PARALLEL_USABLE 0
#else
#define MEMTIDE_TORCH_PARALLEL_USABLE 1
#endif

namespace {

thread_local std::string t_parallel_error;

// What the tests ask: did the calls run on torch's workers (at::get_thread_num() != 0 inside
// at::parallel_for is one of torch's intra-op threads, not the caller)?
std::atomic<std::uint64_t> g_jobs{0};
std::atomic<std::uint64_t> g_worker_calls{0};

void torch_run(std::size_t n, void (*body)(void*, std::size_t), void* ctx) {
  g_jobs.fetch_add(1, std::memory_order_relaxed);
  // grain 1: the pool asks for no more calls than torch has threads, so each thread makes one.
  at::parallel_for(0, static_cast<std::int64_t>(n), 1, [&](std::int64_t begin, std::int64_t end) {
    if (at::get_thread_num() != 0) g_worker_calls.fetch_add(static_cast<std::uint64_t>(end - begin), std::memory_order_relaxed);
    for (std::int64_t i = begin; i < end; ++i) body(ctx, static_cast<std::size_t>(i));
  });
}

std::size_t torch_threads() {
  const int n = at::get_num_threads();
  return n > 0 ? static_cast<std::size_t>(n) : 1;
}

constexpr memtide::ParallelExecutor kTorchExecutor{&torch_run, &torch_threads, "torch"};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char* memtide_torch_parallel_error(void) { return t_parallel_error.c_str(); }

/// Runs memtide's unbound pools' jobs (the CPU optimizer step) on torch's intra-op threads.
/// 0 on success; -1 with memtide_torch_parallel_error() set when this build cannot.
__attribute__((visibility("default"))) int memtide_torch_parallel_install(void) {
  t_parallel_error.clear();
#if MEMTIDE_TORCH_PARALLEL_USABLE
  try {
    const memtide::ParallelExecutor* before = memtide::set_parallel_executor(&kTorchExecutor);
    if (before != &kTorchExecutor) {
      MEMTIDE_LOG(info, "torch bridge: the CPU optimizer step runs on torch's intra-op threads (" +
                            std::to_string(torch_threads()) + ")");
    }
    return 0;
  } catch (const std::exception& e) {
    t_parallel_error = e.what();
    return -1;
  }
#else
  t_parallel_error = "the bridge was compiled without OpenMP, which this torch's at::parallel_for needs";
  return -1;
#endif
}

/// Back to memtide's own workers (when the executor set is this one). 0.
__attribute__((visibility("default"))) int memtide_torch_parallel_uninstall(void) {
  if (memtide::parallel_executor() == &kTorchExecutor) memtide::set_parallel_executor(nullptr);
  return 0;
}

/// 1 when memtide's unbound pools run on torch's threads.
__attribute__((visibility("default"))) int memtide_torch_parallel_active(void) {
  return memtide::parallel_executor() == &kTorchExecutor ? 1 : 0;
}

/// Jobs run so far, and how many of their calls ran on torch's workers rather than the caller.
__attribute__((visibility("default"))) void memtide_torch_parallel_counts(std::uint64_t* jobs,
                                                                          std::uint64_t* worker_calls) {
  *jobs = g_jobs.load(std::memory_order_relaxed);
  *worker_calls = g_worker_calls.load(std::memory_order_relaxed);
}

}  // extern "C"
