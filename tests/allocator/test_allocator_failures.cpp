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

#include <cerrno>
#include <cstring>
#include <new>

#include "failing_device.hpp"
#include "failing_new.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/core/detail/os_testing.hpp"
#include "memtide/core/os.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/allocator/mmap_slab_source.hpp"

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

// ---- HostArena: a failure at every step of making a slab, and in the bookkeeping ----------------

namespace {

// What a caller of HostArena can rely on: its counters (not the time spent, which a failed
// attempt spends too) and its slabs.
std::string fingerprint(const HostArena& a) {
  const HostArenaStats st = a.stats();
  std::ostringstream out;
  out << "reserved " << st.reserved_bytes << " allocated " << st.allocated_bytes << " peak " << st.peak_allocated_bytes
      << " n " << st.allocations << " slabs " << st.slabs << " whole " << st.whole_slabs << " registered "
      << st.registered_slabs << " fallback " << st.fallback_slabs << " released " << st.slabs_released << " nodes";
  for (const auto& [node, bytes] : st.bytes_per_node) out << ' ' << node << '=' << bytes;
  out << " |";
  for (const HostSlab& slab : a.slabs()) out << ' ' << slab.ptr << ':' << slab.bytes << ':' << slab.numa_node;
  return out.str();
}

HostArenaConfig failing_config(test::FailingDevice& dev) {
  HostArenaConfig config;
  config.device = &dev;
  config.slab_bytes = 4 * MiB;
  config.huge_pages = true;
  // Bound to a node where the machine has NUMA, so that mbind is one of the steps.
  if (HostArena::numa_supported()) config.numa_node = HostArena::valid_numa_nodes().front();
  return config;
}

struct OsInjection : ::testing::Test {
  void SetUp() override { os::testing::reset(); }
  void TearDown() override { os::testing::reset(); }
};

}  // namespace

using HostArenaOsFailures = OsInjection;

TEST_F(HostArenaOsFailures, AFailedMapOrBindLeavesTheArenaAsItWasAndMapsNothing) {
  test::FailingDevice dev;
  HostArena arena(failing_config(dev));
  void* kept = arena.allocate(MiB);
  std::vector<os::testing::Call> steps{os::testing::Call::map};
  if (arena.config().numa_node >= 0) steps.push_back(os::testing::Call::bind);
  for (auto call : steps) {
    for (bool whole : {false, true}) {
      const std::string before = fingerprint(arena);
      os::testing::reset();
      os::testing::fail_nth(call, 0, ENOMEM);
      try {
        if (whole) (void)arena.map_slab(16 * MiB, 4096);
        else (void)arena.allocate(16 * MiB);
        FAIL() << "an injected failure of call " << static_cast<int>(call) << " was not reported";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::strerror(ENOMEM)), std::string::npos) << e.what();
      }
      EXPECT_EQ(fingerprint(arena), before) << "call " << static_cast<int>(call);
      // What was mapped before the failure was unmapped again.
      const std::size_t mapped = os::testing::count(os::testing::Call::map) - (call == os::testing::Call::map);
      EXPECT_EQ(os::testing::count(os::testing::Call::unmap), mapped) << "call " << static_cast<int>(call);
    }
  }
  void* again = arena.allocate(16 * MiB);  // and then it works
  arena.deallocate(again);
  arena.deallocate(kept);
  EXPECT_EQ(arena.stats().allocated_bytes, 0U);
}

TEST_F(HostArenaOsFailures, RefusedHugePageAdviceIsOnlyAdvice) {
  test::FailingDevice dev;
  HostArena arena(failing_config(dev));
  os::testing::fail_nth(os::testing::Call::advise, 0, EINVAL);
  void* p = arena.allocate(8 * MiB);  // slab >= 2 MiB: advised
  EXPECT_EQ(os::testing::count(os::testing::Call::advise), 1U);
  static_cast<char*>(p)[8 * MiB - 1] = 1;
  arena.deallocate(p);
}

TEST_F(HostArenaOsFailures, AFailedPlacementQueryIsReportedNotThrown) {
  test::FailingDevice dev;
  HostArena arena(failing_config(dev));
  void* p = arena.allocate(MiB);
  os::testing::fail_nth(os::testing::Call::page_nodes, 0, EPERM);
  const PlacementReport r = arena.verify_placement(p, MiB);
  if (HostArena::numa_supported()) {
    EXPECT_FALSE(r.known);
    EXPECT_NE(r.reason.find("move_pages failed"), std::string::npos) << r.reason;
  }
  arena.deallocate(p);
}

// Every allocation an operation makes fails in turn: each failure leaves the arena as it was,
// and the run stops at the first count at which the operation goes through.
template <class Setup, class Op, class Undo>
void each_allocation_fails(HostArena& arena, const char* what, Setup setup, Op op, Undo undo) {
  for (std::size_t n = 0;; ++n) {
    ASSERT_LT(n, 1000U) << what << ": the operation never ran through";
    auto state = setup();
    const std::string before = fingerprint(arena);
    test::fail_nth_new(n);
    bool threw = false;
    try {
      op(state);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    const bool fired = test::new_failed();
    test::stop_failing_new();
    if (threw) {
      EXPECT_EQ(fingerprint(arena), before) << what << ": allocation " << n << " failed";
      undo(state, false);
      continue;
    }
    undo(state, true);
    if (!fired) break;  // ran through without reaching allocation n
  }
}

TEST(HostArenaFailures, EveryFailedAllocationInTheBookkeepingLeavesTheArenaAsItWas) {
  test::FailingDevice dev;
  HostArena arena(failing_config(dev));
  void* kept = arena.allocate(MiB);
  struct Live {
    void* p = nullptr;
  };
  auto none = [] { return Live{}; };
  // A new slab (maps, registers, inserts the slab, its block and its free rest).
  each_allocation_fails(arena, "allocate with a new slab", none, [&](Live& l) { l.p = arena.allocate(16 * MiB); },
                        [&](Live& l, bool ok) {
                          if (ok) arena.deallocate(l.p);
                          (void)arena.release_free_slabs();
                        });
  // A split of a free block.
  each_allocation_fails(arena, "allocate from a slab", none, [&](Live& l) { l.p = arena.allocate(4096); },
                        [&](Live& l, bool ok) {
                          if (ok) arena.deallocate(l.p);
                        });
  // A free that coalesces, and one that cannot.
  auto live = [&] { return Live{arena.allocate(8192)}; };
  each_allocation_fails(arena, "deallocate", live, [&](Live& l) { arena.deallocate(l.p); },
                        [&](Live& l, bool ok) {
                          if (!ok) arena.deallocate(l.p);  // still live after the failed free
                        });
  // Whole slabs.
  each_allocation_fails(arena, "map_slab", [] { return HostSlab{}; }, [&](HostSlab& s) { s = arena.map_slab(8 * MiB, 4096); },
                        [&](HostSlab& s, bool ok) {
                          if (ok) arena.unmap_slab(s);
                        });
  auto spare = [&] { return arena.allocate(2 * MiB); };
  void* a = spare();
  void* b = spare();
  arena.deallocate(a);
  each_allocation_fails(arena, "release_free_slabs", none, [&](Live&) { (void)arena.release_free_slabs(); },
                        [](Live&, bool) {});
  arena.deallocate(b);
  arena.deallocate(kept);
  EXPECT_EQ(arena.stats().allocated_bytes, 0U);
}

// ---- MmapSlabSource -------------------------------------------------------------------------------

using MmapSlabSourceFailures = OsInjection;

TEST_F(MmapSlabSourceFailures, AFailedMapRegistrationOrBookkeepingMapsNothing) {
  test::FailingDevice dev;
  MmapSlabSource source(&dev);
  const HostSlab kept = source.map_slab(MiB, 4096);
  os::testing::fail_nth(os::testing::Call::map, 0, ENOMEM);
  EXPECT_THROW((void)source.map_slab(MiB, 4096), OutOfMemory);
  EXPECT_EQ(source.slab_count(), 1U);
  dev.fail_at(1);  // the registration
  EXPECT_THROW((void)source.map_slab(MiB, 4096), Error);
  EXPECT_EQ(source.slab_count(), 1U);
  EXPECT_EQ(os::testing::count(os::testing::Call::unmap), 1U);  // the registered-then-failed slab
  for (std::size_t n = 0;; ++n) {
    ASSERT_LT(n, 100U);
    test::fail_nth_new(n);
    try {
      const HostSlab s = source.map_slab(MiB, 4096);
      const bool fired = test::new_failed();
      test::stop_failing_new();
      source.unmap_slab(s);
      if (!fired) break;
    } catch (const std::bad_alloc&) {
      test::stop_failing_new();
      EXPECT_EQ(source.slab_count(), 1U) << "allocation " << n;
      EXPECT_EQ(source.mapped_bytes(), kept.bytes) << "allocation " << n;
    }
  }
  source.unmap_slab(kept);
  EXPECT_EQ(source.slab_count(), 0U);
}
