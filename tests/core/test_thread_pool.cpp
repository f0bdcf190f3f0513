#include "memtide/core/thread_pool.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <numeric>
#include <stdexcept>
#include <vector>

using memtide::ThreadPool;

TEST(ThreadPool, ParallelSumMatchesSerial) {
  for (std::size_t threads : {1U, 2U, 3U, 8U}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    std::vector<std::uint64_t> values(100003);
    std::iota(values.begin(), values.end(), 1);
    const std::size_t chunks = 37;
    std::vector<std::uint64_t> partial(chunks, 0);
    pool.parallel_for(chunks, [&](std::size_t c) {
      const std::size_t b = values.size() * c / chunks, e = values.size() * (c + 1) / chunks;
      for (std::size_t i = b; i < e; ++i) partial[c] += values[i];
    });
    const std::uint64_t n = values.size();
    EXPECT_EQ(std::accumulate(partial.begin(), partial.end(), std::uint64_t{0}), n * (n + 1) / 2) << threads;
  }
}

TEST(ThreadPool, EveryChunkRunsExactlyOnce) {
  ThreadPool pool(4);
  for (std::size_t n : {0U, 1U, 2U, 3U, 4U, 5U, 100U}) {
    std::vector<std::atomic<int>> hits(n);
    pool.parallel_for(n, [&](std::size_t i) { hits[i].fetch_add(1); });
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << n << " " << i;
  }
}

TEST(ThreadPool, ExceptionsReachTheCaller) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(10, [](std::size_t i) {
    if (i == 9) throw std::runtime_error("chunk 9");
  }),
               std::runtime_error);
  EXPECT_THROW(pool.parallel_for(10, [](std::size_t i) {
    if (i == 0) throw std::logic_error("chunk 0");
  }),
               std::logic_error);
  // The pool still works afterwards.
  std::atomic<int> count{0};
  pool.parallel_for(10, [&](std::size_t) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 10);
}

TEST(ThreadPool, SingleThreadPoolRunsOnCaller) {
  ThreadPool pool(1);
  EXPECT_EQ(pool.size(), 1U);
  const auto caller = std::this_thread::get_id();
  int sum = 0;
  pool.parallel_for(5, [&](std::size_t i) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    sum += static_cast<int>(i);
  });
  EXPECT_EQ(sum, 10);
}

TEST(ThreadPool, ManySmallJobsInARow) {
  ThreadPool pool(2);
  std::atomic<std::uint64_t> total{0};
  for (int round = 0; round < 20000; ++round) {
    pool.parallel_for(static_cast<std::size_t>(1 + round % 3), [&](std::size_t i) { total.fetch_add(i + 1); });
  }
  // rounds with n=1: +1, n=2: +3, n=3: +6
  std::uint64_t expected = 0;
  for (int round = 0; round < 20000; ++round) {
    const std::uint64_t n = 1 + round % 3;
    expected += n * (n + 1) / 2;
  }
  EXPECT_EQ(total.load(), expected);
}

TEST(ThreadPool, NestedCallRunsInline) {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.parallel_for(4, [&](std::size_t) { pool.parallel_for(3, [&](std::size_t) { count.fetch_add(1); }); });
  EXPECT_EQ(count.load(), 12);
}

TEST(ThreadPool, BindsWorkersToCpus) {
  ThreadPool pool(2, {0});
  EXPECT_EQ(pool.cpus().size(), 1U);
  std::atomic<int> count{0};
  pool.parallel_for(2, [&](std::size_t) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 2);
  EXPECT_ANY_THROW(ThreadPool(2, {-1}));
}

// A team: the caller always takes part, a worker only if it joins in time; the work is shared
// out by the calls themselves, so whoever runs finishes it, each call once per participant.
TEST(ThreadPool, TeamCallsTheCallerAndEachJoinedWorkerOnce) {
  for (std::size_t threads : {1U, 2U, 4U}) {
    ThreadPool pool(threads);
    for (int round = 0; round < 200; ++round) {
      std::atomic<std::size_t> next{0};
      std::atomic<std::size_t> done{0};
      std::vector<std::atomic<int>> calls(8);
      const std::size_t items = 1000;
      pool.parallel_team(3, [&](std::size_t me) {
        calls.at(me).fetch_add(1);
        while (next.fetch_add(1) < items) done.fetch_add(1);
      });
      EXPECT_EQ(done.load(), items);
      EXPECT_EQ(calls[0].load(), 1) << "the caller always takes part";
      for (std::size_t p = 1; p < calls.size(); ++p) {
        EXPECT_LE(calls[p].load(), p < std::min<std::size_t>(3, threads) ? 1 : 0) << p;
      }
    }
  }
}

// A worker that joined is waited for, however long it takes; one that did not may come late,
// and must then leave the next job (team or not) whole.
TEST(ThreadPool, TeamWaitsForWhoJoinedAndLateWorkersSkipIt) {
  ThreadPool pool(3);
  for (int round = 0; round < 300; ++round) {
    std::atomic<bool> finished{false};
    std::atomic<bool> worker_ran{false};
    pool.parallel_team(3, [&](std::size_t me) {
      if (me != 0) {
        worker_ran = true;
        if (round % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        finished = true;
      }
    });
    if (worker_ran) {
      EXPECT_TRUE(finished.load()) << round;
    }
    std::vector<std::atomic<int>> hits(7);
    pool.parallel_for(hits.size(), [&](std::size_t i) { hits[i].fetch_add(1); });
    for (const auto& h : hits) EXPECT_EQ(h.load(), 1) << round;
  }
}

TEST(ThreadPool, TeamExceptionsReachTheCallerAndNestedTeamsRunInline) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_team(2, [](std::size_t me) {
    if (me == 0) throw std::runtime_error("boom");
  }),
               std::runtime_error);
  std::atomic<int> inner{0};
  pool.parallel_team(2, [&](std::size_t) { pool.parallel_team(2, [&](std::size_t me) { inner += me == 0 ? 1 : 100; }); });
  // Each outer call (the caller's, and a worker's if it joined) ran the inner team inline: fn(0) once.
  EXPECT_TRUE(inner.load() == 1 || inner.load() == 2) << inner.load();
}

// ---- a ParallelExecutor: someone else's threads (torch's, in the torch bridge) ------------------

namespace {

// Runs each call on a thread of its own but call 0, which stays on the caller, as OpenMP does;
// counts what it was given.
struct TestExecutor {
  static inline std::atomic<std::size_t> width{2};
  static inline std::atomic<int> jobs{0};
  static inline std::atomic<std::size_t> most_calls{0};
  static void run(std::size_t n, void (*body)(void*, std::size_t), void* ctx) {
    jobs.fetch_add(1);
    if (n > most_calls.load()) most_calls = n;
    std::vector<std::thread> threads;
    for (std::size_t i = 1; i < n; ++i) threads.emplace_back([=] { body(ctx, i); });
    body(ctx, 0);
    for (std::thread& t : threads) t.join();
  }
  static std::size_t threads() { return width.load(); }
};
constexpr memtide::ParallelExecutor kTestExecutor{&TestExecutor::run, &TestExecutor::threads, "test"};

// Sets the test executor for one test and takes it away again, whatever the test does.
struct UseTestExecutor {
  explicit UseTestExecutor(std::size_t width) {
    TestExecutor::width = width;
    TestExecutor::jobs = 0;
    TestExecutor::most_calls = 0;
    previous = memtide::set_parallel_executor(&kTestExecutor);
  }
  ~UseTestExecutor() { memtide::set_parallel_executor(previous); }
  const memtide::ParallelExecutor* previous;
};

}  // namespace

TEST(ThreadPoolExecutor, RunsUnboundPoolsJobsEveryChunkOnce) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.executor(), nullptr);
  UseTestExecutor use(3);
  EXPECT_EQ(memtide::parallel_executor(), &kTestExecutor);
  EXPECT_EQ(pool.executor(), &kTestExecutor);
  for (std::size_t n : {2U, 3U, 4U, 5U, 100U}) {
    std::vector<std::atomic<int>> hits(n);
    std::vector<std::thread::id> who(n);
    pool.parallel_for(n, [&](std::size_t i) {
      hits[i].fetch_add(1);
      who[i] = std::this_thread::get_id();
    });
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << n << " " << i;
    // No more calls than the executor has threads, each a contiguous run of chunks, the first
    // on the caller.
    EXPECT_EQ(who[0], std::this_thread::get_id());
    std::size_t runs = 1;
    for (std::size_t i = 1; i < n; ++i) runs += who[i] != who[i - 1] ? 1 : 0;
    EXPECT_EQ(runs, std::min<std::size_t>(n, 3)) << n;
  }
  EXPECT_EQ(TestExecutor::jobs.load(), 5);
  EXPECT_EQ(TestExecutor::most_calls.load(), 3U) << "as many calls as the executor's threads, not the pool's";
}

TEST(ThreadPoolExecutor, TeamsCallEachParticipantTheExecutorHasOnce) {
  ThreadPool pool(4);
  for (std::size_t width : {1U, 2U, 8U}) {
    UseTestExecutor use(width);
    std::vector<std::atomic<int>> calls(4);
    std::atomic<std::size_t> next{0}, done{0};
    pool.parallel_team(4, [&](std::size_t me) {
      calls.at(me).fetch_add(1);
      while (next.fetch_add(1) < 1000) done.fetch_add(1);
    });
    EXPECT_EQ(done.load(), 1000U);
    for (std::size_t p = 0; p < calls.size(); ++p) EXPECT_EQ(calls[p].load(), p < width ? 1 : 0) << width << " " << p;
    EXPECT_EQ(TestExecutor::jobs.load(), width == 1 ? 0 : 1) << "a team of one runs on the caller";
  }
}

TEST(ThreadPoolExecutor, BoundPoolsAndOnePoolsKeepTheirOwnThreads) {
  UseTestExecutor use(2);
  ThreadPool bound(2, {0});
  EXPECT_EQ(bound.executor(), nullptr);
  std::atomic<int> count{0};
  bound.parallel_for(8, [&](std::size_t) { count.fetch_add(1); });
  ThreadPool single(1);
  single.parallel_for(8, [&](std::size_t) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 16);
  EXPECT_EQ(TestExecutor::jobs.load(), 0);
}

TEST(ThreadPoolExecutor, ExceptionsReachTheCallerAndNestedCallsRunInline) {
  ThreadPool pool(2);
  UseTestExecutor use(2);
  EXPECT_THROW(pool.parallel_for(6, [](std::size_t i) {
    if (i == 5) throw std::runtime_error("boom");
  }),
               std::runtime_error);
  std::atomic<int> count{0};
  pool.parallel_for(4, [&](std::size_t) { pool.parallel_for(3, [&](std::size_t) { count.fetch_add(1); }); });
  EXPECT_EQ(count.load(), 12);
  EXPECT_EQ(TestExecutor::jobs.load(), 2) << "the nested calls ran inline, not on the executor";
  // Back to its own workers once the executor is gone.
  memtide::set_parallel_executor(nullptr);
  EXPECT_EQ(pool.executor(), nullptr);
  pool.parallel_for(4, [&](std::size_t) { count.fetch_add(1); });
  EXPECT_EQ(TestExecutor::jobs.load(), 2);
  EXPECT_EQ(count.load(), 16);
}
