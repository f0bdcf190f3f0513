#include <gtest/gtest.h>

#include "memtide/allocator/phase_tracker.hpp"

using namespace memtide;

namespace {
constexpr std::uint64_t GiB = 1ULL << 30;

/// One iteration: forward rises to `fwd`, backward peaks at `bwd`, update at `upd` (allocated).
void iterate(PhaseTracker& t, std::uint64_t base, std::uint64_t fwd, std::uint64_t bwd, std::uint64_t upd) {
  t.mark(Phase::forward, base, base, 0);
  t.observe(fwd, fwd);
  t.mark(Phase::backward, fwd, fwd, 0);
  t.observe(bwd, bwd);
  t.observe(base, bwd);
  t.mark(Phase::update, base, bwd, 0);
  t.observe(upd, bwd);
  t.observe(base, bwd);
}
}  // namespace

TEST(PhaseTracker, NamesRoundTrip) {
  for (Phase p : {Phase::forward, Phase::backward, Phase::update, Phase::other}) {
    EXPECT_EQ(parse_phase(phase_name(p)), p);
  }
  EXPECT_FALSE(parse_phase("sideways"));
}

TEST(PhaseTracker, RecordsPeaksPerPhase) {
  PhaseTracker t(4);
  t.set_limit(80 * GiB);
  iterate(t, 10 * GiB, 60 * GiB, 70 * GiB, 20 * GiB);
  t.mark(Phase::forward, 10 * GiB, 70 * GiB, 0);
  ASSERT_EQ(t.iterations(), 1u);
  const IterationRecord& it = t.history().back();
  EXPECT_EQ(it.phases[0].peak_allocated, 60 * GiB);
  EXPECT_EQ(it.phases[1].peak_allocated, 70 * GiB);
  EXPECT_EQ(it.phases[2].peak_allocated, 20 * GiB);
  EXPECT_EQ(it.phases[2].min_free, 60 * GiB);
  EXPECT_EQ(it.phases[1].min_free, 10 * GiB);
  EXPECT_EQ(it.phases[1].peak_reserved, 70 * GiB);
}

TEST(PhaseTracker, OnlyForwardAfterBackwardOrUpdateClosesAnIteration) {
  PhaseTracker t(4);
  t.mark(Phase::forward, 0, 0, 0);
  t.mark(Phase::other, 0, 0, 0);
  t.mark(Phase::forward, 0, 0, 0);  // e.g. an eval forward: same iteration
  EXPECT_EQ(t.iterations(), 0u);
  t.mark(Phase::backward, 0, 0, 0);
  t.mark(Phase::forward, 0, 0, 0);
  EXPECT_EQ(t.iterations(), 1u);
}

TEST(PhaseTracker, GradientAccumulationMicroBatchesStayInOneIteration) {
  PhaseTracker t(4);
  t.set_limit(80 * GiB);
  auto micro_batch = [&](std::uint64_t fwd_peak) {
    t.mark(Phase::forward, GiB, GiB, 0);
    t.observe(fwd_peak, fwd_peak);
    t.mark(Phase::backward, fwd_peak, fwd_peak, 0);
    t.observe(GiB, fwd_peak);
  };
  // Before any update, forward after backward is a new iteration (nothing says otherwise yet).
  micro_batch(5 * GiB);
  micro_batch(5 * GiB);
  t.mark(Phase::update, GiB, 5 * GiB, 0);
  EXPECT_EQ(t.iterations(), 1u);
  // From then on, four micro-batches and one update are one iteration.
  micro_batch(6 * GiB);
  micro_batch(9 * GiB);
  micro_batch(7 * GiB);
  micro_batch(6 * GiB);
  EXPECT_EQ(t.iterations(), 2u);
  t.mark(Phase::update, GiB, 9 * GiB, 0);
  t.observe(3 * GiB, 9 * GiB);
  t.mark(Phase::forward, GiB, 9 * GiB, 0);
  ASSERT_EQ(t.iterations(), 3u);
  const IterationRecord& it = t.history().back();
  EXPECT_EQ(it.phases[0].peak_allocated, 9 * GiB);  // the largest micro-batch's forward
  EXPECT_EQ(it.phases[0].min_free, 71 * GiB);
  EXPECT_EQ(it.phases[2].peak_allocated, 3 * GiB);
}

TEST(PhaseTracker, HistoryIsBounded) {
  PhaseTracker t(2);
  t.set_limit(80 * GiB);
  for (int i = 0; i < 5; ++i) iterate(t, GiB, 2 * GiB, 3 * GiB, 2 * GiB);
  t.mark(Phase::forward, GiB, GiB, 0);
  EXPECT_EQ(t.iterations(), 5u);
  EXPECT_EQ(t.history().size(), 2u);
  EXPECT_EQ(t.history().back().index, 4u);
}

TEST(PhaseTracker, HeadroomInUpdateUntilForwardIsTheUpdateLowWater) {
  PhaseTracker t(4);
  t.set_limit(80 * GiB);
  iterate(t, 10 * GiB, 60 * GiB, 70 * GiB, 20 * GiB);
  iterate(t, 10 * GiB, 60 * GiB, 70 * GiB, 20 * GiB);  // now inside the second update
  t.observe(10 * GiB, 70 * GiB);
  const Headroom h = t.headroom(Phase::forward, 10 * GiB, GiB);
  EXPECT_TRUE(h.from_history);
  EXPECT_EQ(h.iterations_used, 1u);
  EXPECT_EQ(h.limiting_phase, Phase::update);
  EXPECT_EQ(h.bytes, 60 * GiB - GiB);  // limit - update peak (20) - margin
}

TEST(PhaseTracker, HeadroomAcrossPhasesTakesTheLowestWater) {
  PhaseTracker t(4);
  t.set_limit(80 * GiB);
  iterate(t, 10 * GiB, 60 * GiB, 70 * GiB, 20 * GiB);
  t.mark(Phase::forward, 10 * GiB, 70 * GiB, 0);
  // From the start of forward, a loan kept until update lives through forward and backward.
  const Headroom h = t.headroom(Phase::update, 10 * GiB, 0);
  EXPECT_EQ(h.limiting_phase, Phase::backward);
  EXPECT_EQ(h.bytes, 10 * GiB);
  // Kept only until backward: forward's low water (80 - 60).
  EXPECT_EQ(t.headroom(Phase::backward, 10 * GiB, 0).bytes, 20 * GiB);
}

TEST(PhaseTracker, WithoutHistoryOnlyThePresentCounts) {
  PhaseTracker t(4);
  t.set_limit(80 * GiB);
  t.mark(Phase::update, 30 * GiB, 30 * GiB, 0);
  const Headroom h = t.headroom(Phase::forward, 30 * GiB, 2 * GiB);
  EXPECT_FALSE(h.from_history);
  EXPECT_EQ(h.bytes, 48 * GiB);
}

TEST(PhaseTracker, MarginLargerThanFreeGivesZero) {
  PhaseTracker t(4);
  t.set_limit(10 * GiB);
  t.mark(Phase::update, 9 * GiB, 9 * GiB, 0);
  EXPECT_EQ(t.headroom(Phase::forward, 9 * GiB, 2 * GiB).bytes, 0u);
}

TEST(PhaseTracker, DurationsCountFromTheFirstMark) {
  PhaseTracker t(4);
  t.mark(Phase::forward, 0, 0, 1e12);  // a clock far from zero, like steady_clock
  t.mark(Phase::backward, 0, 0, 1e12 + 5e6);
  t.mark(Phase::update, 0, 0, 1e12 + 15e6);
  t.mark(Phase::forward, 0, 0, 1e12 + 16e6);
  const IterationRecord& it = t.history().back();
  EXPECT_DOUBLE_EQ(it.phases[static_cast<int>(Phase::forward)].duration_ns, 5e6);
  EXPECT_DOUBLE_EQ(it.phases[static_cast<int>(Phase::backward)].duration_ns, 10e6);
  EXPECT_DOUBLE_EQ(it.phases[static_cast<int>(Phase::update)].duration_ns, 1e6);
  EXPECT_DOUBLE_EQ(it.phases[static_cast<int>(Phase::other)].duration_ns, 0.0);
}
