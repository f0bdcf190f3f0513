#pragma once
/// @file
/// CachingAllocator: stream-ordered caching of device memory, with per-phase watermarks.
///
/// Behaviour follows PyTorch's caching allocator so memtide can replace it: 512-byte rounding;
/// requests up to 1 MiB come from 2 MiB "small" segments, up to 10 MiB from 20 MiB "large"
/// segments, bigger ones get a segment rounded to 2 MiB; best fit per stream with splitting and
/// coalescing; a limit (memory fraction or byte cap); on OOM, cached segments are released and the
/// allocation retried before failing with a message that says where the memory went.
///
/// Stream ordering lives here and nowhere else:
/// - a block freed on stream S is reused at once by allocations on S;
/// - a cached segment moves to another stream T only when the allocator is at its limit, and T
///   first waits on an event recorded on S (so T's work starts after S's last use);
/// - a block used on extra streams (record_stream) is held at free time until events recorded on
///   those streams complete.
///
/// Thread-safe; one mutex, held briefly. The steady-state fast path does no heap allocation.

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <functional>
#include <mutex>
#include <string>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include "memtide/allocator/detail/address_map.hpp"
#include "memtide/allocator/memory_resource.hpp"
#include "memtide/allocator/phase_tracker.hpp"
#include "memtide/allocator/snapshot.hpp"
#include "memtide/allocator/stats.hpp"
#include "memtide/device/device.hpp"

namespace memtide {

struct AllocatorConfig {
  std::uint64_t max_bytes = 0;        ///< byte cap on reserved memory; 0 = none
  double memory_fraction = 1.0;       ///< cap as a fraction of the device's total memory
  bool record_history = false;        ///< keep a trace for snapshots
  std::size_t history_entries = 100000;
  std::size_t phase_history = 4;      ///< finished iterations remembered by the PhaseTracker
  std::uint64_t headroom_margin = 256ULL << 20;
  /// Large allocations of the default pool share one segment per stream that grows by mapping
  /// granules at its end and shrinks by unmapping free ones there (Device virtual memory), so
  /// fragmentation cannot strand memory between segments. Off where the device has no virtual
  /// memory management.
  bool expandable_segments = false;

  /// From the options table (MEMTIDE_MAX_BYTES, MEMTIDE_MEMORY_FRACTION, ...).
  static AllocatorConfig from_options();
};

/// Device memory a component holds on loan from the allocator (the tiering engine's static
/// residents and kept gradients) that it can give back when an allocation would otherwise fail.
struct Lender {
  std::string name;
  /// Bytes held now (for the out-of-memory message).
  std::function<std::uint64_t()> borrowed;
  /// Gives back what it can, with `needed` bytes in mind; returns the bytes it freed (0 when it
  /// cannot now, e.g. because it is in the middle of its own work). Called without the
  /// allocator's lock held, so it may free through the allocator.
  std::function<std::uint64_t(std::uint64_t needed)> give_back;
};

/// A private pool's id: torch's MempoolId_t (CUDA graph capture, torch.cuda.MemPool). {0, 0} is the
/// default pool.
using PoolId = std::pair<std::uint64_t, std::uint64_t>;

/// Per-phase watermarks of the running iteration and the remembered ones.
struct PhaseReport {
  Phase current = Phase::other;
  std::uint64_t iterations = 0;
  IterationRecord running;
  std::vector<IterationRecord> history;
};

class CachingAllocator final : public DeviceMemoryResource {
 public:
  explicit CachingAllocator(Device& device, AllocatorConfig config = {});
  /// Returns cached segments to the device. Blocks still allocated are leaked with a warning,
  /// since work may still use them.
  ~CachingAllocator() override;
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// Marks `ptr` as used on `stream` too: its memory is not reused until that stream's work
  /// queued before the free has completed. Throws InvalidArgument for a pointer not allocated
  /// here, and the device's error for a stream it does not know (nothing recorded then).
  void record_stream(void* ptr, Stream stream);
  /// deallocate() that also checks the caller's idea of the block: `size` must be the size it
  /// was allocated with and `stream` its stream (the pluggable-allocator ABI passes both), else
  /// InvalidArgument and nothing is freed. Every free has the strong guarantee: when it throws,
  /// the block is still allocated and the allocator unchanged.
  void deallocate(void* ptr, std::size_t size, Stream stream);
  using DeviceMemoryResource::deallocate;
  /// Returns every fully free cached segment to the device (torch.cuda.empty_cache).
  void empty_cache();
  /// Limit = fraction * device memory (and max_bytes if set). Throws InvalidArgument outside (0, 1].
  void set_memory_fraction(double fraction);
  /// Byte cap on reserved memory; 0 removes it.
  void set_max_bytes(std::uint64_t bytes);
  [[nodiscard]] std::uint64_t limit() const;
  /// The memory fraction the limit is computed from.
  [[nodiscard]] double memory_fraction() const;

  [[nodiscard]] AllocatorStats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();

  /// Enters a training phase; also the iteration boundary (see PhaseTracker).
  void mark_phase(Phase phase);
  [[nodiscard]] Phase phase() const;
  /// Bytes that can be borrowed now and held until `until` begins, keeping `margin`
  /// (default: the configured headroom margin) free.
  [[nodiscard]] Headroom headroom(Phase until, std::optional<std::uint64_t> margin = std::nullopt) const;
  [[nodiscard]] PhaseReport phase_report() const;
  /// Bytes a headroom answer keeps free (AllocatorConfig::headroom_margin).
  [[nodiscard]] std::uint64_t headroom_margin() const noexcept { return config_.headroom_margin; }
  /// Whether large allocations go to expandable segments (asked for, and the device can).
  [[nodiscard]] bool expandable_segments() const noexcept { return granule_ != 0; }

  /// Segments, blocks and (when recording) the trace, in memory_viz's model.
  [[nodiscard]] Snapshot snapshot() const;
  void set_record_history(bool enabled);
  [[nodiscard]] bool record_history() const;
  /// A phase mark while recording: when (microseconds, the trace's clock) and which phase.
  struct PhaseMark {
    std::int64_t time_us;
    Phase phase;
  };
  /// The phase marks made while recording history, oldest first (at most history_entries / 16;
  /// the oldest go first), to put the trace's allocations into their phases.
  [[nodiscard]] std::vector<PhaseMark> phase_marks() const;

  /// Registers a lender: when an allocation fails even after the cache is released, every
  /// lender is asked to give back, and the allocation retried; what they still hold is named in
  /// the out-of-memory error. Returns the id for remove_lender.
  std::uint64_t add_lender(Lender lender);
  void remove_lender(std::uint64_t id);

  /// @name Private pools (torch's CUDA graph pools and MemPool)
  /// A private pool's segments serve only allocations routed to it, so memory a captured graph
  /// replays into is never handed to anyone else; its blocks are freed and reused within it.
  /// @{
  /// Routes allocations on streams `filter` accepts (all streams when it is empty) into pool
  /// `id` until end_allocate_to_pool(id); creates the pool or raises its use count. Throws
  /// InvalidArgument for the default pool's id or a pool already being allocated to.
  void begin_allocate_to_pool(PoolId id, std::function<bool(Stream)> filter);
  /// Stops routing into `id`. Throws InvalidArgument when nothing was routed there.
  void end_allocate_to_pool(PoolId id);
  /// Creates pool `id` (use count 1) or raises its use count.
  void create_or_incref_pool(PoolId id);
  /// Lowers the use count; at zero the pool's free segments go back to the device now and the
  /// rest as soon as their blocks are freed and the cache is released. Throws InvalidArgument for
  /// an unknown pool.
  void release_pool(PoolId id);
  /// The pool's use count; 0 for one that does not exist (any more).
  [[nodiscard]] int pool_use_count(PoolId id) const;
  /// @}

  /// The largest cached free block of the default pool (torch's cacheInfo, which cudnn's
  /// benchmark mode uses to size its workspace), or the device's free memory within the limit
  /// when that is larger.
  [[nodiscard]] std::size_t largest_free_block() const;
  /// The segment holding the allocated `ptr`: its base and size; nullopt when `ptr` is not
  /// allocated here (torch's getBaseAllocation, for IPC handles).
  [[nodiscard]] std::optional<std::pair<void*, std::size_t>> segment_of(void* ptr) const;

  /// Size of the block holding `ptr` (rounded), or nullopt when `ptr` is not allocated here.
  [[nodiscard]] std::optional<std::size_t> allocation_size(void* ptr) const;

  [[nodiscard]] Device& device() noexcept { return device_; }

 private:
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

  void* do_allocate(std::size_t bytes, Stream stream) override;
  void do_deallocate(void* ptr, Stream stream) override;
  void deallocate_locked(void* ptr, std::optional<std::size_t> size, std::optional<Stream> stream);

  /// The pool an allocation on `stream` goes to: a routed private pool, else the default one.
  Pool& pool_for_locked(Stream stream);
  Pool* find_pool_locked(PoolId id) const;
  Block* find_free_locked(Pool& pool, bool small, Stream stream, std::size_t size);
  Block* alloc_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size);
  Block* steal_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size);
  /// Returns the fully free segments of the default pool and of released private pools; drops
  /// released pools left without segments.
  void release_cached_locked();
  void release_free_segments_locked(Pool& pool);
  /// Maps enough at the end of `stream`'s expandable segment for `size` and returns a free block
  /// of at least that size (its last block grown, or a new one); null at the limit or when the
  /// device has no room.
  Block* grow_expandable_locked(Stream stream, std::size_t size);
  /// Unmaps the free granules at the end of every expandable segment.
  void trim_expandable_locked();
  void release_segment_locked(Block* head);
  Block* split_locked(Block* block, std::size_t size);
  void free_block_locked(Block* block);
  void insert_free_locked(Block* block);
  void remove_free_locked(Block* block);
  void process_pending_locked(bool wait);
  Block* new_block_locked();
  void recycle_block_locked(Block* block);
  Event take_event_locked();
  /// Updates "all" and the block's pool; inline because every allocation does it five times.
  static void update_stat(StatArray& a, bool small, std::int64_t delta) noexcept {
    a[0].add(delta);
    a[small ? static_cast<int>(StatType::small_pool) : static_cast<int>(StatType::large_pool)].add(delta);
  }
  void observe_locked() noexcept {
    tracker_.observe(static_cast<std::uint64_t>(stats_.allocated_bytes[0].current),
                     static_cast<std::uint64_t>(stats_.reserved_bytes[0].current));
  }
  void trace_locked(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream);
  std::uint64_t compute_limit_locked() const;
  [[noreturn]] void throw_oom_locked(std::size_t bytes, Stream stream, const std::string& loans);
  /// Asks every lender to give back (the allocator's lock not held); returns the bytes freed and
  /// sets `loans` to what they still hold, in words.
  std::uint64_t reclaim(std::uint64_t needed, std::string& loans);

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
  std::vector<TraceEntry> trace_;  ///< ring buffer when full
  std::deque<PhaseMark> phase_marks_;
  std::size_t trace_next_ = 0;
  bool trace_wrapped_ = false;
  std::mutex lenders_mutex_;  // never held with mutex_
  std::vector<std::pair<std::uint64_t, Lender>> lenders_;
  std::uint64_t next_lender_ = 1;
};

}  // namespace memtide
