// CachingAllocator behaviour, written once and run against every device backend. A byte cap
// stands in for device capacity so the same limits and OOMs happen on a real GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "device_types.hpp"
#include "failing_device.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/core/error.hpp"

using namespace memtide;
using memtide::test::WithDevice;

namespace {
constexpr std::size_t KiB = 1 << 10;
constexpr std::size_t MiB = 1 << 20;

AllocatorConfig capped(std::uint64_t bytes) {
  AllocatorConfig c;
  c.max_bytes = bytes;
  c.record_history = true;
  c.headroom_margin = 0;
  return c;
}

std::int64_t current(const StatArray& a) { return a[0].current; }
}  // namespace

template <typename B>
class CachingAllocatorTest : public WithDevice<B> {
 protected:
  void SetUp() override {
    WithDevice<B>::SetUp();
    if (this->IsSkipped()) return;
    alloc_ = std::make_unique<CachingAllocator>(this->device(), config());
  }
  [[nodiscard]] virtual AllocatorConfig config() const { return capped(64 * MiB); }
  void TearDown() override {
    if (alloc_) {
      EXPECT_EQ(validate_snapshot(alloc_->snapshot()), "");
      alloc_.reset();
    }
  }
  CachingAllocator& a() { return *alloc_; }
  std::unique_ptr<CachingAllocator> alloc_;
};
TYPED_TEST_SUITE(CachingAllocatorTest, memtide::test::DeviceBackends, memtide::test::BackendNames);

TYPED_TEST(CachingAllocatorTest, FreedBlockIsReusedAtOnceOnTheSameStream) {
  void* p = this->a().allocate(100 * KiB, Stream{});
  this->a().deallocate(p, Stream{});
  EXPECT_EQ(this->a().allocate(100 * KiB, Stream{}), p);
  this->a().deallocate(p, Stream{});
  EXPECT_EQ(this->a().stats().num_device_alloc, 1);
}

TYPED_TEST(CachingAllocatorTest, RoundsTo512AndPicksPoolsLikePyTorch) {
  void* small = this->a().allocate(1000, Stream{});
  EXPECT_EQ(this->a().allocation_size(small), 1024u);
  void* medium = this->a().allocate(3 * MiB, Stream{});
  void* large = this->a().allocate(25 * MiB + 5, Stream{});
  // Rounded to 25 MiB + 512 in a 26 MiB segment; the 1 MiB - 512 left is below the large pool's
  // split threshold, so the block keeps the whole segment.
  EXPECT_EQ(this->a().allocation_size(large), 26 * MiB);
  // An 11 MiB request fits the 17 MiB left in the medium request's 20 MiB segment: no new segment.
  void* fits = this->a().allocate(11 * MiB, Stream{});
  EXPECT_EQ(static_cast<char*>(fits) - static_cast<char*>(medium), static_cast<std::ptrdiff_t>(3 * MiB));
  const AllocatorStats s = this->a().stats();
  EXPECT_EQ(s.reserved_bytes[static_cast<int>(StatType::small_pool)].current, static_cast<std::int64_t>(2 * MiB));
  // 20 MiB shared segment for the 3 MiB request, a 26 MiB (2 MiB-rounded) one for the 25 MiB.
  EXPECT_EQ(s.reserved_bytes[static_cast<int>(StatType::large_pool)].current, static_cast<std::int64_t>(46 * MiB));
  EXPECT_EQ(s.requested_bytes[0].current, static_cast<std::int64_t>(1000 + 3 * MiB + 25 * MiB + 5 + 11 * MiB));
  this->a().deallocate(fits, Stream{});
  for (void* p : {small, medium, large}) this->a().deallocate(p, Stream{});
}

TYPED_TEST(CachingAllocatorTest, SplitsAndCoalesces) {
  void* x = this->a().allocate(256 * KiB, Stream{});
  void* y = this->a().allocate(256 * KiB, Stream{});
  void* z = this->a().allocate(256 * KiB, Stream{});
  EXPECT_EQ(static_cast<char*>(y) - static_cast<char*>(x), static_cast<std::ptrdiff_t>(256 * KiB));
  EXPECT_EQ(this->a().stats().segment[0].current, 1);
  this->a().deallocate(y, Stream{});
  EXPECT_EQ(current(this->a().stats().inactive_split), 2);  // y's hole and the tail
  this->a().deallocate(x, Stream{});
  this->a().deallocate(z, Stream{});
  const AllocatorStats s = this->a().stats();
  EXPECT_EQ(current(s.inactive_split), 0) << "all three merged back into one free segment";
  EXPECT_EQ(current(s.inactive_split_bytes), 0);
  const Snapshot snap = this->a().snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 1u);
  EXPECT_EQ(snap.segments[0].blocks[0].size, 2 * MiB);
  // And a request for the whole segment now fits without a new one.
  void* all = this->a().allocate(1 * MiB, Stream{});  // the largest small-pool request
  EXPECT_EQ(all, x);
  this->a().deallocate(all, Stream{});
}

TYPED_TEST(CachingAllocatorTest, BestFitPrefersTheSmallestHole) {
  std::vector<void*> v;
  for (int i = 0; i < 6; ++i) v.push_back(this->a().allocate(100 * KiB * (i % 2 ? 1 : 3), Stream{}));
  this->a().deallocate(v[0], Stream{});  // 300 KiB hole
  this->a().deallocate(v[1], Stream{});  // merges with it: 400 KiB
  this->a().deallocate(v[3], Stream{});  // 100 KiB hole
  EXPECT_EQ(this->a().allocate(90 * KiB, Stream{}), v[3]);
  for (int i : {2, 3, 4, 5}) this->a().deallocate(v[i], Stream{});
}

TYPED_TEST(CachingAllocatorTest, OtherStreamGetsNewMemoryWhileBelowTheLimit) {
  Stream s1 = this->device().create_stream();
  Stream s2 = this->device().create_stream();
  void* p = this->a().allocate(4 * MiB, s1);
  this->a().deallocate(p, s1);
  void* q = this->a().allocate(4 * MiB, s2);
  EXPECT_NE(p, q) << "a block freed on s1 must not be handed to s2 without ordering";
  EXPECT_EQ(this->a().stats().num_cross_stream_reuse, 0);
  this->a().deallocate(q, s2);
  this->device().destroy_stream(s1);
  this->device().destroy_stream(s2);
}

TYPED_TEST(CachingAllocatorTest, AtTheLimitACachedSegmentMovesStreamsBehindAnEvent) {
  Stream s1 = this->device().create_stream();
  Stream s2 = this->device().create_stream();
  void* big = this->a().allocate(60 * MiB, s1);
  std::vector<char> host(60 * MiB, 3);
  // Queue work on s1 that uses the block, then free it in stream order.
  this->device().copy_async(big, host.data(), host.size(), CopyKind::host_to_device, s1);
  this->a().deallocate(big, s1);
  void* again = this->a().allocate(50 * MiB, s2);
  EXPECT_EQ(again, big);
  EXPECT_EQ(this->a().stats().num_cross_stream_reuse, 1);
  if (SimDevice* sim = this->sim()) {
    EXPECT_GE(sim->stream_ready_ns(s2), sim->stream_ready_ns(s1)) << "s2 must wait for s1's copy";
  }
  this->a().deallocate(again, s2);
  this->device().synchronize();
  this->device().destroy_stream(s1);
  this->device().destroy_stream(s2);
}

TYPED_TEST(CachingAllocatorTest, RecordStreamHoldsTheBlockUntilThatStreamIsDone) {
  Stream user = this->device().create_stream();
  void* p = this->a().allocate(8 * MiB, Stream{});
  std::vector<char> host(8 * MiB, 1);
  this->a().record_stream(p, user);
  this->device().copy_async(p, host.data(), host.size(), CopyKind::host_to_device, user);
  this->a().deallocate(p, Stream{});
  const AllocatorStats held = this->a().stats();
  EXPECT_EQ(current(held.allocated_bytes), 0);
  if (this->sim() != nullptr) {
    // The simulated copy has not completed on the host clock: the block is still pending.
    EXPECT_GT(current(held.active_bytes), 0);
    void* other = this->a().allocate(8 * MiB, Stream{});
    EXPECT_NE(other, p);
    this->a().deallocate(other, Stream{});
    const Snapshot snap = this->a().snapshot();
    EXPECT_TRUE(std::any_of(snap.segments.begin(), snap.segments.end(), [](const SegmentSnapshot& s) {
      return std::any_of(s.blocks.begin(), s.blocks.end(),
                         [](const BlockSnapshot& b) { return b.state == BlockState::active_pending_free; });
    }));
    EXPECT_EQ(validate_snapshot(snap), "");
  }
  this->device().synchronize();
  // Once the stream is done, the next allocation retires the pending free and may reuse it.
  void* q = this->a().allocate(4 * MiB, Stream{});
  EXPECT_EQ(current(this->a().stats().active_bytes), current(this->a().stats().allocated_bytes));
  this->a().deallocate(q, Stream{});
  this->a().empty_cache();
  this->device().destroy_stream(user);
}

TYPED_TEST(CachingAllocatorTest, OomReleasesCacheRetriesThenFailsWithAUsefulMessage) {
  std::vector<void*> small;
  for (int i = 0; i < 10; ++i) small.push_back(this->a().allocate(3 * MiB, Stream{}));  // 2 x 20 MiB segments
  for (void* p : small) this->a().deallocate(p, Stream{});
  // 50 MiB does not fit next to 40 MiB of cache under a 64 MiB cap: release, then retry.
  void* big = this->a().allocate(50 * MiB, Stream{});
  AllocatorStats s = this->a().stats();
  EXPECT_EQ(s.num_alloc_retries, 1);
  EXPECT_EQ(s.num_ooms, 0);

  this->a().mark_phase(Phase::backward);
  try {
    (void)this->a().allocate(20 * MiB, Stream{});
    FAIL() << "allocation over the cap succeeded";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    for (const char* part : {"tried to allocate 20.00 MiB", "Limit 64.00 MiB", "allocated 50.00 MiB",
                             "reserved 50.00 MiB", "Current phase: backward", "device free"}) {
      EXPECT_NE(msg.find(part), std::string::npos) << "missing \"" << part << "\" in: " << msg;
    }
  }
  EXPECT_EQ(this->a().stats().num_ooms, 1);
  this->a().deallocate(big, Stream{});
}

TYPED_TEST(CachingAllocatorTest, OomMessageCarriesLastIterationPeaks) {
  for (Phase p : {Phase::forward, Phase::backward, Phase::update}) {
    this->a().mark_phase(p);
    this->a().deallocate(this->a().allocate(p == Phase::backward ? 30 * MiB : 10 * MiB, Stream{}), Stream{});
  }
  this->a().mark_phase(Phase::forward);
  try {
    (void)this->a().allocate(100 * MiB, Stream{});
    FAIL();
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("backward 30.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("forward 10.00 MiB"), std::string::npos) << msg;
  }
}

TYPED_TEST(CachingAllocatorTest, MemoryFractionAndCapSetTheLimit) {
  const std::uint64_t total = this->device().properties().total_memory;
  this->a().set_max_bytes(0);
  this->a().set_memory_fraction(0.5);
  EXPECT_EQ(this->a().limit(), static_cast<std::uint64_t>(static_cast<double>(total) * 0.5));
  this->a().set_max_bytes(32 * MiB);
  EXPECT_EQ(this->a().limit(), 32 * MiB);
  EXPECT_THROW(this->a().set_memory_fraction(0.0), InvalidArgument);
  EXPECT_THROW(this->a().set_memory_fraction(1.5), InvalidArgument);
  EXPECT_THROW((void)this->a().allocate(40 * MiB, Stream{}), OutOfMemory);
}

TYPED_TEST(CachingAllocatorTest, EmptyCacheReturnsOnlyFreeSegments) {
  void* keep = this->a().allocate(512 * KiB, Stream{});
  void* drop = this->a().allocate(12 * MiB, Stream{});
  this->a().deallocate(drop, Stream{});
  EXPECT_EQ(current(this->a().stats().reserved_bytes), static_cast<std::int64_t>(14 * MiB));
  this->a().empty_cache();
  const AllocatorStats s = this->a().stats();
  EXPECT_EQ(current(s.reserved_bytes), static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(s.num_device_free, 1);
  this->a().deallocate(keep, Stream{});
  this->a().empty_cache();
  EXPECT_EQ(current(this->a().stats().reserved_bytes), 0);
}

TYPED_TEST(CachingAllocatorTest, UnknownAndDoubleFreesAreReportedAndHarmless) {
  void* p = this->a().allocate(1 * MiB, Stream{});
  void* q = this->a().allocate(1 * MiB, Stream{});
  int local = 0;
  EXPECT_THROW(this->a().deallocate(&local, Stream{}), InvalidArgument);
  this->a().deallocate(p, Stream{});
  EXPECT_THROW(this->a().deallocate(p, Stream{}), InvalidArgument);
  // An interior pointer is not an allocation either.
  EXPECT_THROW(this->a().deallocate(static_cast<char*>(q) + 512, Stream{}), InvalidArgument);
  const AllocatorStats s = this->a().stats();
  EXPECT_EQ(s.num_invalid_frees, 3);
  EXPECT_EQ(current(s.allocation), 1);
  EXPECT_EQ(current(s.allocated_bytes), static_cast<std::int64_t>(1 * MiB));
  this->a().deallocate(q, Stream{});
  EXPECT_EQ(current(this->a().stats().allocated_bytes), 0);
}

TYPED_TEST(CachingAllocatorTest, StatsTrackPeaksAndReset) {
  void* a = this->a().allocate(4 * MiB, Stream{});
  void* b = this->a().allocate(4 * MiB, Stream{});
  this->a().deallocate(a, Stream{});
  AllocatorStats s = this->a().stats();
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].allocated, static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].freed, static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(s.allocation[0].peak, 2);
  this->a().reset_peak_stats();
  EXPECT_EQ(this->a().stats().allocated_bytes[0].peak, static_cast<std::int64_t>(4 * MiB));
  this->a().reset_accumulated_stats();
  EXPECT_EQ(this->a().stats().allocated_bytes[0].allocated, 0);
  const auto flat = flatten(this->a().stats());
  EXPECT_EQ(flat.at("allocated_bytes.all.current"), static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(flat.at("allocated_bytes.large_pool.current"), static_cast<std::int64_t>(4 * MiB));
  EXPECT_TRUE(flat.count("num_alloc_retries"));
  this->a().deallocate(b, Stream{});
}

TYPED_TEST(CachingAllocatorTest, PhaseWatermarksAndHeadroomFollowTheIteration) {
  for (int iter = 0; iter < 3; ++iter) {
    this->a().mark_phase(Phase::forward);
    void* act = this->a().allocate(40 * MiB, Stream{});
    this->a().mark_phase(Phase::backward);
    void* grad = this->a().allocate(8 * MiB, Stream{});
    this->a().deallocate(act, Stream{});
    this->a().mark_phase(Phase::update);
    void* tmp = this->a().allocate(2 * MiB, Stream{});
    this->a().deallocate(tmp, Stream{});
    this->a().deallocate(grad, Stream{});
  }
  this->a().mark_phase(Phase::forward);
  const PhaseReport r = this->a().phase_report();
  ASSERT_EQ(r.iterations, 3u);
  const IterationRecord& last = r.history.back();
  EXPECT_EQ(last.phases[0].peak_allocated, 40 * MiB);
  EXPECT_EQ(last.phases[1].peak_allocated, 48 * MiB);
  EXPECT_EQ(last.phases[2].peak_allocated, 10 * MiB);
  // In update, a loan kept until forward may take all but update's peak.
  this->a().mark_phase(Phase::backward);
  this->a().mark_phase(Phase::update);
  const Headroom h = this->a().headroom(Phase::forward, 0);
  EXPECT_TRUE(h.from_history);
  EXPECT_EQ(h.bytes, 64 * MiB - 10 * MiB);
  EXPECT_EQ(h.limiting_phase, Phase::update);
  // Kept through the next forward and backward too, it is capped by backward's 48 MiB peak.
  EXPECT_EQ(this->a().headroom(Phase::update, 0).bytes, 64 * MiB - 48 * MiB);
}

TYPED_TEST(CachingAllocatorTest, RandomWorkloadKeepsStatsAndSnapshotConsistent) {
  std::mt19937 rng(1234);
  std::vector<void*> live;
  std::int64_t expect_requested = 0;
  std::vector<std::size_t> sizes;
  for (int step = 0; step < 3000; ++step) {
    const bool do_alloc = live.empty() || (rng() % 100 < 55 && live.size() < 60);
    if (do_alloc) {
      const std::size_t n = (rng() % 4 == 0) ? (rng() % (6 * MiB)) + 1 : (rng() % (256 * KiB)) + 1;
      try {
        live.push_back(this->a().allocate(n, Stream{}));
        sizes.push_back(n);
        expect_requested += static_cast<std::int64_t>(n);
      } catch (const OutOfMemory&) {
        // Expected now and then under a 64 MiB cap; state must stay consistent.
      }
    } else {
      const std::size_t i = rng() % live.size();
      this->a().deallocate(live[i], Stream{});
      expect_requested -= static_cast<std::int64_t>(sizes[i]);
      live[i] = live.back();
      live.pop_back();
      sizes[i] = sizes.back();
      sizes.pop_back();
    }
    if (step % 500 == 0) {
      ASSERT_EQ(validate_snapshot(this->a().snapshot()), "") << "at step " << step;
    }
  }
  EXPECT_EQ(this->a().stats().requested_bytes[0].current, expect_requested);
  for (void* p : live) this->a().deallocate(p, Stream{});
  const AllocatorStats s = this->a().stats();
  EXPECT_EQ(current(s.allocated_bytes), 0);
  EXPECT_EQ(current(s.active_bytes), 0);
  EXPECT_EQ(current(s.inactive_split), 0);
}

TYPED_TEST(CachingAllocatorTest, PrivatePoolKeepsItsSegmentsFromOtherAllocations) {
  Stream capture = this->device().create_stream();
  const PoolId graph{7, 0};
  this->a().begin_allocate_to_pool(graph, [capture](Stream s) { return s == capture; });
  EXPECT_EQ(this->a().pool_use_count(graph), 1);
  void* in_pool = this->a().allocate(300 * KiB, capture);
  void* outside = this->a().allocate(300 * KiB, Stream{});  // another stream: the default pool
  this->a().deallocate(in_pool, capture);
  // Freed inside the pool: reused by the pool's next allocation, not by anyone else's.
  EXPECT_EQ(this->a().allocate(300 * KiB, capture), in_pool);
  this->a().deallocate(in_pool, capture);
  this->a().end_allocate_to_pool(graph);
  void* after = this->a().allocate(300 * KiB, capture);
  EXPECT_NE(after, in_pool) << "the pool's cache went to an allocation outside the capture";

  const Snapshot snap = this->a().snapshot();
  int pool_segments = 0;
  for (const SegmentSnapshot& s : snap.segments) {
    if (s.pool_first == 7) {
      ++pool_segments;
      EXPECT_EQ(s.allocated_size, 0u);
    }
  }
  EXPECT_EQ(pool_segments, 1);
  this->a().deallocate(after, capture);
  this->a().deallocate(outside, Stream{});
  this->a().release_pool(graph);
  EXPECT_EQ(this->a().pool_use_count(graph), 0);
  this->a().empty_cache();
  EXPECT_EQ(current(this->a().stats().reserved_bytes), 0);
  this->device().destroy_stream(capture);
}

TYPED_TEST(CachingAllocatorTest, ReleasedPoolReturnsItsMemoryWhenItsLastBlockIsFreed) {
  const PoolId pool{0, 3};  // torch.cuda.MemPool ids have first == 0
  this->a().create_or_incref_pool(pool);
  this->a().begin_allocate_to_pool(pool, {});  // shares the pool: use count 2
  EXPECT_EQ(this->a().pool_use_count(pool), 2);
  void* kept = this->a().allocate(12 * MiB, Stream{});  // a segment of its own
  void* dropped = this->a().allocate(100 * KiB, Stream{});
  this->a().end_allocate_to_pool(pool);
  this->a().deallocate(dropped, Stream{});
  this->a().release_pool(pool);
  this->a().release_pool(pool);
  // The small segment was free: returned at once. The live block's segment stays.
  EXPECT_EQ(current(this->a().stats().reserved_bytes), static_cast<std::int64_t>(12 * MiB));
  EXPECT_EQ(this->a().stats().segment[0].current, 1);
  this->a().deallocate(kept, Stream{});
  // Back in the released pool's cache, which no allocation can use: empty_cache (or an OOM
  // retry) returns it.
  void* other = this->a().allocate(12 * MiB, Stream{});
  EXPECT_NE(other, kept);
  this->a().deallocate(other, Stream{});
  this->a().empty_cache();
  EXPECT_EQ(current(this->a().stats().reserved_bytes), 0);
  EXPECT_THROW(this->a().release_pool(pool), InvalidArgument);
}

TYPED_TEST(CachingAllocatorTest, PoolMisuseIsRefusedAndChangesNothing) {
  EXPECT_THROW(this->a().begin_allocate_to_pool({0, 0}, {}), InvalidArgument);
  EXPECT_THROW(this->a().create_or_incref_pool({0, 0}), InvalidArgument);
  EXPECT_THROW(this->a().end_allocate_to_pool({1, 0}), InvalidArgument);
  EXPECT_THROW(this->a().release_pool({1, 0}), InvalidArgument);
  this->a().begin_allocate_to_pool({1, 0}, {});
  EXPECT_THROW(this->a().begin_allocate_to_pool({1, 0}, {}), InvalidArgument);
  EXPECT_EQ(this->a().pool_use_count({1, 0}), 1);
  this->a().end_allocate_to_pool({1, 0});
  EXPECT_THROW(this->a().end_allocate_to_pool({1, 0}), InvalidArgument);
  this->a().release_pool({1, 0});
  EXPECT_EQ(this->a().pool_use_count({1, 0}), 0);
}

TYPED_TEST(CachingAllocatorTest, OutOfMemoryRetryTakesBackReleasedPoolsCache) {
  const PoolId pool{9, 0};
  this->a().begin_allocate_to_pool(pool, {});
  void* p = this->a().allocate(40 * MiB, Stream{});
  this->a().end_allocate_to_pool(pool);
  this->a().release_pool(pool);
  this->a().deallocate(p, Stream{});
  // 40 MiB sits in the released pool; a 40 MiB request elsewhere fits only once it is returned.
  void* q = this->a().allocate(40 * MiB, Stream{});
  EXPECT_EQ(this->a().stats().num_alloc_retries, 1);
  this->a().deallocate(q, Stream{});
}

TYPED_TEST(CachingAllocatorTest, CacheInfoAndBaseAllocation) {
  void* a = this->a().allocate(3 * MiB, Stream{});
  void* b = this->a().allocate(4 * MiB, Stream{});  // same 20 MiB segment
  const auto base = this->a().segment_of(b);
  ASSERT_TRUE(base.has_value());
  EXPECT_EQ(base->first, a);
  EXPECT_EQ(base->second, 20 * MiB);
  EXPECT_FALSE(this->a().segment_of(static_cast<char*>(b) + 512).has_value());
  // 13 MiB free in the segment, 44 MiB left under the 64 MiB cap (the device has more).
  EXPECT_EQ(this->a().largest_free_block(), 44 * MiB);
  this->a().set_max_bytes(20 * MiB);
  EXPECT_EQ(this->a().largest_free_block(), 13 * MiB);
  this->a().deallocate(a, Stream{});
  this->a().deallocate(b, Stream{});
}

// ---- expandable segments -------------------------------------------------------------------

template <typename B>
class ExpandableSegmentTest : public CachingAllocatorTest<B> {
 protected:
  void SetUp() override {
    CachingAllocatorTest<B>::SetUp();
    if (this->IsSkipped()) return;
    granule_ = this->device().vmm_granularity();
    if (granule_ == 0) GTEST_SKIP() << "the device has no virtual memory management";
  }
  [[nodiscard]] AllocatorConfig config() const override {
    AllocatorConfig c = capped(64 * MiB);
    c.expandable_segments = true;
    return c;
  }
  std::size_t granule_ = 0;
};
TYPED_TEST_SUITE(ExpandableSegmentTest, memtide::test::DeviceBackends, memtide::test::BackendNames);

TYPED_TEST(ExpandableSegmentTest, LargeAllocationsGrowOneSegmentInPlace) {
  ASSERT_TRUE(this->a().expandable_segments());
  const std::size_t g = this->granule_;
  auto* p = static_cast<char*>(this->a().allocate(2 * g, Stream{}));
  auto* q = static_cast<char*>(this->a().allocate(3 * g, Stream{}));
  auto* r = static_cast<char*>(this->a().allocate(g + 4 * KiB, Stream{}));  // rounds up to 2 granules mapped
  EXPECT_EQ(q, p + 2 * g);
  EXPECT_EQ(r, q + 3 * g);
  AllocatorStats s = this->a().stats();
  EXPECT_EQ(s.segment[0].current, 1);
  EXPECT_EQ(current(s.reserved_bytes), static_cast<std::int64_t>(7 * g));
  const Snapshot snap = this->a().snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_TRUE(snap.segments[0].expandable);
  EXPECT_EQ(snap.segments[0].total_size, 7 * g);

  // Freeing the middle leaves a hole that the next fitting allocation takes; freeing the end
  // and releasing the cache unmaps from the end.
  this->a().deallocate(q, Stream{});
  EXPECT_EQ(this->a().allocate(3 * g, Stream{}), q);
  this->a().deallocate(q, Stream{});
  this->a().deallocate(r, Stream{});
  this->a().empty_cache();
  s = this->a().stats();
  EXPECT_EQ(current(s.reserved_bytes), static_cast<std::int64_t>(2 * g));
  EXPECT_EQ(s.segment[0].current, 1);
  this->a().deallocate(p, Stream{});
  this->a().empty_cache();
  s = this->a().stats();
  EXPECT_EQ(current(s.reserved_bytes), 0);
  EXPECT_EQ(s.segment[0].current, 0);
  EXPECT_EQ(current(s.inactive_split), 0);
  // And it grows again from its base.
  EXPECT_EQ(this->a().allocate(2 * g, Stream{}), p);
  this->a().deallocate(p, Stream{});
}

TYPED_TEST(ExpandableSegmentTest, AFreeTailGrowsInsteadOfStrandingIt) {
  const std::size_t g = this->granule_;
  void* p = this->a().allocate(4 * g, Stream{});
  void* q = this->a().allocate(4 * g, Stream{});
  this->a().deallocate(q, Stream{});
  // 4 granules free at the end; a 6-granule request maps only 2 more and takes them with it.
  void* r = this->a().allocate(6 * g, Stream{});
  EXPECT_EQ(r, q);
  EXPECT_EQ(current(this->a().stats().reserved_bytes), static_cast<std::int64_t>(10 * g));
  this->a().deallocate(p, Stream{});
  this->a().deallocate(r, Stream{});
}

TYPED_TEST(ExpandableSegmentTest, TheLimitHoldsAndOutOfMemoryTrimsFirst) {
  // 64 MiB cap: with 40 MiB live and 20 MiB free at the end, 30 MiB more fits only after the
  // free end is unmapped and the segment grows again from the live part.
  void* a = this->a().allocate(40 * MiB, Stream{});
  void* b = this->a().allocate(20 * MiB, Stream{});
  this->a().deallocate(b, Stream{});
  EXPECT_THROW(this->a().allocate(30 * MiB, Stream{}), OutOfMemory);
  void* c = this->a().allocate(24 * MiB, Stream{});  // 20 free at the end + 4 mapped
  EXPECT_EQ(c, b);
  EXPECT_LE(current(this->a().stats().reserved_bytes), static_cast<std::int64_t>(64 * MiB));
  this->a().deallocate(a, Stream{});
  this->a().deallocate(c, Stream{});
}

TYPED_TEST(ExpandableSegmentTest, StreamsHaveTheirOwnSegmentsAndSmallRequestsTheirPool) {
  Stream side = this->device().create_stream();
  void* a = this->a().allocate(4 * MiB, Stream{});
  void* b = this->a().allocate(4 * MiB, side);
  void* small = this->a().allocate(64 * KiB, Stream{});
  const Snapshot snap = this->a().snapshot();
  int expandable = 0;
  for (const SegmentSnapshot& s : snap.segments) expandable += s.expandable ? 1 : 0;
  EXPECT_EQ(expandable, 2);
  EXPECT_EQ(snap.segments.size(), 3u);
  this->a().deallocate(a, Stream{});
  this->a().deallocate(b, side);
  this->a().deallocate(small, Stream{});
  this->a().empty_cache();
  EXPECT_EQ(current(this->a().stats().reserved_bytes), 0);
  this->device().destroy_stream(side);
}

TYPED_TEST(ExpandableSegmentTest, RandomWorkloadKeepsStatsAndSnapshotConsistent) {
  std::mt19937 rng(11);
  std::vector<void*> live;
  for (int step = 0; step < 4000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const std::size_t bytes = (rng() % 2 == 0) ? (rng() % (2 * MiB)) + 1 : (rng() % (6 * MiB)) + MiB;
      try {
        live.push_back(this->a().allocate(bytes, Stream{}));
      } catch (const OutOfMemory&) {
        ASSERT_LE(current(this->a().stats().reserved_bytes), static_cast<std::int64_t>(64 * MiB));
      }
    } else {
      const std::size_t i = rng() % live.size();
      this->a().deallocate(live[i], Stream{});
      live[i] = live.back();
      live.pop_back();
    }
    if (step % 97 == 0) this->a().empty_cache();
    if (step % 500 == 0) {
      ASSERT_EQ(validate_snapshot(this->a().snapshot()), "") << "at step " << step;
    }
  }
  for (void* p : live) this->a().deallocate(p, Stream{});
  this->a().empty_cache();
  const AllocatorStats s = this->a().stats();
  EXPECT_EQ(current(s.allocated_bytes), 0);
  EXPECT_EQ(current(s.reserved_bytes), 0);
  EXPECT_EQ(current(s.inactive_split), 0);
  EXPECT_EQ(current(s.inactive_split_bytes), 0);
}

TEST(ExpandableSegments, OffWhereTheDeviceHasNoVirtualMemory) {
  memtide::test::FailingDevice plain;  // forwards no virtual memory calls unless asked to
  ASSERT_EQ(plain.vmm_granularity(), 0u);
  AllocatorConfig c;
  c.expandable_segments = true;
  CachingAllocator a(plain, c);
  EXPECT_FALSE(a.expandable_segments());
  void* p = a.allocate(4 * MiB, Stream{});
  EXPECT_FALSE(a.snapshot().segments.at(0).expandable);
  a.deallocate(p, Stream{});
}

TEST(ExpandableSegments, AFailedMapLeavesTheAllocatorAsItWas) {
  memtide::test::FailingDevice d;
  d.enable_vmm(true);
  AllocatorConfig c;
  c.expandable_segments = true;
  c.record_history = true;
  CachingAllocator a(d, c);
  void* p = a.allocate(4 * MiB, Stream{});
  const AllocatorStats before = a.stats();
  d.fail_at(1);  // the next map
  EXPECT_THROW(a.allocate(8 * MiB, Stream{}), Error);
  const AllocatorStats after = a.stats();
  EXPECT_EQ(current(after.reserved_bytes), current(before.reserved_bytes));
  EXPECT_EQ(current(after.allocated_bytes), current(before.allocated_bytes));
  EXPECT_EQ(validate_snapshot(a.snapshot()), "");
  void* q = a.allocate(8 * MiB, Stream{});  // and the next try works
  a.deallocate(q, Stream{});
  a.deallocate(p, Stream{});
}

TEST(DirectResource, GoesStraightToTheDevice) {
  SimDevice d;
  DirectResource r(d);
  void* p = r.allocate(3 * MiB, Stream{});
  EXPECT_EQ(d.used_bytes(), 3 * MiB);
  r.deallocate(p, Stream{});
  EXPECT_EQ(d.used_bytes(), 0u);
  EXPECT_EQ(r.allocate(0, Stream{}), nullptr);
}

// Which cached segment moves to another stream must not follow the order of the streams' handles
// (heap addresses, which differ from one process to the next): among equal sizes the lowest
// address moves. On a phantom SimDevice addresses rise with each allocation, so the lower block is
// put on the stream whose handle sorts last, where handle order would pick the other one.
TEST(CachingAllocatorSteal, AmongEqualCachedSegmentsTheLowestAddressMovesStreams) {
  SimConfig config;
  config.phantom = true;
  SimDevice device(config);
  CachingAllocator alloc(device, capped(64 * MiB));
  Stream a = device.create_stream();
  Stream b = device.create_stream();
  if (b < a) std::swap(a, b);
  void* lower = alloc.allocate(30 * MiB, b);
  void* higher = alloc.allocate(30 * MiB, a);
  ASSERT_LT(lower, higher);
  alloc.deallocate(lower, b);
  alloc.deallocate(higher, a);
  Stream c = device.create_stream();
  EXPECT_EQ(alloc.allocate(30 * MiB, c), lower);
  EXPECT_EQ(alloc.stats().num_cross_stream_reuse, 1);
  alloc.deallocate(lower, c);
  device.synchronize();
  for (Stream s : {a, b, c}) device.destroy_stream(s);
}
