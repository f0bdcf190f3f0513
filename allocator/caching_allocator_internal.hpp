#pragma once
// CachingAllocator's internals: blocks, pools, segments and the state behind its one mutex.
// Private to allocator/ (not under include/): the public header shows only the API, and these
// structures can change without recompiling the layers above.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/detail/address_map.hpp"

namespace memtide {

// PyTorch's caching allocator constants; matching them keeps fragmentation behaviour familiar.
inline constexpr std::size_t kRound = 512;
inline constexpr std::size_t kSmallSize = 1ULL << 20;      // requests <= 1 MiB use the small pool
inline constexpr std::size_t kSmallSegment = 2ULL << 20;   // small pool segment size
inline constexpr std::size_t kMediumLimit = 10ULL << 20;   // requests < 10 MiB share 20 MiB segments
inline constexpr std::size_t kMediumSegment = 20ULL << 20;
inline constexpr std::size_t kLargeRound = 2ULL << 20;

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
inline std::uint64_t stream_id(Stream s) { return reinterpret_cast<std::uint64_t>(s.handle); }
/// steady_clock in ns: the clock of phase marks and of the trace (in microseconds there).
double wall_ns();

/// The allocation trace (a ring buffer of history_entries) and the phase marks made while it
/// records. Guarded by the allocator's mutex.
class AllocationHistory {
 public:
  AllocationHistory(bool enabled, std::size_t entries);
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }
  /// Turning recording off drops what was recorded.
  void set_enabled(bool enabled);
  /// Inline so that the allocator's fast path pays one branch while recording is off.
  void record(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream) {
    if (enabled_) append(action, addr, size, stream);
  }
  void mark(double now_ns, Phase phase);
  /// The trace, oldest first.
  [[nodiscard]] std::vector<TraceEntry> entries() const;
  [[nodiscard]] std::vector<CachingAllocator::PhaseMark> marks() const { return {marks_.begin(), marks_.end()}; }

 private:
  void append(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream);
  bool enabled_;
  std::size_t entries_;
  std::vector<TraceEntry> trace_;  ///< ring buffer when full
  std::size_t next_ = 0;
  bool wrapped_ = false;
  std::deque<CachingAllocator::PhaseMark> marks_;
};

/// The lenders and the asking: its own mutex, never held with the allocator's.
class LenderRegistry {
 public:
  std::uint64_t add(Lender lender);
  void remove(std::uint64_t id);
  /// Asks every lender to give back (the allocator's lock not held); returns the bytes freed and
  /// sets `loans` to what they still hold, in words. 0 when called from within a lender.
  std::uint64_t reclaim(std::uint64_t needed, std::string& loans);

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::uint64_t, Lender>> lenders_;
  std::uint64_t next_ = 1;
};

struct CachingAllocator::Impl {
  struct Block;
  struct BlockLess {
    bool operator()(const Block* a, const Block* b) const noexcept;
  };
  using FreeSet = std::set<Block*, BlockLess>;
  /// The default pool or a private one: the free blocks of the segments it owns.
  struct Pool {
    PoolId id{0, 0};
    FreeSet small_free;
    FreeSet large_free;
    int use_count = 0;        ///< private pools: creators and captures holding it
    std::size_t segments = 0; ///< segments it owns
    FreeSet& free(bool small) { return small ? small_free : large_free; }
  };
  struct Block {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
    std::size_t requested = 0;
    Stream stream{};
    Pool* pool = nullptr;        ///< the owner of its segment
    bool small = false;
    bool expandable = false;     ///< in an expandable segment (never released or stolen whole)
    bool allocated = false;
    int pending_events = 0;      ///< outstanding record_stream events after free
    Block* prev = nullptr;       ///< neighbours within the segment, in address order
    Block* next = nullptr;
    std::vector<Stream> uses;    ///< extra streams from record_stream
    // The free-set node is kept with the block across removals so that reinsertion reuses it
    // instead of allocating: with the flat AddressMap, this keeps the fast path free of malloc.
    FreeSet::node_type free_node;
    FreeSet::iterator free_it;   ///< position in its pool's free set, valid while free and cached
  };
  struct Segment {
    Block* head = nullptr;
    std::size_t size = 0;
  };
  /// One stream's expandable segment: a reservation whose first `mapped` bytes are memory.
  struct Expandable {
    std::uintptr_t base = 0;
    std::size_t reserved = 0;
    std::size_t mapped = 0;
    Stream stream{};
  };
  struct PendingFree {
    Block* block;
    std::vector<Event> events;
  };

  Impl(Device& device, AllocatorConfig config);
  ~Impl();

  // caching_allocator.cpp: allocation, free and the block bookkeeping.
  void* allocate(std::size_t bytes, Stream stream);
  void deallocate_locked(void* ptr, std::optional<std::size_t> size, std::optional<Stream> stream);
  /// The pool an allocation on `stream` goes to: a routed private pool, else the default one.
  Pool& pool_for_locked(Stream stream);
  Block* find_free_locked(Pool& pool, bool small, Stream stream, std::size_t size);
  Block* alloc_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size);
  Block* steal_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size);
  /// Returns the fully free segments of the default pool and of released private pools; drops
  /// released pools left without segments.
  void release_cached_locked();
  void release_free_segments_locked(Pool& pool);
  void release_segment_locked(Block* head);
  Block* split_locked(Block* block, std::size_t size);
  void free_block_locked(Block* block);
  void insert_free_locked(Block* block);
  void remove_free_locked(Block* block);
  void process_pending_locked(bool wait);
  Block* new_block_locked();
  void recycle_block_locked(Block* block);
  Event take_event_locked();
  std::uint64_t compute_limit_locked() const;

  // caching_allocator_expandable.cpp
  /// Maps enough at the end of `stream`'s expandable segment for `size` and returns a free block
  /// of at least that size (its last block grown, or a new one); null at the limit or when the
  /// device has no room.
  Block* grow_expandable_locked(Stream stream, std::size_t size);
  /// Unmaps the free granules at the end of every expandable segment.
  void trim_expandable_locked();

  // caching_allocator_pools.cpp
  Pool* find_pool_locked(PoolId id) const;
  /// Creates private pool `id` (use count 1) or raises its use count.
  Pool& incref_pool_locked(PoolId id);

  // caching_allocator_reclaim.cpp
  [[noreturn]] void throw_oom_locked(std::size_t bytes, Stream stream, const std::string& loans);

  /// Updates "all" and the block's pool; inline because every allocation does it five times.
  static void update_stat(StatArray& a, bool small, std::int64_t delta) noexcept {
    a[0].add(delta);
    a[small ? static_cast<int>(StatType::small_pool) : static_cast<int>(StatType::large_pool)].add(delta);
  }
  void observe_locked() noexcept {
    tracker_.observe(static_cast<std::uint64_t>(stats_.allocated_bytes[0].current),
                     static_cast<std::uint64_t>(stats_.reserved_bytes[0].current));
  }

  Device& device_;
  AllocatorConfig config_;
  mutable std::mutex mutex_;
  std::uint64_t limit_ = 0;
  std::size_t granule_ = 0;  ///< the device's VMM granule when expandable segments are on, else 0
  std::vector<Expandable> expandable_;
  Pool default_pool_;
  std::map<PoolId, std::unique_ptr<Pool>> private_pools_;
  /// Allocations being routed into private pools (graph captures), with their stream filters.
  std::vector<std::pair<Pool*, std::function<bool(Stream)>>> routes_;
  detail::AddressMap<Block*> allocated_{4096};
  std::unordered_map<std::uintptr_t, Segment> segments_;
  std::deque<Block> block_storage_;
  std::vector<Block*> spare_blocks_;
  std::vector<PendingFree> pending_;
  std::vector<Event> spare_events_;
  AllocatorStats stats_;
  PhaseTracker tracker_;
  AllocationHistory history_;
  LenderRegistry lenders_;
};

}  // namespace memtide
