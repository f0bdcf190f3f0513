#pragma once
/// @file
/// CachingAllocator: stream-ordered caching of device memory, with per-phase watermarks.
///
/// PyTorch's policy (512-byte rounding, small and large pools, best fit per stream, split and
/// coalesce, a limit, release-and-retry on OOM) with stream ordering kept here and nowhere else;
/// docs/architecture.md ("CachingAllocator") has the rules. Thread-safe: one mutex, held briefly;
/// the steady-state fast path does no heap allocation.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
  [[nodiscard]] std::uint64_t headroom_margin() const noexcept;
  /// Whether large allocations go to expandable segments (asked for, and the device can).
  [[nodiscard]] bool expandable_segments() const noexcept;

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

  [[nodiscard]] Device& device() noexcept;

 private:
  struct Impl;  // caching_allocator_internal.hpp
  void* do_allocate(std::size_t bytes, Stream stream) override;
  void do_deallocate(void* ptr, Stream stream) override;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtide
