#pragma once
/// @file
/// A small persistent thread pool for memory-bound CPU kernels (the optimizer step).
///
/// Workers sleep on a condition variable between jobs: no spinning, so an idle pool costs nothing
/// and never competes with the training process for cores. `parallel_for` splits the chunk range
/// statically (participant i of T takes chunks [i*n/T, (i+1)*n/T)) and the calling thread is
/// participant 0, so a pool of T threads starts T-1 workers.

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

  /// Calls fn(i) for every i in [0, n_chunks) and returns when all calls have finished. The first
  /// exception thrown by any call is rethrown here (after every participant has stopped). Calls
  /// from several threads are serialized; a call from inside a task runs inline on that thread.
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
