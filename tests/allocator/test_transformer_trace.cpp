#include <gtest/gtest.h>

#include "memtide/allocator/transformer_trace.hpp"
#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"

using namespace memtide;

namespace {
TransformerShape tiny() {
  TransformerShape s;
  s.layers = 4;
  s.hidden = 256;
  s.heads = 4;
  s.seq = 128;
  s.batch = 2;
  s.vocab = 1000;
  s.iterations = 3;
  return s;
}
}  // namespace

TEST(TransformerTrace, EveryAllocationIsFreedExactlyOnce) {
  const auto trace = make_transformer_trace(tiny());
  std::vector<int> state(trace.size(), 0);
  for (const TraceOp& op : trace) {
    if (op.kind == TraceOp::Kind::alloc) {
      ASSERT_EQ(state[op.id], 0);
      state[op.id] = 1;
    } else if (op.kind == TraceOp::Kind::free) {
      ASSERT_EQ(state[op.id], 1) << "free of id " << op.id;
      state[op.id] = 2;
    }
  }
  for (int s : state) EXPECT_NE(s, 1);
}

TEST(TransformerTrace, RejectsNonPositiveShapes) {
  TransformerShape s = tiny();
  s.layers = 0;
  try {
    make_transformer_trace(s);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layers"), std::string::npos);
  }
}

TEST(TransformerTrace, ReplayShowsTheTide) {
  SimConfig c;
  c.phantom = true;
  SimDevice d(c);
  AllocatorConfig ac;
  ac.headroom_margin = 0;
  CachingAllocator a(d, ac);
  const ReplayResult r = replay(a, make_transformer_trace(tiny()));
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
  ASSERT_EQ(r.phases.iterations, 3u);
  const IterationRecord& last = r.phases.history.back();
  const auto& fwd = last.phases[static_cast<int>(Phase::forward)];
  const auto& bwd = last.phases[static_cast<int>(Phase::backward)];
  const auto& upd = last.phases[static_cast<int>(Phase::update)];
  // Activations make forward/backward the high tide; the update phase is the low tide.
  EXPECT_GT(fwd.peak_allocated, upd.peak_allocated);
  EXPECT_GT(bwd.peak_allocated, upd.peak_allocated);
  EXPECT_GE(r.peak_reserved, r.peak_allocated);
  EXPECT_TRUE(r.update_headroom.from_history);
  EXPECT_EQ(r.update_headroom.bytes, a.limit() - upd.peak_allocated);
}
