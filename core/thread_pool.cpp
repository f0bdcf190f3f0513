#include "memtide/core/thread_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/no_destructor.hpp"

namespace memtide {
namespace {

// The pool whose task this thread is running, to run nested parallel_fors inline.
thread_local const ThreadPool* t_inside = nullptr;

std::atomic<const ParallelExecutor*> g_executor{nullptr};

// One job on an executor: its calls map onto the pool's participants, so the chunks each call
// takes are those the same participant would take on the pool's own workers.
struct ExecutorJob {
  const ThreadPool* pool;
  void (*task)(void*, std::size_t);
  void* ctx;
  std::size_t n_chunks;
  std::size_t participants;
  bool team;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
};

void run_executor_call(void* job_ptr, std::size_t p) {
  ExecutorJob& job = *static_cast<ExecutorJob*>(job_ptr);
  const ThreadPool* outer = t_inside;
  t_inside = job.pool;
  try {
    if (job.team) {
      job.task(job.ctx, p);
    } else {
      const std::size_t end = job.n_chunks * (p + 1) / job.participants;
      for (std::size_t i = job.n_chunks * p / job.participants; i < end; ++i) job.task(job.ctx, i);
    }
  } catch (...) {
    if (!job.failed.test_and_set()) job.error = std::current_exception();
  }
  t_inside = outer;
}

void bind_to_cpu(std::thread& t, int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) throw InvalidArgument("ThreadPool: cpu " + std::to_string(cpu) + " is out of range");
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);
  if (rc != 0) throw InvalidArgument("ThreadPool: cannot bind a worker to cpu " + std::to_string(cpu) + " (error " + std::to_string(rc) + ")");
}

}  // namespace

const ParallelExecutor* set_parallel_executor(const ParallelExecutor* executor) noexcept {
  return g_executor.exchange(executor, std::memory_order_acq_rel);
}

const ParallelExecutor* parallel_executor() noexcept { return g_executor.load(std::memory_order_acquire); }

const ParallelExecutor* ThreadPool::executor() const noexcept {
  return cpus_.empty() ? parallel_executor() : nullptr;
}

ThreadPool::ThreadPool(std::size_t threads, std::vector<int> cpus) : cpus_(std::move(cpus)) {
  if (threads == 0) threads = std::max(1U, std::thread::hardware_concurrency());
  workers_.reserve(threads - 1);
  try {
    for (std::size_t i = 1; i < threads; ++i) {
      workers_.emplace_back([this, i] { worker_main(i); });
      if (!cpus_.empty()) bind_to_cpu(workers_.back(), cpus_[(i - 1) % cpus_.size()]);
    }
  } catch (...) {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::work(std::size_t participant, std::size_t participants, std::size_t n_chunks, Task task, void* ctx) {
  const std::size_t begin = n_chunks * participant / participants;
  const std::size_t end = n_chunks * (participant + 1) / participants;
  const ThreadPool* outer = t_inside;
  t_inside = this;
  try {
    for (std::size_t i = begin; i < end; ++i) task(ctx, i);
  } catch (...) {
    std::lock_guard lock(mutex_);
    if (!error_) error_ = std::current_exception();
  }
  t_inside = outer;
}

void ThreadPool::worker_main(std::size_t index) {
  std::uint64_t seen = 0;
  for (;;) {
    std::size_t chunks = 0, participants = 0;
    Task task = nullptr;
    void* ctx = nullptr;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= job_participants_) continue;  // not needed for this job
      if (team_) {
        if (!open_) continue;  // the caller finished the team's work without this worker
        ++pending_;
      }
      chunks = job_chunks_;
      participants = job_participants_;
      task = job_task_;
      ctx = job_ctx_;
    }
    work(index, participants, chunks, task, ctx);
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::run(std::size_t n_chunks, Task task, void* ctx, bool team) {
  if (n_chunks == 0) return;
  if (team) n_chunks = std::min(n_chunks, size());  // one call per participant, at most
  const std::size_t participants = std::min(n_chunks, size());
  if (participants == 1 || t_inside == this) {
    if (team) {
      task(ctx, 0);  // a team of one: the caller does all its work
      return;
    }
    for (std::size_t i = 0; i < n_chunks; ++i) task(ctx, i);
    return;
  }
  if (const ParallelExecutor* executor = this->executor()) {
    run_on(*executor, n_chunks, participants, task, ctx, team);
    return;
  }
  std::lock_guard submit(submit_);
  {
    std::lock_guard lock(mutex_);
    job_chunks_ = n_chunks;
    job_participants_ = participants;
    job_task_ = task;
    job_ctx_ = ctx;
    team_ = team;
    open_ = team;
    pending_ = team ? 0 : participants - 1;  // a team's workers count themselves in as they join
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  // A team's chunks are its participants: work() hands participant p the call fn(p).
  work(0, participants, n_chunks, task, ctx);
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    open_ = false;  // a worker not in yet finds the team closed
    done_.wait(lock, [&] { return pending_ == 0; });
    error = std::exchange(error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::run_on(const ParallelExecutor& executor, std::size_t n_chunks, std::size_t participants, Task task,
                        void* ctx, bool team) {
  // Not more calls than the executor has threads: a call that waits for a thread that is busy
  // with another call's chunks would serialize them behind it.
  participants = std::min(participants, std::max<std::size_t>(1, executor.threads()));
  ExecutorJob job{this, task, ctx, n_chunks, participants, team, ATOMIC_FLAG_INIT, nullptr};
  std::lock_guard submit(submit_);  // one job at a time, as on the pool's own workers
  if (participants == 1) {
    run_executor_call(&job, 0);  // a team of one, or all chunks: no thread to hand anything to
  } else {
    executor.run(participants, &run_executor_call, &job);
  }
  if (job.error) std::rethrow_exception(job.error);
}

ThreadPool& default_pool() {
  static NoDestructor<ThreadPool> pool;
  return *pool;
}

}  // namespace memtide
