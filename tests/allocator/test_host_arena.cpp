// HostArena: best fit with coalescing, alignment, growth, caps, node validation, placement and
// registration. Suites that register slabs run against every device backend; the rest need no
// Device. This VM has one NUMA node (0); node tests ask HostArena which nodes exist.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "device_types.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/thread_pool.hpp"

using namespace memtide;
using memtide::test::WithDevice;

namespace {
constexpr std::size_t KiB = 1 << 10;
constexpr std::size_t MiB = 1 << 20;

HostArenaConfig small(std::size_t slab = MiB, std::uint64_t cap = 0) {
  HostArenaConfig c;
  c.slab_bytes = slab;
  c.max_bytes = cap;
  return c;
}

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

bool node_exists(int node) {
  const auto nodes = HostArena::valid_numa_nodes();
  return std::find(nodes.begin(), nodes.end(), node) != nodes.end();
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}
}  // namespace

TEST(HostArena, AllocateWriteFreeAndStats) {
  HostArena arena(small());
  void* p = arena.allocate(1000);
  ASSERT_NE(p, nullptr);
  std::memset(p, 0xab, 1000);
  EXPECT_EQ(arena.allocation_size(p), 1024u);  // rounded to the 256 B default alignment
  HostArenaStats s = arena.stats();
  EXPECT_EQ(s.allocated_bytes, 1024u);
  EXPECT_EQ(s.allocations, 1u);
  EXPECT_EQ(s.slabs, 1u);
  EXPECT_EQ(s.reserved_bytes, MiB);
  EXPECT_EQ(s.registered_slabs, 0u);  // no Device: touched, not registered
  arena.deallocate(p);
  s = arena.stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.allocations, 0u);
  EXPECT_EQ(s.peak_allocated_bytes, 1024u);
  EXPECT_EQ(arena.allocation_size(p), 0u);
}

TEST(HostArena, BestFitPicksTheSmallestFittingBlock) {
  HostArena arena(small());
  // Free holes of 64, 16 and 32 KiB, kept apart by live separators so they cannot merge.
  void* h64 = arena.allocate(64 * KiB);
  void* s1 = arena.allocate(4 * KiB);
  void* h16 = arena.allocate(16 * KiB);
  void* s2 = arena.allocate(4 * KiB);
  void* h32 = arena.allocate(32 * KiB);
  void* s3 = arena.allocate(4 * KiB);
  arena.deallocate(h64);
  arena.deallocate(h16);
  arena.deallocate(h32);
  EXPECT_EQ(arena.allocate(10 * KiB), h16);  // 16 KiB is the smallest hole that fits 10 KiB
  EXPECT_EQ(arena.allocate(20 * KiB), h32);
  EXPECT_EQ(arena.allocate(40 * KiB), h64);
  EXPECT_EQ(arena.stats().slabs, 1u);
  (void)s1, (void)s2, (void)s3;
}

TEST(HostArena, FreeNeighboursMergeBackIntoOneBlock) {
  HostArena arena(small());
  void* a = arena.allocate(100 * KiB);
  void* b = arena.allocate(100 * KiB);
  void* c = arena.allocate(100 * KiB);
  void* d = arena.allocate(100 * KiB);  // keeps the tail from merging with c
  ASSERT_EQ(addr(b), addr(a) + 100 * KiB);
  ASSERT_EQ(addr(c), addr(b) + 100 * KiB);
  arena.deallocate(a);
  arena.deallocate(c);
  arena.deallocate(b);  // merges with both neighbours
  // Only a merged block of 300 KiB can serve this without a new slab.
  EXPECT_EQ(arena.allocate(300 * KiB), a);
  EXPECT_EQ(arena.stats().slabs, 1u);
  arena.deallocate(a);
  arena.deallocate(d);
  // Everything free again: one block spanning the whole slab.
  void* whole = arena.allocate(MiB);
  EXPECT_EQ(whole, a);
  EXPECT_EQ(arena.stats().slabs, 1u);
  arena.deallocate(whole);
}

TEST(HostArena, AlignmentIsHonouredAndValidated) {
  HostArenaConfig c = small();
  c.alignment = 4096;
  HostArena arena(c);
  std::vector<void*> ptrs;
  for (std::size_t bytes : {1u, 100u, 4095u, 4097u, 10000u}) {
    void* p = arena.allocate(bytes);
    EXPECT_EQ(addr(p) % 4096, 0u) << bytes;
    EXPECT_EQ(arena.allocation_size(p) % 4096, 0u);
    EXPECT_GE(arena.allocation_size(p), bytes);
    ptrs.push_back(p);
  }
  for (void* p : ptrs) arena.deallocate(p);

  c.alignment = 2 * MiB;  // above a page: the slab itself must be aligned
  HostArena big(c);
  void* p = big.allocate(10);
  EXPECT_EQ(addr(p) % (2 * MiB), 0u);
  big.deallocate(p);

  for (std::size_t bad : {std::size_t{0}, std::size_t{3}, std::size_t{384}, std::size_t{1} << 31}) {
    c.alignment = bad;
    const std::string msg = error_of([&] { HostArena a(c); });
    EXPECT_NE(msg.find("alignment " + std::to_string(bad)), std::string::npos) << msg;
    EXPECT_NE(msg.find("power of two"), std::string::npos) << msg;
    EXPECT_THROW(HostArena{c}, InvalidArgument);
  }
}

TEST(HostArena, GrowsIntoASecondSlabAndFitsOversizedRequests) {
  HostArena arena(small(MiB));
  void* a = arena.allocate(768 * KiB);
  void* b = arena.allocate(768 * KiB);  // does not fit the first slab's 256 KiB rest
  HostArenaStats s = arena.stats();
  EXPECT_EQ(s.slabs, 2u);
  EXPECT_EQ(s.reserved_bytes, 2 * MiB);
  void* c = arena.allocate(3 * MiB);  // larger than a slab: gets a slab of its own size
  s = arena.stats();
  EXPECT_EQ(s.slabs, 3u);
  EXPECT_EQ(s.reserved_bytes, 5 * MiB);
  EXPECT_EQ(arena.slabs().size(), 3u);
  // The rest of the first slab still serves small requests.
  void* d = arena.allocate(200 * KiB);
  EXPECT_EQ(arena.stats().slabs, 3u);
  for (void* p : {a, b, c, d}) arena.deallocate(p);
}

TEST(HostArena, ReleaseFreeSlabsKeepsSlabsWithLiveBuffers) {
  HostArena arena(small(MiB));
  void* a = arena.allocate(768 * KiB);
  void* b = arena.allocate(768 * KiB);
  arena.deallocate(b);
  EXPECT_EQ(arena.release_free_slabs(), MiB);
  HostArenaStats s = arena.stats();
  EXPECT_EQ(s.slabs, 1u);
  EXPECT_EQ(s.reserved_bytes, MiB);
  EXPECT_EQ(s.slabs_released, 1u);
  std::memset(a, 1, 768 * KiB);  // still mapped
  EXPECT_EQ(arena.release_free_slabs(), 0u);
  arena.deallocate(a);
  EXPECT_EQ(arena.release_free_slabs(), MiB);
  EXPECT_EQ(arena.stats().reserved_bytes, 0u);
}

TEST(HostArena, ExhaustionAtMaxBytesIsOutOfMemory) {
  HostArena arena(small(MiB, 2 * MiB));
  void* a = arena.allocate(MiB);
  void* b = arena.allocate(MiB);
  std::string msg;
  try {
    arena.allocate(KiB);
    ADD_FAILURE() << "allocation past host_max_bytes succeeded";
  } catch (const OutOfMemory& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("host_max_bytes is 2.00 MiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("reserved 2.00 MiB"), std::string::npos) << msg;
  arena.deallocate(a);
  void* c = arena.allocate(KiB);  // freed memory is reused under the cap
  EXPECT_EQ(c, a);
  arena.deallocate(b);
  arena.deallocate(c);
}

TEST(HostArena, NearTheCapASmallerSlabHoldsJustTheRequest) {
  HostArena arena(small(MiB, MiB + 256 * KiB));
  void* a = arena.allocate(MiB);
  void* b = arena.allocate(200 * KiB);  // a full 1 MiB slab would pass the cap
  const HostArenaStats s = arena.stats();
  EXPECT_EQ(s.slabs, 2u);
  EXPECT_LE(s.reserved_bytes, MiB + 256 * KiB);
  EXPECT_THROW(arena.allocate(200 * KiB), OutOfMemory);
  arena.deallocate(a);
  arena.deallocate(b);
}

TEST(HostArena, NonexistentNodesAreRejectedWithTheValidOnes) {
  for (int node : {7, 4096}) {
    if (node_exists(node)) continue;  // a machine that really has it
    HostArenaConfig c = small();
    c.numa_node = node;
    std::string msg;
    try {
      HostArena arena(c);
      ADD_FAILURE() << "node " << node << " accepted";
    } catch (const InvalidArgument& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("NUMA node " + std::to_string(node)), std::string::npos) << msg;
    EXPECT_NE(msg.find("valid nodes: " + std::to_string(HostArena::valid_numa_nodes().front())), std::string::npos) << msg;
  }
  HostArenaConfig c = small();
  c.numa_node = -2;
  EXPECT_THROW(HostArena{c}, InvalidArgument);
}

TEST(HostArena, ZeroOverflowingAndAbsurdSizes) {
  HostArena arena(small());
  EXPECT_THROW(arena.allocate(0), InvalidArgument);
  const std::string overflow = error_of([&] { arena.allocate(std::numeric_limits<std::size_t>::max()); });
  EXPECT_NE(overflow.find("overflow"), std::string::npos) << overflow;
  EXPECT_THROW(arena.allocate(std::numeric_limits<std::size_t>::max() - 100), InvalidArgument);
  std::string msg;
  try {
    arena.allocate(std::size_t{1} << 50);
    ADD_FAILURE() << "1 PiB allocated";
  } catch (const OutOfMemory& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("physical memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find(format_bytes(std::uint64_t{1} << 50)), std::string::npos) << msg;
  EXPECT_EQ(arena.stats().reserved_bytes, 0u);  // nothing was mapped on the way

  HostArenaConfig c = small();
  c.slab_bytes = 0;
  EXPECT_THROW(HostArena{c}, InvalidArgument);
}

TEST(HostArena, MoreThanIsAvailableFailsBeforeMapping) {
  // Pinned pages cannot be swapped, so a slab larger than the available memory must fail
  // cleanly rather than wake the OOM killer.
  const auto phys = static_cast<std::size_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  HostArena unbound(small());
  const std::string msg = error_of([&] { unbound.allocate(phys - 2 * MiB); });
  EXPECT_NE(msg.find("available"), std::string::npos) << msg;
  if (!HostArena::numa_supported()) return;
  HostArenaConfig c = small();
  c.numa_node = HostArena::valid_numa_nodes().front();
  HostArena strict(c);
  std::string strict_msg;
  try {
    strict.allocate(phys - 2 * MiB);
  } catch (const OutOfMemory& e) {
    strict_msg = e.what();
  }
  EXPECT_NE(strict_msg.find("NUMA node " + std::to_string(c.numa_node) + " has"), std::string::npos) << strict_msg;
  EXPECT_NE(strict_msg.find("strict"), std::string::npos) << strict_msg;
  c.on_node_full = NodeFullPolicy::fallback;
  HostArena fallback(c);
  // One node: there is nowhere to fall back to, and the message says so.
  const std::string fb = error_of([&] { fallback.allocate(phys - 2 * MiB); });
  EXPECT_NE(fb.find("the machine has only"), std::string::npos) << fb;
  EXPECT_EQ(fallback.stats().reserved_bytes, 0u);
}

TEST(HostArena, PlacementOnNodeZero) {
  if (!HostArena::numa_supported()) GTEST_SKIP() << "no libnuma or no NUMA in this kernel: placement is unknown";
  HostArenaConfig c = small(4 * MiB);
  c.numa_node = 0;
  HostArena arena(c);
  void* p = arena.allocate(3 * MiB);
  const PlacementReport r = arena.verify_placement(p, 3 * MiB);
  ASSERT_TRUE(r.known) << r.reason;
  EXPECT_EQ(r.wanted_node, 0);
  EXPECT_EQ(r.pages_sampled, 64u);
  EXPECT_EQ(r.pages_not_present, 0u);
  EXPECT_TRUE(r.on_wanted_node()) << r.describe();
  EXPECT_NE(r.describe().find("all on node 0"), std::string::npos) << r.describe();
  const HostArenaStats s = arena.stats();
  ASSERT_EQ(s.bytes_per_node.count(0), 1u);
  EXPECT_EQ(s.bytes_per_node.at(0), s.reserved_bytes);
  EXPECT_EQ(arena.slabs().front().numa_node, 0);
  arena.deallocate(p);

  // The check can fail: pages never touched are not present.
  const std::size_t len = 64 * KiB;
  void* raw = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  const PlacementReport untouched = arena.verify_placement(raw, len);
  EXPECT_TRUE(untouched.known);
  EXPECT_EQ(untouched.pages_not_present, untouched.pages_sampled);
  EXPECT_FALSE(untouched.on_wanted_node());
  munmap(raw, len);
  EXPECT_THROW((void)arena.verify_placement(nullptr, 10), InvalidArgument);
}

TEST(HostArena, ParallelFirstTouchFaultsInEveryPage) {
  if (!HostArena::numa_supported()) GTEST_SKIP() << "no libnuma: page presence cannot be asked";
  ThreadPool pool(2);
  HostArenaConfig c = small(4 * MiB);
  c.toucher = &pool;
  HostArena arena(c);
  void* p = arena.allocate(4 * MiB);
  const PlacementReport r = arena.verify_placement(p, 4 * MiB, 1 << 20);  // every page
  ASSERT_TRUE(r.known) << r.reason;
  EXPECT_EQ(r.pages_sampled, 4 * MiB / static_cast<std::size_t>(sysconf(_SC_PAGESIZE)));
  EXPECT_EQ(r.pages_not_present, 0u);
  EXPECT_TRUE(r.on_wanted_node()) << r.describe();  // unbound: any node, but all present
  EXPECT_GT(arena.stats().touch_seconds, 0.0);
  arena.deallocate(p);
}

TEST(HostArena, ForeignAndDoubleFreesAreInvalid) {
  HostArena arena(small());
  int local = 0;
  const std::string msg = error_of([&] { arena.deallocate(&local); });
  EXPECT_NE(msg.find("not a live buffer"), std::string::npos) << msg;
  void* p = arena.allocate(512);
  void* q = arena.allocate(512);
  EXPECT_THROW(arena.deallocate(static_cast<char*>(p) + 256), InvalidArgument);  // inside, not the start
  arena.deallocate(p);
  EXPECT_THROW(arena.deallocate(p), InvalidArgument);
  arena.deallocate(q);
  EXPECT_EQ(arena.stats().allocations, 0u);
}

TEST(HostArena, WholeSlabsThroughSlabSource) {
  HostArena arena(small(MiB));
  SlabSource& source = arena;
  const HostSlab s = source.map_slab(3 * MiB + 1, 2 * MiB);
  EXPECT_EQ(addr(s.ptr) % (2 * MiB), 0u);
  EXPECT_EQ(s.bytes, 4 * MiB);
  EXPECT_FALSE(s.registered);
  std::memset(s.ptr, 7, s.bytes);
  HostArenaStats st = arena.stats();
  EXPECT_EQ(st.whole_slabs, 1u);
  EXPECT_EQ(st.reserved_bytes, 4 * MiB);
  // Sub-allocation never hands out memory of a whole slab.
  void* p = arena.allocate(64 * KiB);
  EXPECT_TRUE(addr(p) < addr(s.ptr) || addr(p) >= addr(s.ptr) + s.bytes);
  EXPECT_EQ(arena.allocation_size(s.ptr), 0u);
  EXPECT_THROW(arena.deallocate(s.ptr), InvalidArgument);
  EXPECT_EQ(arena.release_free_slabs(), 0u);  // the whole slab is not the arena's to release
  arena.deallocate(p);
  EXPECT_THROW(source.unmap_slab(HostSlab{p, MiB, -1, false}), InvalidArgument);
  EXPECT_THROW(source.unmap_slab(HostSlab{s.ptr, s.bytes - 4096, -1, false}), InvalidArgument);
  source.unmap_slab(s);
  st = arena.stats();
  EXPECT_EQ(st.whole_slabs, 0u);
  EXPECT_EQ(st.reserved_bytes, MiB);
  EXPECT_THROW(source.map_slab(0, 4096), InvalidArgument);
  EXPECT_THROW(source.map_slab(MiB, 3000), InvalidArgument);
  EXPECT_THROW(source.map_slab(std::numeric_limits<std::size_t>::max() - 10, 4096), InvalidArgument);
}

TEST(HostArena, ManyThreadsAllocateAndFree) {
  HostArena arena(small(MiB));
  constexpr int kThreads = 4;
  constexpr int kOps = 3000;
  std::vector<std::thread> threads;
  std::vector<int> errors(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t) * 7919u + 1u);
      std::vector<std::pair<unsigned char*, std::size_t>> live;
      for (int i = 0; i < kOps; ++i) {
        if (live.empty() || (rng() % 3 != 0 && live.size() < 40)) {
          const std::size_t bytes = 1 + rng() % (48 * KiB);
          auto* p = static_cast<unsigned char*>(arena.allocate(bytes));
          std::memset(p, t + 1, bytes);
          live.emplace_back(p, bytes);
        } else {
          const std::size_t k = rng() % live.size();
          auto [p, bytes] = live[k];
          // Another thread's buffer overlapping this one would have overwritten the pattern.
          if (p[0] != t + 1 || p[bytes - 1] != t + 1) ++errors[static_cast<std::size_t>(t)];
          arena.deallocate(p);
          live[k] = live.back();
          live.pop_back();
        }
      }
      for (auto [p, bytes] : live) arena.deallocate(p);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[static_cast<std::size_t>(t)], 0) << "thread " << t;
  const HostArenaStats s = arena.stats();
  EXPECT_EQ(s.allocations, 0u);
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_GE(s.slabs, 1u);
  // Every block coalesced back: each slab is one free block again, so all of them go.
  EXPECT_EQ(arena.release_free_slabs(), s.reserved_bytes);
  EXPECT_EQ(arena.stats().reserved_bytes, 0u);
}

// ---- with a Device ----------------------------------------------------------------------------

template <typename B>
class HostArenaDeviceTest : public WithDevice<B> {};
TYPED_TEST_SUITE(HostArenaDeviceTest, memtide::test::DeviceBackends, memtide::test::BackendNames);

TYPED_TEST(HostArenaDeviceTest, EachSlabIsRegisteredOnceAndUnregisteredOnRelease) {
  HostArenaConfig c = small(MiB);
  c.device = &this->device();
  {
    HostArena arena(c);
    void* a = arena.allocate(768 * KiB);
    void* d = arena.allocate(KiB);  // from the first slab's rest: no new registration
    void* b = arena.allocate(768 * KiB);
    const std::vector<HostSlab> slabs = arena.slabs();
    ASSERT_EQ(slabs.size(), 2u);
    for (const HostSlab& s : slabs) EXPECT_TRUE(s.registered);
    const HostArenaStats st = arena.stats();
    EXPECT_EQ(st.registered_slabs, 2u);
    EXPECT_GE(st.register_seconds, 0.0);
    if (SimDevice* sim = this->sim()) {
      const auto ranges = sim->registered_host_ranges();
      ASSERT_EQ(ranges.size(), 2u);
      for (const HostSlab& s : slabs) {
        ASSERT_EQ(ranges.count(addr(s.ptr)), 1u);
        EXPECT_EQ(ranges.at(addr(s.ptr)), s.bytes);
      }
    }
    arena.deallocate(b);
    EXPECT_EQ(arena.release_free_slabs(), MiB);
    if (SimDevice* sim = this->sim()) {
      EXPECT_EQ(sim->registered_host_ranges().size(), 1u);
    }
    // A whole slab is registered too.
    SlabSource& source = arena;
    const HostSlab w = source.map_slab(2 * MiB, 4096);
    EXPECT_TRUE(w.registered);
    if (SimDevice* sim = this->sim()) {
      EXPECT_EQ(sim->registered_host_ranges().count(addr(w.ptr)), 1u);
    }
    source.unmap_slab(w);
    if (SimDevice* sim = this->sim()) {
      EXPECT_EQ(sim->registered_host_ranges().count(addr(w.ptr)), 0u);
    }
    arena.deallocate(a);
    arena.deallocate(d);
  }
  // The destructor unregistered the last slab.
  if (SimDevice* sim = this->sim()) {
    EXPECT_TRUE(sim->registered_host_ranges().empty());
  }
}

TYPED_TEST(HostArenaDeviceTest, RegisteredBuffersCopyToTheDevice) {
  HostArenaConfig c = small(MiB);
  c.device = &this->device();
  HostArena arena(c);
  auto* src = static_cast<unsigned char*>(arena.allocate(64 * KiB));
  auto* dst = static_cast<unsigned char*>(arena.allocate(64 * KiB));
  for (std::size_t i = 0; i < 64 * KiB; ++i) src[i] = static_cast<unsigned char>(i * 31);
  void* dev = this->device().allocate(64 * KiB);
  this->device().copy_async(dev, src, 64 * KiB, CopyKind::host_to_device, Stream{});
  this->device().copy_async(dst, dev, 64 * KiB, CopyKind::device_to_host, Stream{});
  this->device().synchronize();
  EXPECT_EQ(std::memcmp(src, dst, 64 * KiB), 0);
  this->device().deallocate(dev, 64 * KiB);
  arena.deallocate(src);
  arena.deallocate(dst);
}
