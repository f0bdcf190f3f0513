#pragma once
/// @file
/// A small persistent thread pool for memory-bound CPU kernels (the optimizer step).
///
/// Workers sleep on a condition variable between jobs: no spinning, so an idle pool costs nothing
/// and never competes with the training process for cores. `parallel_for` splits the chunk range
/// statically (participant i of T takes chunks [i*n/T, (i+1)*n/T)) and the calling thread is
/// participant 0, so a pool of T threads starts T-1 workers.
///
/// A pool not bound to cpus hands its jobs to the process's ParallelExecutor when one is set
/// (torch's intra-op threads, set by libmemtide_torch.so): see set_parallel_executor.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace memtide {

/// Threads that belong to someone else, which a pool's jobs can run on instead of its own workers.
///
/// Why: a training process already has a team of compute threads (torch's OpenMP workers), and
/// by default they spin for a while after every parallel region, backward's last kernels
/// included. A second team that wakes up for the optimizer step then shares the cores with
/// spinning threads (on 2 cores: half the step's bandwidth gone to a spinner). Running the step's
/// chunks on that same team leaves nobody to fight.
struct ParallelExecutor {
  /// Calls body(ctx, i) once for every i in [0, n) on at most threads() threads, the caller among
  /// them, and returns when every call has returned. body never throws; run must not either.
  void (*run)(std::size_t n, void (*body)(void*, std::size_t), void* ctx);
  /// How many threads run() spreads a job over at the moment (>= 1).
  std::size_t (*threads)();
  const char* name;  ///< for logs and `memtide info` ("torch")
};

/// Sets the process's executor (nullptr: every pool uses its own workers) and returns the previous
/// one. It must stay valid for the rest of the process (static storage). Jobs already running keep
/// the executor they started on. Pools bound to cpus (a GPU's NUMA-local pool) never use it: their
/// binding is the point of them.
const ParallelExecutor* set_parallel_executor(const ParallelExecutor* executor) noexcept;
/// The executor set now, or nullptr.
const ParallelExecutor* parallel_executor() noexcept;

class ThreadPool {
 public:
  /// `threads` participants including the caller (0 = std::thread::hardware_concurrency()).
  /// `cpus`: worker i is pinned to cpus[(i - 1) % cpus.size()] (the caller is never re-pinned);
  /// empty = no binding. A cpu that cannot be bound throws InvalidArgument.
  explicit ThreadPool(std::size_t threads = 0, std::vector<int> cpus = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Participants, the caller included (>= 1).
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size() + 1; }
  [[nodiscard]] const std::vector<int>& cpus() const noexcept { return cpus_; }
  /// The executor this pool's next job runs on (nullptr: its own workers).
  [[nodiscard]] const ParallelExecutor* executor() const noexcept;

  /// Calls fn(i) for every i in [0, n_chunks) and returns when all calls have finished. The first
  /// exception thrown by any call is rethrown here (after every participant has stopped). Calls
  /// from several threads are serialized; a call from inside a task runs inline on that thread.
  /// Participant p of T takes chunks [p*n/T, (p+1)*n/T), whichever threads run them (own workers
  /// or an executor's): which thread runs a chunk never changes what the chunk computes.
  template <typename F>
  void parallel_for(std::size_t n_chunks, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run(n_chunks, [](void* ctx, std::size_t i) { (*static_cast<Fn*>(ctx))(i); },
        const_cast<void*>(static_cast<const void*>(std::addressof(fn))));
  }

  /// Calls fn(p) on the caller (p = 0) and on each worker p < min(`participants`, size()) that joins before
  /// the caller's own call returns; returns when every call made has finished. Workers that wake
  /// later skip the job: fn must share its work out itself (tiles taken from a common pool), so
  /// that whoever runs finishes it, and the caller never waits for a wake-up that brings nothing.
  /// On an executor, fn(p) runs for every p < min(`participants`, the executor's threads()).
  /// Exceptions and nesting as in parallel_for.
  template <typename F>
  void parallel_team(std::size_t participants, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run(participants, [](void* ctx, std::size_t i) { (*static_cast<Fn*>(ctx))(i); },
        const_cast<void*>(static_cast<const void*>(std::addressof(fn))), /*team=*/true);
  }

 private:
  using Task = void (*)(void*, std::size_t);
  void run(std::size_t n_chunks, Task task, void* ctx, bool team = false);
  void run_on(const ParallelExecutor& executor, std::size_t n_chunks, std::size_t participants, Task task, void* ctx,
              bool team);
  void work(std::size_t participant, std::size_t participants, std::size_t n_chunks, Task task, void* ctx);
  void worker_main(std::size_t index);

  std::vector<int> cpus_;
  std::vector<std::thread> workers_;
  std::mutex submit_;  // one job at a time
  std::mutex mutex_;   // guards everything below
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::size_t pending_ = 0;  // workers still running the current job
  bool team_ = false;        // the current job is a parallel_team: workers join while it is open
  bool open_ = false;        // a team job still takes workers
  std::size_t job_chunks_ = 0;
  std::size_t job_participants_ = 0;
  Task job_task_ = nullptr;
  void* job_ctx_ = nullptr;
  std::exception_ptr error_;
};

/// The process-wide pool used by the C ABI and Python (hardware_concurrency threads, unbound).
/// Never destroyed.
ThreadPool& default_pool();

}  // namespace memtide
