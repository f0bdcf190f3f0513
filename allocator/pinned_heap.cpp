#include "memtide/allocator/pinned_heap.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdio>
#include <mutex>
#include <unordered_map>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"
#include "pinned_heap_internal.hpp"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace memtide {
namespace detail {

namespace {
std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
}  // namespace

// ---- SlabPool -------------------------------------------------------------------------------

SlabPool::~SlabPool() {
  if (keep_) return;
  for (const HostSlab& s : slabs_) {
    try {
      source_.unmap_slab(s);
    } catch (const std::exception& e) {
      MEMTIDE_LOG(warn, std::string("PinnedHeap: unmapping a slab failed: ") + e.what());
    }
  }
}

HostSlab SlabPool::map(std::size_t bytes, std::size_t alignment) {
  HostSlab slab = source_.map_slab(bytes, alignment);
  std::lock_guard lock(mutex_);
  try {
    slabs_.push_back(slab);
  } catch (...) {
    source_.unmap_slab(slab);  // not kept: give it back
    throw;
  }
  reserved_ += slab.bytes;
  reserved_peak_ = std::max(reserved_peak_, reserved_);
  return slab;
}

void SlabPool::unmap(const HostSlab& slab) {
  {
    std::lock_guard lock(mutex_);
    auto it = std::find_if(slabs_.begin(), slabs_.end(), [&](const HostSlab& s) { return s.ptr == slab.ptr; });
    if (it == slabs_.end()) return;
    reserved_ -= it->bytes;
    slabs_.erase(it);
  }
  source_.unmap_slab(slab);
}

void SlabPool::keep_mapped() noexcept {
  std::lock_guard lock(mutex_);
  keep_ = true;
}

std::size_t SlabPool::reserved() const {
  std::lock_guard lock(mutex_);
  return reserved_;
}
std::size_t SlabPool::reserved_peak() const {
  std::lock_guard lock(mutex_);
  return reserved_peak_;
}
std::size_t SlabPool::count() const {
  std::lock_guard lock(mutex_);
  return slabs_.size();
}
std::vector<HostSlab> SlabPool::slabs() const {
  std::lock_guard lock(mutex_);
  return slabs_;
}

// ---- SlabRanges -----------------------------------------------------------------------------

SlabRanges::Spare SlabRanges::Spare::make() {
  Spare s;
  std::map<std::uintptr_t, Free> a;
  a.emplace(0, Free{0, 0});
  s.addr = a.extract(a.begin());
  std::set<std::pair<std::size_t, std::uintptr_t>> z;
  z.insert({0, 0});
  s.size = z.extract(z.begin());
  return s;
}

void SlabRanges::insert_free(std::uintptr_t start, std::size_t bytes, std::uintptr_t slab, Spare& spare) noexcept {
  spare.addr.key() = start;
  spare.addr.mapped() = Free{bytes, slab};
  by_addr_.insert(std::move(spare.addr));
  spare.size.value() = {bytes, start};
  by_size_.insert(std::move(spare.size));
}

void SlabRanges::erase_free(std::map<std::uintptr_t, Free>::iterator it) {
  by_size_.erase({it->second.bytes, it->first});
  by_addr_.erase(it);
}

std::uintptr_t SlabRanges::slab_of(std::uintptr_t a) const {
  auto it = slab_ends_.upper_bound(a);
  if (it == slab_ends_.begin()) return 0;
  --it;
  return a < it->second ? it->first : 0;
}

void* SlabRanges::take(std::size_t bytes, std::size_t alignment) {
  bytes = round_up(bytes, granule_);
  alignment = std::max(alignment, granule_);
  Spare before = Spare::make(), after = Spare::make();  // the padding and the rest
  std::lock_guard lock(mutex_);
  for (int attempt = 0; attempt < 2; ++attempt) {
    // Best fit: the smallest free range that holds `bytes` after aligning its start.
    for (auto it = by_size_.lower_bound({bytes, 0}); it != by_size_.end(); ++it) {
      const std::uintptr_t start = it->second;
      const std::uintptr_t aligned = (start + alignment - 1) & ~(std::uintptr_t{alignment} - 1);
      const std::size_t pad = aligned - start;
      if (pad + bytes > it->first) continue;
      auto node = by_addr_.find(start);
      const Free f = node->second;
      erase_free(node);
      if (pad > 0) insert_free(start, pad, f.slab, before);
      if (pad + bytes < f.bytes) insert_free(aligned + bytes, f.bytes - pad - bytes, f.slab, after);
      return reinterpret_cast<void*>(aligned);
    }
    if (attempt == 1) break;
    // Nothing fits: a new slab. Slabs start small and grow with what is reserved (never past
    // slab_bytes_), so a heap that stays small does not pin a full slab, and a large one is
    // made of few slabs; a request larger than that gets a slab of its own size.
    const std::size_t slab_align = std::max<std::size_t>(alignment, std::size_t{2} << 20);
    const std::size_t grown = std::min(slab_bytes_, std::max(kFirstSlab, pool_.reserved()));
    const std::size_t slab_bytes = std::max(grown, round_up(bytes, std::size_t{2} << 20));
    std::map<std::uintptr_t, std::uintptr_t> one;
    one.emplace(0, 0);
    auto end_node = one.extract(one.begin());
    Spare whole = Spare::make();
    const HostSlab slab = pool_.map(slab_bytes, slab_align);
    end_node.key() = addr(slab.ptr);
    end_node.mapped() = addr(slab.ptr) + slab.bytes;
    slab_ends_.insert(std::move(end_node));
    insert_free(addr(slab.ptr), slab.bytes / granule_ * granule_, addr(slab.ptr), whole);
  }
  throw OutOfMemory("PinnedHeap: a fresh slab could not hold " + format_bytes(bytes) + " aligned to " +
                    format_bytes(alignment));
}

bool SlabRanges::take_at(void* p, std::size_t bytes) {
  const std::uintptr_t a = addr(p);
  Spare before = Spare::make(), after = Spare::make();
  std::lock_guard lock(mutex_);
  auto it = by_addr_.upper_bound(a);
  if (it == by_addr_.begin()) return false;
  --it;
  const std::uintptr_t start = it->first;
  const Free f = it->second;
  if (a + bytes > start + f.bytes) return false;
  erase_free(it);
  if (a > start) insert_free(start, a - start, f.slab, before);
  if (a + bytes < start + f.bytes) insert_free(a + bytes, start + f.bytes - a - bytes, f.slab, after);
  return true;
}

void SlabRanges::give(void* p, std::size_t bytes, Spare spare) noexcept {
  std::uintptr_t start = addr(p);
  bytes = round_up(bytes, granule_);
  std::lock_guard lock(mutex_);
  const std::uintptr_t slab = slab_of(start);
  // Coalesce with the free neighbours in the same slab.
  auto next = by_addr_.lower_bound(start);
  if (next != by_addr_.end() && next->first == start + bytes && next->second.slab == slab) {
    bytes += next->second.bytes;
    erase_free(next);
  }
  auto prev = by_addr_.lower_bound(start);
  if (prev != by_addr_.begin()) {
    --prev;
    if (prev->first + prev->second.bytes == start && prev->second.slab == slab) {
      start = prev->first;
      bytes += prev->second.bytes;
      erase_free(prev);
    }
  }
  insert_free(start, bytes, slab, spare);
}

bool SlabRanges::same_slab(const void* a, const void* b) const {
  std::lock_guard lock(mutex_);
  const std::uintptr_t s = slab_of(addr(a));
  return s != 0 && s == slab_of(addr(b));
}

}  // namespace detail

// ---- PinnedHeap -----------------------------------------------------------------------------

PinnedHeapBackend parse_pinned_heap_backend(const std::string& name) {
  if (name == "auto") return PinnedHeapBackend::automatic;
  if (name == "jemalloc") return PinnedHeapBackend::jemalloc;
  if (name == "mimalloc") return PinnedHeapBackend::mimalloc;
  throw ConfigError("pinned heap backend \"" + name + "\" is not accepted: expected auto, jemalloc or mimalloc");
}

const char* to_string(PinnedHeapBackend backend) noexcept {
  switch (backend) {
    case PinnedHeapBackend::jemalloc: return "jemalloc";
    case PinnedHeapBackend::mimalloc: return "mimalloc";
    default: return "auto";
  }
}

bool pinned_heap_backend_available(PinnedHeapBackend backend, std::string* why) {
  switch (backend) {
    case PinnedHeapBackend::jemalloc: return detail::jemalloc_available(why);
    case PinnedHeapBackend::mimalloc: return detail::mimalloc_available(why);
    default: {
      std::string a, b;
      if (detail::jemalloc_available(&a) || detail::mimalloc_available(&b)) return true;
      if (why != nullptr) *why = a + "; " + b;
      return false;
    }
  }
}

PinnedHeapConfig PinnedHeapConfig::from_options() {
  const Options& o = options();
  PinnedHeapConfig c;
  c.backend = parse_pinned_heap_backend(o.pinned_heap_backend);
  c.slab_bytes = o.pinned_heap_slab_size;
  c.direct_threshold = o.pinned_heap_direct_threshold;
  return c;
}

class PinnedHeap::Impl {
 public:
  Impl(SlabSource& source, const PinnedHeapConfig& config)
      : pool_(source), direct_(pool_, config.slab_bytes, kPage), threshold_(config.direct_threshold) {
    if (config.slab_bytes < (std::size_t{2} << 20)) {
      throw ConfigError("PinnedHeap slab size " + std::to_string(config.slab_bytes) +
                        " is not accepted: expected at least 2 MiB");
    }
    backend_ = config.backend;
    if (backend_ == PinnedHeapBackend::automatic) {
      // jemalloc by measurement (bench/results/pinned-heap/); mimalloc when it cannot load.
      std::string why_je, why_mi;
      if (detail::jemalloc_available(&why_je)) {
        backend_ = PinnedHeapBackend::jemalloc;
      } else if (detail::mimalloc_available(&why_mi)) {
        MEMTIDE_LOG(warn, "PinnedHeap: jemalloc cannot be used (" + why_je + "); falling back to mimalloc");
        backend_ = PinnedHeapBackend::mimalloc;
      } else {
        throw Error("PinnedHeap: no backend can be used: jemalloc: " + why_je + "; mimalloc: " + why_mi);
      }
    }
    engine_ = backend_ == PinnedHeapBackend::jemalloc ? detail::make_jemalloc_engine(direct_)
                                                      : detail::make_mimalloc_engine(pool_, config.slab_bytes);
  }

  ~Impl() {
    engine_.reset();  // the engine's arena hands its extents back before the slabs go
  }

  void* allocate(std::size_t bytes, std::size_t alignment) {
    if (bytes == 0 || bytes > kMaxBytes) {
      throw InvalidArgument("PinnedHeap::allocate: bytes=" + std::to_string(bytes) +
                            " is not accepted: expected 1 byte to " + format_bytes(kMaxBytes));
    }
    if (alignment == 0 || !std::has_single_bit(alignment) || alignment > kMaxAlignment) {
      throw InvalidArgument("PinnedHeap::allocate: alignment=" + std::to_string(alignment) +
                            " is not accepted: expected a power of two up to 64 MiB");
    }
    // mimalloc 2.0 serves alignments only up to a few MiB; cut larger ones directly for both.
    const bool direct = alignment > kMaxBackendAlignment || (threshold_ != 0 && bytes >= threshold_);
    // The record's node, and what giving a direct range back needs, before anything is taken:
    // a failure after the backend handed out memory would otherwise lose it.
    LiveMap one;
    one.emplace(nullptr, Record{bytes, alignment, direct});
    LiveMap::node_type record = one.extract(one.begin());
    detail::SlabRanges::Spare spare;
    if (direct) spare = detail::SlabRanges::Spare::make();
    void* p = direct ? direct_.take(bytes, alignment) : engine_->allocate(bytes, alignment);
#if defined(__SANITIZE_THREAD__)
    // jemalloc and mimalloc order a free before the reuse of its bytes with atomics TSan does not
    // see (they are not instrumented), and a reused range need not start where the freed block
    // did; tell TSan what the allocator guarantees.
    __tsan_acquire(&tsan_sync_);
#endif
    // Recorded after the backend returned: a block freed by another thread was erased from its
    // shard before it was handed back, so a free and a reuse of the same address never overlap.
    Shard& s = shard(p);
    record.key() = p;
    try {
      std::lock_guard lock(s.mutex);
      s.live.insert(std::move(record));  // may rehash; on failure the map is unchanged
    } catch (...) {
      if (direct) direct_.give(p, bytes, std::move(spare));
      else engine_->deallocate(p, bytes, alignment);
      throw;
    }
    const std::size_t now = live_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    live_count_.fetch_add(1, std::memory_order_relaxed);
    std::size_t peak = peak_bytes_.load(std::memory_order_relaxed);
    while (now > peak && !peak_bytes_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    return p;
  }

  void deallocate(void* ptr, const std::size_t* expected) {
    Record r{};
    detail::SlabRanges::Spare spare;
    Shard& s = shard(ptr);
    {
      std::lock_guard lock(s.mutex);
      auto it = s.live.find(ptr);
      if (it == s.live.end()) {
        throw InvalidArgument("PinnedHeap::deallocate: " + detail_hex(ptr) +
                              " is not a live allocation of this heap (foreign or already freed)");
      }
      if (expected != nullptr && *expected != it->second.bytes) {
        throw InvalidArgument("PinnedHeap::deallocate: bytes=" + std::to_string(*expected) + " for " +
                              detail_hex(ptr) + " is not accepted: it was allocated with " +
                              std::to_string(it->second.bytes));
      }
      r = it->second;
      if (r.direct) spare = detail::SlabRanges::Spare::make();  // before anything changes
      s.live.erase(it);
    }
    live_bytes_.fetch_sub(r.bytes, std::memory_order_relaxed);
    live_count_.fetch_sub(1, std::memory_order_relaxed);
#if defined(__SANITIZE_THREAD__)
    __tsan_release(&tsan_sync_);
#endif
    if (r.direct) {
      direct_.give(ptr, r.bytes, std::move(spare));
    } else {
      engine_->deallocate(ptr, r.bytes, r.alignment);
    }
  }

  bool owns(const void* ptr) const {
    const Shard& s = shard(ptr);
    std::lock_guard lock(s.mutex);
    return s.live.count(const_cast<void*>(ptr)) != 0;
  }

  PinnedHeapStats stats() const {
    PinnedHeapStats st;
    st.requested_live = live_bytes_.load(std::memory_order_relaxed);
    st.requested_peak = peak_bytes_.load(std::memory_order_relaxed);
    st.allocations_live = live_count_.load(std::memory_order_relaxed);
    st.reserved = pool_.reserved();
    st.reserved_peak = pool_.reserved_peak();
    st.slab_count = pool_.count();
    return st;
  }

  PinnedHeapBackend backend() const noexcept { return backend_; }
  std::vector<HostSlab> slabs() const { return pool_.slabs(); }

 private:
  static constexpr std::size_t kPage = 4096;
  static constexpr std::size_t kMaxBytes = std::size_t{1} << 40;
  static constexpr std::size_t kMaxAlignment = std::size_t{64} << 20;
  static constexpr std::size_t kMaxBackendAlignment = std::size_t{1} << 20;
  static constexpr std::size_t kShards = 16;

  struct Record {
    std::size_t bytes;
    std::size_t alignment;
    bool direct;
  };
  using LiveMap = std::unordered_map<void*, Record>;
  struct Shard {
    mutable std::mutex mutex;
    LiveMap live;
  };
  static std::string detail_hex(const void* p) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", p);
    return buf;
  }
  Shard& shard(const void* p) { return shards_[(reinterpret_cast<std::uintptr_t>(p) >> 6) % kShards]; }
  const Shard& shard(const void* p) const { return shards_[(reinterpret_cast<std::uintptr_t>(p) >> 6) % kShards]; }

  detail::SlabPool pool_;
  detail::SlabRanges direct_;
  std::size_t threshold_;
  PinnedHeapBackend backend_ = PinnedHeapBackend::automatic;
  std::unique_ptr<detail::Engine> engine_;
  std::array<Shard, kShards> shards_;
  std::atomic<std::size_t> live_bytes_{0};
  std::atomic<std::size_t> peak_bytes_{0};
  std::atomic<std::size_t> live_count_{0};
#if defined(__SANITIZE_THREAD__)
  char tsan_sync_ = 0;  // only its address is used
#endif
};

PinnedHeap::PinnedHeap(SlabSource& source, PinnedHeapConfig config)
    : impl_(std::make_unique<Impl>(source, config)) {}
PinnedHeap::~PinnedHeap() = default;
void* PinnedHeap::allocate(std::size_t bytes, std::size_t alignment) { return impl_->allocate(bytes, alignment); }
void PinnedHeap::deallocate(void* ptr) { impl_->deallocate(ptr, nullptr); }
void PinnedHeap::deallocate(void* ptr, std::size_t bytes) { impl_->deallocate(ptr, &bytes); }
bool PinnedHeap::owns(const void* ptr) const { return impl_->owns(ptr); }
PinnedHeapStats PinnedHeap::stats() const { return impl_->stats(); }
PinnedHeapBackend PinnedHeap::backend() const noexcept { return impl_->backend(); }
std::vector<HostSlab> PinnedHeap::slabs() const { return impl_->slabs(); }

}  // namespace memtide
