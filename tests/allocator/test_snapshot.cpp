// Snapshot validity and the pickle encoding. The Python suite loads real pickles with Python's
// own unpickler and torch's memory_viz; here the checker itself is shown to catch bad snapshots.

#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/snapshot.hpp"
#include "memtide/device/sim_device.hpp"

using namespace memtide;

namespace {
Snapshot sample() {
  SimDevice d;
  AllocatorConfig c;
  c.record_history = true;
  CachingAllocator a(d, c);
  void* x = a.allocate(1000, Stream{});
  void* y = a.allocate(5 << 20, Stream{});
  a.deallocate(x, Stream{});
  Snapshot s = a.snapshot();
  a.deallocate(y, Stream{});
  return s;
}
}  // namespace

TEST(Snapshot, TiledSegmentsAndConsistentTraceValidate) {
  const Snapshot s = sample();
  ASSERT_EQ(s.segments.size(), 2u);
  ASSERT_EQ(s.device_traces.size(), 1u);
  EXPECT_EQ(s.device_traces[0].size(), 6u);  // 2 segment_alloc, 2 alloc, free_requested, free_completed
  EXPECT_EQ(validate_snapshot(s), "");
}

TEST(Snapshot, ValidatorCatchesAGapBetweenBlocks) {
  Snapshot s = sample();
  auto split = std::find_if(s.segments.begin(), s.segments.end(), [](const SegmentSnapshot& g) { return g.blocks.size() > 1; });
  ASSERT_NE(split, s.segments.end());
  split->blocks[0].size -= 512;
  EXPECT_NE(validate_snapshot(s).find("does not start where the previous one ended"), std::string::npos);
}

TEST(Snapshot, ValidatorCatchesBlocksNotCoveringTheSegment) {
  Snapshot s = sample();
  s.segments[0].total_size += 512;
  EXPECT_NE(validate_snapshot(s).find("blocks cover"), std::string::npos);
}

TEST(Snapshot, ValidatorCatchesATraceThatDoesNotReplay) {
  Snapshot s = sample();
  // Drop the free_completed: replaying backwards, x's alloc then finds x not live.
  auto& t = s.device_traces[0];
  t.erase(std::remove_if(t.begin(), t.end(), [](const TraceEntry& e) { return e.action == TraceAction::free_completed; }),
          t.end());
  EXPECT_NE(validate_snapshot(s).find("trace replay"), std::string::npos);
}

TEST(Snapshot, PickleHasProtocolHeaderAndStop) {
  std::ostringstream out;
  write_memory_viz_pickle(sample(), out);
  const std::string bytes = out.str();
  ASSERT_GT(bytes.size(), 100u);
  EXPECT_EQ(static_cast<unsigned char>(bytes[0]), 0x80);
  EXPECT_EQ(bytes[1], 4);
  EXPECT_EQ(bytes.back(), '.');
  for (const char* key : {"segments", "device_traces", "active_allocated", "segment_alloc", "total_size"}) {
    EXPECT_NE(bytes.find(key), std::string::npos) << key;
  }
}
