// The strong exception guarantee of the caching allocator: a failure injected at every device
// call of a workload (allocations, cross-stream reuse, record_stream, frees with pending events,
// empty_cache) leaves the allocator as it was before the failed operation, and the same
// operation then succeeds. "As it was": the same live allocations (address, size, requested
// size, stream), the same reserved segments and counters, and a consistent snapshot. Finishing
// frees whose events have completed is housekeeping a failed call may have done on its way.

#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "failing_device.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"

using namespace memtide;

namespace {

constexpr std::size_t MiB = 1 << 20;

// What a caller can rely on: every segment, the live blocks in it, and the current counters.
std::string fingerprint(CachingAllocator& a) {
  std::ostringstream out;
  Snapshot s = a.snapshot();
  for (const SegmentSnapshot& seg : s.segments) {
    out << seg.address << ':' << seg.total_size << ':' << seg.stream << ':' << seg.small << '[';
    for (const BlockSnapshot& b : seg.blocks) {
      if (b.state == BlockState::active_allocated) out << b.address << ',' << b.size << ',' << b.requested_size << ';';
    }
    out << ']';
  }
  const AllocatorStats st = a.stats();
  out << " alloc " << st.allocated_bytes[0].current << " reserved " << st.reserved_bytes[0].current << " requested "
      << st.requested_bytes[0].current << " n " << st.allocation[0].current;
  return out.str();
}

// The workload, one operation at a time, over the state it builds up.
struct Workload {
  test::FailingDevice& dev;
  CachingAllocator& a;
  Stream s1{}, s2{};
  std::vector<void*> live;

  std::vector<std::function<void()>> steps() {
    return {
        [&] { live.push_back(a.allocate(4096, Stream{})); },          // small pool, new segment
        [&] { live.push_back(a.allocate(3 * MiB, Stream{})); },       // large pool
        [&] { live.push_back(a.allocate(5000, Stream{})); },          // split of the small segment
        [&] { a.record_stream(live[0], s1); },                         // used on a side stream
        [&] { a.record_stream(live[1], s2); },
        [&] { a.deallocate(live[0], Stream{}); },                      // pending: event on s1
        [&] { a.deallocate(live[1], 3 * MiB, Stream{}); },             // pending: event on s2 (checked free)
        [&] { live.push_back(a.allocate(2 * MiB, s1)); },              // another stream
        [&] { a.deallocate(live[2], Stream{}); },                      // coalesces with the pending one later
        [&] { live.push_back(a.allocate(4096, Stream{})); },           // reuse once events completed
        [&] { a.empty_cache(); },
        [&] { a.deallocate(live[3], s1); },
        [&] { a.deallocate(live[4], Stream{}); },
        [&] { a.empty_cache(); },
    };
  }
};

}  // namespace

TEST(CachingAllocatorFailures, EveryInjectedFailureLeavesTheAllocatorAsItWas) {
  // Count the failable device calls of a clean run first.
  int total = 0;
  {
    test::FailingDevice dev;
    CachingAllocator a(dev);
    Workload w{dev, a, dev.create_stream(), dev.create_stream(), {}};
    dev.fail_at(0);
    const int before = dev.calls();
    for (auto& step : w.steps()) step();
    total = dev.calls() - before;
  }
  ASSERT_GT(total, 5);
  int failures = 0;
  for (int n = 1; n <= total; ++n) {
    test::FailingDevice dev;
    CachingAllocator a(dev);
    Workload w{dev, a, dev.create_stream(), dev.create_stream(), {}};
    dev.fail_at(n);
    int index = 0;
    for (auto& step : w.steps()) {
      const std::string before = fingerprint(a);
      const std::size_t live_before = w.live.size();
      try {
        step();
      } catch (const Error& e) {
        ++failures;
        ASSERT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
        EXPECT_EQ(fingerprint(a), before) << "failure " << n << " in step " << index << " changed the allocator";
        EXPECT_EQ(validate_snapshot(a.snapshot()), "") << "failure " << n << " in step " << index;
        w.live.resize(live_before);
        dev.fail_at(0);
        step();  // the same operation now succeeds
      }
      ++index;
    }
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0) << "failure " << n;
    EXPECT_EQ(validate_snapshot(a.snapshot()), "") << "failure " << n;
  }
  EXPECT_EQ(failures, total);  // every failable call was hit once
}

TEST(CachingAllocatorFailures, AFreeThatNamesAnotherSizeOrStreamIsRefused) {
  test::FailingDevice dev;
  CachingAllocator a(dev);
  const Stream s = dev.create_stream();
  void* p = a.allocate(4096, Stream{});
  const std::string before = fingerprint(a);
  EXPECT_THROW(a.deallocate(p, 8192, Stream{}), InvalidArgument);
  EXPECT_THROW(a.deallocate(p, 4096, s), InvalidArgument);
  EXPECT_EQ(fingerprint(a), before);
  EXPECT_EQ(a.stats().num_invalid_frees, 2);
  a.deallocate(p, 4096, Stream{});
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
}

// HostArena: a slab whose registration fails is unmapped again, and the arena is as it was.
TEST(HostArenaFailures, AFailedRegistrationLeavesTheArenaAsItWas) {
  test::FailingDevice dev;
  HostArenaConfig config;
  config.device = &dev;
  config.slab_bytes = 4 * MiB;
  HostArena arena(config);
  void* kept = arena.allocate(MiB);  // one slab in use
  const HostArenaStats before = arena.stats();
  dev.fail_at(1);  // the next registration
  EXPECT_THROW((void)arena.allocate(16 * MiB), Error);  // needs a new slab
  const HostArenaStats after = arena.stats();
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.slabs, before.slabs);
  EXPECT_EQ(after.registered_slabs, before.registered_slabs);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.allocations, before.allocations);
  void* again = arena.allocate(16 * MiB);  // and then it works
  EXPECT_EQ(arena.stats().registered_slabs, before.registered_slabs + 1);
  arena.deallocate(again);
  arena.deallocate(kept);
  EXPECT_EQ(arena.stats().allocated_bytes, 0U);
}
