// FrozenState: the host state as it was at one moment, for a reader that is not memtide's
// (torch.distributed.checkpoint's writer), while steps go on.
#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/tiering/checkpoint/frozen_state.hpp"

namespace {

using memtide::tiering::FrozenState;
using Range = FrozenState::Range;

// Three arrays of `n` floats in `count` subgroups of equal size; a "step" adds 1 to every element
// of a subgroup after protecting it, as the engine does.
struct State {
  explicit State(std::size_t n, std::size_t count) : p(n), m(n), v(n) {
    std::iota(p.begin(), p.end(), 0.0F);
    std::iota(m.begin(), m.end(), 1000.0F);
    std::iota(v.begin(), v.end(), 2000.0F);
    for (std::size_t i = 0; i < count; ++i) subgroups.emplace_back(i * n / count, (i + 1) * n / count);
  }
  FrozenState::Config config(std::vector<Range> needed, std::uint64_t buffer_bytes = 0) const {
    FrozenState::Config c;
    c.arrays[0] = p.data();
    c.arrays[1] = m.data();
    c.arrays[2] = v.data();
    c.n = p.size();
    c.subgroups = subgroups;
    c.needed = std::move(needed);
    c.buffer_bytes = buffer_bytes;
    return c;
  }
  void step(FrozenState& f, std::size_t i) {
    f.protect(i, nullptr, nullptr, nullptr);
    for (std::size_t e = subgroups[i].first; e < subgroups[i].second; ++e) {
      p[e] += 1;
      m[e] += 1;
      v[e] += 1;
    }
  }
  float at(std::size_t k, std::size_t e) const { return (k == 0 ? p : k == 1 ? m : v)[e]; }
  std::vector<float> p, m, v;
  FrozenState::Ranges subgroups;
};

// What array k held at element e before any step.
float original(std::size_t k, std::size_t e) { return static_cast<float>(1000 * k + e); }

// Steps subgroup i on a thread of its own (a step that waits for the reader); join() waits for it.
struct StepAside {
  StepAside(State& s, FrozenState& f, std::size_t i)
      : thread([&s, &f, i, this] {
          s.step(f, i);
          stepped = true;
        }) {}
  void join() { thread.join(); }
  std::atomic<bool> stepped{false};
  std::thread thread;
};

std::vector<float> read(FrozenState& f, Range r) {
  std::vector<float> out(r.end - r.first);
  f.read(r, out.data());
  return out;
}

void expect_original(const std::vector<float>& got, Range r) {
  for (std::size_t e = r.first; e < r.end; ++e) {
    ASSERT_EQ(got[e - r.first], original(r.array, e)) << "array " << r.array << " element " << e;
  }
}

TEST(FrozenState, ReadsGiveTheStateAsFrozenWhateverStepsDoAndACopyIsLetGoOnceRead) {
  State s(4096, 4);
  // The reader wants p and v of everything, in two pieces each, not m.
  auto f = FrozenState::start(s.config({{0, 0, 3000}, {0, 3000, 4096}, {2, 0, 4096}}));
  s.step(*f, 1);  // copied: only p and v, 1024 floats each
  s.step(*f, 2);
  EXPECT_EQ(f->progress().copied_bytes, 2 * 2 * 1024 * sizeof(float));
  EXPECT_EQ(s.at(0, 1500), original(0, 1500) + 1) << "the step changed the arrays";
  expect_original(read(*f, {0, 0, 3000}), {0, 0, 3000});
  expect_original(read(*f, {2, 0, 4096}), {2, 0, 4096});
  // Subgroups 0-2 of v and 0-2 of p are read; subgroup 3 of p is not: its copy never existed and
  // a step on it must still keep it.
  s.step(*f, 3);
  expect_original(read(*f, {0, 3000, 4096}), {0, 3000, 4096});
  const auto progress = f->progress();
  EXPECT_EQ(progress.bytes_written, progress.bytes_total);
  EXPECT_EQ(progress.bytes_total, (4096 + 4096) * sizeof(float));
  EXPECT_FALSE(progress.done);
  f->close();
  EXPECT_TRUE(f->done());
  EXPECT_TRUE(f->progress().committed);
  EXPECT_NO_THROW(f->wait());
}

TEST(FrozenState, AFullBufferMakesTheStepWaitForTheReader) {
  State s(4096, 4);
  // Room for one subgroup's three arrays.
  auto f = FrozenState::start(s.config({{0, 0, 4096}, {1, 0, 4096}, {2, 0, 4096}}, 3 * 1024 * sizeof(float)));
  s.step(*f, 0);  // copied
  StepAside stepper(s, *f, 1);  // no room: waits until subgroup 1 is read
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(stepper.stepped.load()) << "the step went on before its subgroup was read";
  expect_original(read(*f, {0, 1024, 2048}), {0, 1024, 2048});
  expect_original(read(*f, {1, 1024, 2048}), {1, 1024, 2048});
  EXPECT_FALSE(stepper.stepped.load()) << "exp_avg_sq of the subgroup is not read yet";
  expect_original(read(*f, {2, 1024, 2048}), {2, 1024, 2048});
  stepper.join();
  EXPECT_TRUE(stepper.stepped.load());
  EXPECT_GT(f->progress().waited_s, 0.05);
  EXPECT_LE(f->progress().peak_buffer_bytes, 3 * 1024 * sizeof(float));
  f->close();
}

TEST(FrozenState, ARangeGivenTwiceIsKeptUntilReadTwiceAndNeverReadAfterItChanged) {
  State s(2048, 2);
  auto f = FrozenState::start(s.config({{0, 0, 1024}, {0, 0, 1024}}, 1));  // no room for copies
  expect_original(read(*f, {0, 0, 1024}), {0, 0, 1024});
  StepAside stepper(s, *f, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(stepper.stepped.load()) << "read once of twice: still needed as it was";
  expect_original(read(*f, {0, 0, 1024}), {0, 0, 1024});
  stepper.join();
  // A third read would see the step's values: refused.
  EXPECT_THROW(read(*f, {0, 0, 1024}), memtide::Error);
  // Subgroup 1 was never needed: its step does not wait, and it cannot be read.
  s.step(*f, 1);
  EXPECT_THROW(read(*f, {0, 1024, 2048}), memtide::InvalidArgument);
  EXPECT_THROW(read(*f, {1, 0, 1}), memtide::InvalidArgument);
  f->close();
}

TEST(FrozenState, AReaderThatStallsIsGivenUpOnAndTheStepsGoOn) {
  State s(2048, 2);
  FrozenState::Config c = s.config({{0, 0, 2048}}, 1);
  c.stall = std::chrono::milliseconds(200);
  auto f = FrozenState::start(std::move(c));
  const auto t0 = std::chrono::steady_clock::now();
  s.step(*f, 0);  // nothing reads: given up on after the stall limit
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(190));
  EXPECT_TRUE(f->done());
  EXPECT_FALSE(f->progress().committed);
  EXPECT_NE(f->progress().error.find("read nothing"), std::string::npos) << f->progress().error;
  EXPECT_THROW(read(*f, {0, 1024, 2048}), memtide::Error) << "a later read would mix two states";
  EXPECT_THROW(f->wait(), memtide::IoError);
  s.step(*f, 1);  // at once
}

TEST(FrozenState, CloseLetsEveryCopyGoAndLaterReadsThrow) {
  State s(4096, 4);
  auto buffers = std::make_shared<memtide::tiering::CopyBuffers>();
  FrozenState::Config c = s.config({{1, 0, 4096}});
  c.buffers = buffers;
  auto f = FrozenState::start(std::move(c));
  s.step(*f, 0);
  s.step(*f, 3);
  EXPECT_EQ(f->progress().copied_bytes, 2 * 1024 * sizeof(float));
  f->close("the writer failed");
  EXPECT_TRUE(f->done());
  EXPECT_EQ(f->progress().error, "the writer failed");
  EXPECT_THROW(f->wait(), memtide::IoError);
  EXPECT_THROW(read(*f, {1, 0, 1024}), memtide::Error);
  EXPECT_GT(buffers->kept_bytes(), 0U) << "its memory kept for the next save";
  s.step(*f, 1);  // nothing kept: at once
}

TEST(FrozenState, ReadsAndStepsInManyThreadsAlwaysSeeTheFrozenState) {
  // A reader per array reads in pieces while two steppers step every subgroup several times;
  // every read must see the original values (run under TSan by scripts/test.sh).
  State s(64 * 1024, 16);
  auto f = FrozenState::start(s.config({{0, 0, 65536}, {1, 0, 65536}, {2, 0, 65536}}, 4 * 3 * 4096 * sizeof(float)));
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (std::size_t k = 0; k < 3; ++k) {
    threads.emplace_back([&, k] {
      for (std::size_t first = 0; first < 65536; first += 1000) {
        const Range r{k, first, std::min<std::size_t>(first + 1000, 65536)};
        const std::vector<float> got = read(*f, r);
        for (std::size_t e = r.first; e < r.end; ++e) bad += got[e - r.first] != original(k, e) ? 1 : 0;
      }
    });
  }
  for (std::size_t t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      // Each stepper owns half the subgroups (a subgroup is stepped by one thread, as in the engine).
      for (int round = 0; round < 3; ++round) {
        for (std::size_t i = t; i < 16; i += 2) s.step(*f, i);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(f->progress().bytes_written, f->progress().bytes_total);
  EXPECT_LE(f->progress().peak_buffer_bytes, 4 * 3 * 4096 * sizeof(float));
  f->close();
}

TEST(FrozenState, SubgroupsOutsideWhatTheReaderWillReadAreLetGo) {
  State s(4096, 4);
  auto f = FrozenState::start(s.config({{1, 0, 4096}, {2, 0, 4096}}, 1));  // no room: a step would wait
  f->keep_only({{1, 1024, 2048}, {2, 1500, 1600}});  // another rank writes the rest
  StepAside stepper(s, *f, 1);  // still kept: waits for its reads
  s.step(*f, 0);  // let go: at once
  s.step(*f, 2);
  s.step(*f, 3);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(stepper.stepped.load());
  expect_original(read(*f, {1, 1024, 2048}), {1, 1024, 2048});
  expect_original(read(*f, {2, 1024, 2048}), {2, 1024, 2048});
  stepper.join();
  // A subgroup let go and changed since is never read.
  EXPECT_THROW(read(*f, {1, 2048, 3072}), memtide::Error);
  EXPECT_EQ(f->progress().bytes_written, f->progress().bytes_total);
  EXPECT_THROW(f->keep_only({{0, 0, 4097}}), memtide::InvalidArgument);
  f->close();
}

TEST(FrozenState, OnlyTheArraysStillToBeReadAreCopiedOrWaitedFor) {
  State s(2048, 2);
  auto f = FrozenState::start(s.config({{0, 0, 2048}, {1, 0, 2048}, {2, 0, 2048}}));
  expect_original(read(*f, {0, 0, 1024}), {0, 0, 1024});  // p of subgroup 0 is read
  s.step(*f, 0);
  EXPECT_EQ(f->progress().copied_bytes, 2 * 1024 * sizeof(float)) << "m and v only";
  expect_original(read(*f, {1, 0, 1024}), {1, 0, 1024});
  EXPECT_THROW(read(*f, {0, 0, 1024}), memtide::Error) << "p again: the step changed it";
  f->close();
  // Subgroup 1 frozen for p and v, with no room for copies; DCP's plan for this rank holds only
  // its v (another rank writes p): a step waits for v alone.
  auto g = FrozenState::start(s.config({{0, 1024, 2048}, {2, 1024, 2048}}, 1));
  g->keep_only({{2, 1024, 2048}});
  StepAside stepper(s, *g, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(stepper.stepped.load()) << "v is still to be read";
  read(*g, {2, 1024, 2048});
  stepper.join();
  EXPECT_EQ(g->progress().bytes_total, 1024 * sizeof(float));
  g->close();
}

TEST(FrozenState, BadConfigsAreRefused) {
  State s(1024, 2);
  EXPECT_THROW(FrozenState::start(s.config({{3, 0, 10}})), memtide::InvalidArgument);
  EXPECT_THROW(FrozenState::start(s.config({{0, 10, 10}})), memtide::InvalidArgument);
  EXPECT_THROW(FrozenState::start(s.config({{0, 0, 1025}})), memtide::InvalidArgument);
  FrozenState::Config c = s.config({});
  c.subgroups = {{0, 500}, {600, 1024}};
  EXPECT_THROW(FrozenState::start(c), memtide::InvalidArgument);
  c = s.config({});
  c.arrays[1] = nullptr;
  EXPECT_THROW(FrozenState::start(c), memtide::InvalidArgument);
  c = s.config({});
  c.stall = std::chrono::duration<double>(0);
  EXPECT_THROW(FrozenState::start(c), memtide::InvalidArgument);
  c.stall = std::chrono::duration<double>(std::numeric_limits<double>::infinity());
  EXPECT_THROW(FrozenState::start(c), memtide::InvalidArgument);
}

}  // namespace
