// The memory resource contract, written once and run over every resource memtide has: the
// DeviceMemoryResources (DirectResource, CachingAllocator plain and with expandable segments) on
// the simulated device, and the host resources (PinnedHeap over jemalloc and mimalloc, HostArena).
//
// Where resources legitimately differ, each says so in its Traits and the suite checks the
// behaviour the trait promises, never nothing: host resources have no streams (the stream-ordered
// cases run in a second suite over only the stream-ordered resources), DirectResource keeps no
// statistics of its own (its device's bytes in use are counted instead) and frees synchronously,
// the device resources return null for zero bytes where the host ones throw.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "device_types.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/allocator/memory_resource.hpp"
#include "memtide/allocator/mmap_slab_source.hpp"
#include "memtide/allocator/pinned_heap.hpp"
#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"
#include "static_tls.hpp"

namespace memtide {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
bool aligned(const void* p, std::size_t to) { return reinterpret_cast<std::uintptr_t>(p) % to == 0; }

/// What a zero-byte request gives.
enum class ZeroSize {
  null_pointer,      ///< null, and deallocate(null) does nothing (DeviceMemoryResource)
  invalid_argument,  ///< InvalidArgument (the host resources: a zero-byte buffer is a caller's bug)
};

/// How a resource differs from the others, stated once per resource and checked by the suite.
struct Traits {
  /// allocate/deallocate take a stream and follow stream order (the StreamOrderedContract suite).
  bool stream_ordered = false;
  /// A block freed on a stream is handed out again at once on that stream, while another stream
  /// gets other memory (a caching stream-ordered resource). False: a free returns the memory to
  /// the device at once, after the device's queued work (cudaFree's semantics).
  bool caches_per_stream = false;
  ZeroSize zero_size = ZeroSize::null_pointer;
  /// Every pointer is aligned to at least this.
  std::size_t alignment = 1;
  /// Two instances over the same underlying memory serve each other's pointers (RMM's is_equal):
  /// true only where the resource holds no state of its own.
  bool interchangeable = false;
};

/// What a resource counts of itself. `allocations` and `peak_bytes` are unset where the resource
/// does not count them (trait-free: a counter the resource lacks is simply not compared).
struct Counters {
  std::optional<std::uint64_t> allocations;
  std::uint64_t bytes = 0;  ///< live bytes as the resource accounts them (see accounted())
  std::optional<std::uint64_t> peak_bytes;
};

// ---- the resources -----------------------------------------------------------------------------
// Each one: `traits`, a name, allocate/deallocate over a (possibly ignored) stream, counters(),
// accounted(bytes) (what one live allocation of `bytes` adds to Counters::bytes), writable()
// (its memory may be dereferenced on the host), make_peer() (a second instance over the same
// memory: the same device, or slabs of the same kind), and device() (null for a resource with no
// device).

class DeviceResourceBase {
 public:
  /// Over `device`, or a fresh simulated one.
  explicit DeviceResourceBase(std::shared_ptr<Device> device)
      : device_(device ? std::move(device) : std::shared_ptr<Device>(test::SimBackend::make())) {}
  Device* device() { return device_.get(); }
  SimDevice& sim() { return static_cast<SimDevice&>(*device_); }
  bool writable() { return device_->properties().host_addressable; }

 protected:
  std::shared_ptr<Device> device_;
};

/// DirectResource: no state of its own, so its device's bytes in use are its counters.
class Direct : public DeviceResourceBase {
 public:
  static constexpr Traits traits{.stream_ordered = true,
                                 .caches_per_stream = false,
                                 .zero_size = ZeroSize::null_pointer,
                                 .alignment = 256,  // cudaMalloc's guarantee, which SimDevice keeps
                                 .interchangeable = true};
  static constexpr const char* name = "Direct";
  static std::string unavailable() { return ""; }

  explicit Direct(std::shared_ptr<Device> device = nullptr)
      : DeviceResourceBase(std::move(device)), resource_(std::make_unique<DirectResource>(*device_)),
        base_(sim().used_bytes()) {}
  void* allocate(std::size_t bytes, Stream s) { return resource_->allocate(bytes, s); }
  void deallocate(void* p, std::size_t /*bytes*/, Stream s) { resource_->deallocate(p, s); }
  Counters counters() { return Counters{std::nullopt, sim().used_bytes() - base_, std::nullopt}; }
  static std::size_t accounted(std::size_t bytes) { return round_up(bytes, 256); }
  std::unique_ptr<Direct> make_peer() { return std::make_unique<Direct>(device_); }

 private:
  std::unique_ptr<DirectResource> resource_;
  std::size_t base_;
};

template <bool Expandable>
class Caching : public DeviceResourceBase {
 public:
  static constexpr Traits traits{.stream_ordered = true,
                                 .caches_per_stream = true,
                                 .zero_size = ZeroSize::null_pointer,
                                 // Blocks are 512-byte multiples (PyTorch's rounding) cut from the
                                 // segment's base, which has the device's 256 (cudaMalloc's
                                 // guarantee; glibc 2.39's aligned_alloc gave SimDevice exactly that).
                                 .alignment = 256,
                                 .interchangeable = false};
  static constexpr const char* name = Expandable ? "CachingExpandable" : "Caching";
  static std::string unavailable() {
    if (!Expandable) return "";
    return test::SimBackend::make()->vmm_granularity() == 0 ? "the simulated device has no virtual memory" : "";
  }

  explicit Caching(std::shared_ptr<Device> device = nullptr) : DeviceResourceBase(std::move(device)) {
    AllocatorConfig c;
    c.max_bytes = 256 * MiB;
    c.headroom_margin = 0;
    c.expandable_segments = Expandable;
    resource_ = std::make_unique<CachingAllocator>(*device_, c);
  }
  void* allocate(std::size_t bytes, Stream s) { return resource_->allocate(bytes, s); }
  void deallocate(void* p, std::size_t /*bytes*/, Stream s) { resource_->deallocate(p, s); }
  Counters counters() {
    const AllocatorStats st = resource_->stats();
    const int all = static_cast<int>(StatType::all);
    return Counters{static_cast<std::uint64_t>(st.allocation[all].current),
                    static_cast<std::uint64_t>(st.requested_bytes[all].current),
                    static_cast<std::uint64_t>(st.requested_bytes[all].peak)};
  }
  static std::size_t accounted(std::size_t bytes) { return bytes; }
  std::unique_ptr<Caching> make_peer() { return std::make_unique<Caching>(device_); }

 private:
  std::unique_ptr<CachingAllocator> resource_;
};

// mimalloc keeps referring to its arenas after a heap is gone, so its slabs come from a source
// that lives as long as the process (PinnedHeap's contract).
MmapSlabSource& process_source() {
  static auto* source = new MmapSlabSource();
  return *source;
}

template <PinnedHeapBackend Backend>
class Pinned {
 public:
  static constexpr Traits traits{.stream_ordered = false,
                                 .caches_per_stream = false,
                                 .zero_size = ZeroSize::invalid_argument,
                                 .alignment = 64,  // allocate()'s default alignment
                                 .interchangeable = false};
  static constexpr const char* name = Backend == PinnedHeapBackend::jemalloc ? "PinnedHeapJemalloc" : "PinnedHeapMimalloc";
  static std::string unavailable() {
    std::string why;
    return pinned_heap_backend_available(Backend, &why) ? "" : why;
  }

  Pinned() {
    PinnedHeapConfig c;
    c.backend = Backend;
    c.slab_bytes = 64 * MiB;
    c.direct_threshold = MiB;
    if (Backend == PinnedHeapBackend::jemalloc) own_source_ = std::make_unique<MmapSlabSource>();
    heap_ = std::make_unique<PinnedHeap>(own_source_ ? *own_source_ : process_source(), c);
  }
  void* allocate(std::size_t bytes, Stream /*s*/) { return heap_->allocate(bytes); }
  void deallocate(void* p, std::size_t bytes, Stream /*s*/) { heap_->deallocate(p, bytes); }
  Counters counters() {
    const PinnedHeapStats st = heap_->stats();
    return Counters{st.allocations_live, st.requested_live, st.requested_peak};
  }
  static std::size_t accounted(std::size_t bytes) { return bytes; }
  static bool writable() { return true; }
  static Device* device() { return nullptr; }
  std::unique_ptr<Pinned> make_peer() { return std::make_unique<Pinned>(); }

 private:
  std::unique_ptr<MmapSlabSource> own_source_;  // outlives heap_ (declared first)
  std::unique_ptr<PinnedHeap> heap_;
};

/// HostArena, its slabs registered with the simulated device as the Runtime's are with the GPU.
class Arena : public DeviceResourceBase {
 public:
  static constexpr Traits traits{.stream_ordered = false,
                                 .caches_per_stream = false,
                                 .zero_size = ZeroSize::invalid_argument,
                                 .alignment = 256,  // HostArenaConfig's default
                                 .interchangeable = false};
  static constexpr const char* name = "HostArena";
  static std::string unavailable() { return ""; }

  explicit Arena(std::shared_ptr<Device> device = nullptr) : DeviceResourceBase(std::move(device)) {
    HostArenaConfig c;
    c.slab_bytes = 16 * MiB;
    c.max_bytes = 256 * MiB;
    c.device = device_.get();
    arena_ = std::make_unique<HostArena>(c);
  }
  void* allocate(std::size_t bytes, Stream /*s*/) { return arena_->allocate(bytes); }
  void deallocate(void* p, std::size_t /*bytes*/, Stream /*s*/) { arena_->deallocate(p); }
  Counters counters() {
    const HostArenaStats st = arena_->stats();
    return Counters{st.allocations, st.allocated_bytes, st.peak_allocated_bytes};
  }
  static std::size_t accounted(std::size_t bytes) { return round_up(bytes, 256); }
  static bool writable() { return true; }
  std::unique_ptr<Arena> make_peer() { return std::make_unique<Arena>(device_); }

 private:
  std::unique_ptr<HostArena> arena_;
};

using AllResources = ::testing::Types<Direct, Caching<false>, Caching<true>, Pinned<PinnedHeapBackend::jemalloc>,
                                      Pinned<PinnedHeapBackend::mimalloc>, Arena>;

// The stream-ordered ones, chosen by their trait rather than listed again.
template <class Out, class... In>
struct StreamOrderedOf;
template <class... Out>
struct StreamOrderedOf<::testing::Types<Out...>> {
  using type = ::testing::Types<Out...>;
};
template <class... Out, class Head, class... Tail>
struct StreamOrderedOf<::testing::Types<Out...>, Head, Tail...> {
  using type = typename StreamOrderedOf<
      std::conditional_t<Head::traits.stream_ordered, ::testing::Types<Out..., Head>, ::testing::Types<Out...>>,
      Tail...>::type;
};
using StreamOrderedResources = StreamOrderedOf<::testing::Types<>, Direct, Caching<false>, Caching<true>,
                                               Pinned<PinnedHeapBackend::jemalloc>,
                                               Pinned<PinnedHeapBackend::mimalloc>, Arena>::type;

struct ResourceNames {
  template <typename R>
  static std::string GetName(int) {
    return R::name;
  }
};

// ---- the suite ---------------------------------------------------------------------------------

template <typename R>
class ResourceContract : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = R::unavailable(); !why.empty()) GTEST_SKIP() << R::name << ": " << why;
    r_ = std::make_unique<R>();
    if (Device* d = r_->device(); d != nullptr && R::traits.stream_ordered) {
      s_ = d->create_stream();
      t_ = d->create_stream();
    }
  }
  void TearDown() override {
    if (!r_) return;
    if (Device* d = r_->device(); d != nullptr) {
      d->destroy_stream(s_);
      d->destroy_stream(t_);
    }
  }
  R& r() { return *r_; }
  void expect_counters(const Counters& c, std::uint64_t allocations, std::uint64_t bytes, const std::string& where) {
    if (c.allocations) { EXPECT_EQ(*c.allocations, allocations) << where; }
    EXPECT_EQ(c.bytes, bytes) << where;
  }

  std::unique_ptr<R> r_;
  Stream s_{};
  Stream t_{};
};
TYPED_TEST_SUITE(ResourceContract, AllResources, ResourceNames);

// Every allocation is usable as a whole and overlaps no other: each is filled with its own byte
// and all are checked only once every one is live.
TYPED_TEST(ResourceContract, AllocateDeallocateRoundTrip) {
  const std::vector<std::size_t> sizes = {1, 100, 512, 4 * KiB + 1, 64 * KiB, MiB + 3, 3 * MiB, 25 * MiB};
  std::vector<void*> live;
  for (std::size_t b : sizes) {
    void* p = this->r().allocate(b, this->s_);
    ASSERT_NE(p, nullptr) << b << " bytes";
    live.push_back(p);
  }
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto a = reinterpret_cast<std::uintptr_t>(live[i]);
    ranges.emplace_back(a, a + sizes[i]);
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "overlap";
  if (this->r().writable()) {
    for (std::size_t i = 0; i < sizes.size(); ++i) std::memset(live[i], static_cast<int>(i + 1), sizes[i]);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto* p = static_cast<const unsigned char*>(live[i]);
      EXPECT_EQ(p[0], i + 1) << sizes[i] << " bytes";
      EXPECT_EQ(p[sizes[i] - 1], i + 1) << sizes[i] << " bytes";
    }
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) this->r().deallocate(live[i], sizes[i], this->s_);
  this->expect_counters(this->r().counters(), 0, 0, "after every free");
}

TYPED_TEST(ResourceContract, PointersAreAlignedAsPromised) {
  const std::size_t align = TypeParam::traits.alignment;
  std::vector<std::pair<void*, std::size_t>> live;
  // Odd sizes, so that a resource packing blocks back to back would show it.
  for (std::size_t b : {std::size_t{1}, std::size_t{3}, std::size_t{77}, std::size_t{513}, 4 * KiB - 1,
                        100 * KiB + 7, 2 * MiB + 1}) {
    for (int k = 0; k < 3; ++k) {
      void* p = this->r().allocate(b, this->s_);
      EXPECT_TRUE(aligned(p, align)) << p << " (" << b << " bytes) is not " << align << "-byte aligned";
      live.emplace_back(p, b);
    }
  }
  for (auto [p, b] : live) this->r().deallocate(p, b, this->s_);
}

TYPED_TEST(ResourceContract, ZeroBytesAsTheTraitSays) {
  const Counters before = this->r().counters();
  if constexpr (TypeParam::traits.zero_size == ZeroSize::null_pointer) {
    EXPECT_EQ(this->r().allocate(0, this->s_), nullptr);
    EXPECT_NO_THROW(this->r().deallocate(nullptr, 0, this->s_));
  } else {
    EXPECT_THROW((void)this->r().allocate(0, this->s_), InvalidArgument);
  }
  this->expect_counters(this->r().counters(), before.allocations.value_or(0), before.bytes, "after zero bytes");
}

// The counters follow a random sequence of allocations and frees exactly, and the peak is the
// highest live total seen.
TYPED_TEST(ResourceContract, CountersFollowEveryAllocationAndFree) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> coin(0, 2);
  std::uniform_int_distribution<std::size_t> small(1, 16 * KiB);
  std::uniform_int_distribution<std::size_t> large(16 * KiB, 4 * MiB);
  std::vector<std::pair<void*, std::size_t>> live;
  std::uint64_t bytes = 0, peak = 0;
  for (int op = 0; op < 300; ++op) {
    if (!live.empty() && coin(rng) == 0) {
      const std::size_t i = std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng);
      this->r().deallocate(live[i].first, live[i].second, this->s_);
      bytes -= TypeParam::accounted(live[i].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      const std::size_t b = coin(rng) == 0 ? large(rng) : small(rng);
      live.emplace_back(this->r().allocate(b, this->s_), b);
      bytes += TypeParam::accounted(b);
      peak = std::max(peak, bytes);
    }
    const Counters c = this->r().counters();
    this->expect_counters(c, live.size(), bytes, "after operation " + std::to_string(op));
    if (c.peak_bytes) { EXPECT_EQ(*c.peak_bytes, peak) << "after operation " << op; }
    if (::testing::Test::HasFailure()) break;
  }
  for (auto [p, b] : live) this->r().deallocate(p, b, this->s_);
  const Counters end = this->r().counters();
  this->expect_counters(end, 0, 0, "after every free");
  if (end.peak_bytes) { EXPECT_EQ(*end.peak_bytes, peak); }
}

// Sizes no machine has, or that overflow any rounding, fail with the project's error types and
// leave the resource as it was and still serving.
TYPED_TEST(ResourceContract, AbsurdSizesThrowAndChangeNothing) {
  const Counters before = this->r().counters();
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  for (std::size_t b : {std::size_t{1} << 50, std::size_t{1} << 62, kMax - 100, kMax}) {
    void* p = nullptr;
    try {
      p = this->r().allocate(b, this->s_);
      ADD_FAILURE() << b << " bytes were allocated at " << p;
    } catch (const OutOfMemory&) {
    } catch (const InvalidArgument&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << b << " bytes: " << typeid(e).name() << ": " << e.what() << " (not OutOfMemory or InvalidArgument)";
    }
    if (p != nullptr) this->r().deallocate(p, b, this->s_);
    this->expect_counters(this->r().counters(), before.allocations.value_or(0), before.bytes,
                          "after " + std::to_string(b) + " bytes");
  }
  void* p = this->r().allocate(4 * KiB, this->s_);
  EXPECT_NE(p, nullptr);
  this->r().deallocate(p, 4 * KiB, this->s_);
}

// A pointer the resource never gave out, or gave out and took back, is refused with
// InvalidArgument, and nothing is counted.
TYPED_TEST(ResourceContract, ForeignAndDoubleFreesAreInvalidArguments) {
  void* p = this->r().allocate(4 * KiB, this->s_);
  const Counters live = this->r().counters();
  std::vector<unsigned char> elsewhere(4 * KiB);
  EXPECT_THROW(this->r().deallocate(elsewhere.data(), elsewhere.size(), this->s_), InvalidArgument);
  EXPECT_THROW(this->r().deallocate(static_cast<unsigned char*>(p) + 64, 64, this->s_), InvalidArgument);
  this->expect_counters(this->r().counters(), live.allocations.value_or(0), live.bytes, "after foreign frees");
  this->r().deallocate(p, 4 * KiB, this->s_);
  const Counters freed = this->r().counters();
  EXPECT_THROW(this->r().deallocate(p, 4 * KiB, this->s_), InvalidArgument);
  this->expect_counters(this->r().counters(), freed.allocations.value_or(0), freed.bytes, "after a double free");
}

// The interface has no is_equal: identity is whether a second instance over the same memory
// (the same device, the same kind of slabs) serves the first one's pointers. Only a resource
// without state of its own may.
TYPED_TEST(ResourceContract, ASecondInstanceServesPointersOnlyWhenInterchangeable) {
  auto peer = this->r().make_peer();
  void* p = this->r().allocate(64 * KiB, this->s_);
  const Counters live = this->r().counters();
  if constexpr (TypeParam::traits.interchangeable) {
    EXPECT_NO_THROW(peer->deallocate(p, 64 * KiB, this->s_));
    this->expect_counters(this->r().counters(), 0, live.bytes - TypeParam::accounted(64 * KiB), "freed by the peer");
  } else {
    EXPECT_THROW(peer->deallocate(p, 64 * KiB, this->s_), InvalidArgument);
    this->expect_counters(this->r().counters(), live.allocations.value_or(0), live.bytes, "refused by the peer");
    this->r().deallocate(p, 64 * KiB, this->s_);
  }
}

// ---- stream order ------------------------------------------------------------------------------

template <typename R>
class StreamOrderedContract : public ResourceContract<R> {
 protected:
  // Work queued on `stream` that is still running when this returns (on the simulated device's
  // clock), touching `p`: what a real training step leaves behind a free.
  void keep_busy(void* p, std::size_t bytes, Stream stream) {
    Device& d = *this->r().device();
    for (int i = 0; i < 8; ++i) d.memset_async(p, i, bytes, stream);
  }
};
TYPED_TEST_SUITE(StreamOrderedContract, StreamOrderedResources, ResourceNames);

// Freed on its stream, a block may serve that stream's next request at once: stream order alone
// keeps the old work before the new.
TYPED_TEST(StreamOrderedContract, AFreedBlockServesItsOwnStreamAtOnce) {
  constexpr std::size_t kBytes = 3 * MiB;
  void* p = this->r().allocate(kBytes, this->s_);
  this->keep_busy(p, kBytes, this->s_);
  this->r().deallocate(p, kBytes, this->s_);
  void* q = this->r().allocate(kBytes, this->s_);
  ASSERT_NE(q, nullptr);
  if constexpr (TypeParam::traits.caches_per_stream) { EXPECT_EQ(q, p) << "the freed block was not reused"; }
  this->r().deallocate(q, kBytes, this->s_);
}

// Another stream never gets memory that queued work of the freeing stream may still touch: a
// caching resource gives it other memory; one that frees to the device waits for the queued
// work first (cudaFree), so the memory is idle by the time anyone can get it.
TYPED_TEST(StreamOrderedContract, AnotherStreamNeverGetsMemoryStillInUse) {
  constexpr std::size_t kBytes = 3 * MiB;
  Device& d = *this->r().device();
  void* p = this->r().allocate(kBytes, this->s_);
  this->keep_busy(p, kBytes, this->s_);
  const Event queued = d.create_event();
  d.record_event(queued, this->s_);
  ASSERT_FALSE(d.event_query(queued)) << "the work meant to keep the stream busy had already finished";
  this->r().deallocate(p, kBytes, this->s_);
  void* q = this->r().allocate(kBytes, this->t_);
  if constexpr (TypeParam::traits.caches_per_stream) {
    EXPECT_NE(q, p) << "handed to another stream while the freeing stream's work was queued";
  } else {
    EXPECT_TRUE(d.event_query(queued)) << "the memory went back to the device before its work was done";
  }
  this->r().deallocate(q, kBytes, this->t_);
  d.destroy_event(queued);
}

}  // namespace
}  // namespace memtide

int main(int argc, char** argv) {
  memtide::test::restart_with_static_tls_for_jemalloc(argv);  // else jemalloc's instantiation skips
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
