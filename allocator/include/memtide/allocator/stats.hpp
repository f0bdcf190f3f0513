#pragma once
/// @file
/// Allocator statistics with PyTorch's names and meanings, so dashboards and scripts written for
/// `torch.cuda.memory_stats()` read memtide's unchanged.

#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace memtide {

/// One statistic: current value, its peak, and running totals of increases and decreases.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void increase(std::int64_t n) noexcept {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void decrease(std::int64_t n) noexcept {
    current -= n;
    freed += n;
  }
  /// increase() for delta >= 0, decrease() otherwise: the allocator's hot path calls this.
  void add(std::int64_t delta) noexcept {
    current += delta;
    if (delta >= 0) {
      allocated += delta;
      peak = current > peak ? current : peak;
    } else {
      freed -= delta;
    }
  }
  void reset_peak() noexcept { peak = current; }
  void reset_accumulated() noexcept { allocated = freed = 0; }
};

/// Index into a StatArray: PyTorch's "all", "small_pool", "large_pool".
enum class StatType : int { all = 0, small_pool = 1, large_pool = 2 };
using StatArray = std::array<Stat, 3>;

struct AllocatorStats {
  StatArray allocation{};            ///< live allocations (count)
  StatArray segment{};               ///< device segments held (count)
  StatArray active{};                ///< allocated or awaiting cross-stream completion (count)
  StatArray inactive_split{};        ///< free blocks inside a split segment (count)
  StatArray allocated_bytes{};
  StatArray reserved_bytes{};
  StatArray active_bytes{};
  StatArray inactive_split_bytes{};
  StatArray requested_bytes{};       ///< bytes asked for, before rounding
  std::int64_t num_alloc_retries = 0;  ///< allocations that had to release cache and retry
  std::int64_t num_ooms = 0;
  std::int64_t num_sync_all_streams = 0;
  std::int64_t num_device_alloc = 0;
  std::int64_t num_device_free = 0;
  std::int64_t num_invalid_frees = 0;  ///< frees of unknown or already-freed pointers (memtide's)
  std::int64_t num_cross_stream_reuse = 0;  ///< cached segments moved to another stream (memtide's)

  /// Calls `f(name, array)` for every StatArray, in PyTorch's order.
  template <typename F>
  void for_each_array(F&& f) {
    f("allocation", allocation);
    f("segment", segment);
    f("active", active);
    f("inactive_split", inactive_split);
    f("allocated_bytes", allocated_bytes);
    f("reserved_bytes", reserved_bytes);
    f("active_bytes", active_bytes);
    f("inactive_split_bytes", inactive_split_bytes);
    f("requested_bytes", requested_bytes);
  }
  template <typename F>
  void for_each_array(F&& f) const {
    const_cast<AllocatorStats*>(this)->for_each_array(
        [&](const char* name, StatArray& a) { f(name, static_cast<const StatArray&>(a)); });
  }
};

/// Flattened as PyTorch does: "allocated_bytes.all.current", "num_ooms", ...
std::map<std::string, std::int64_t> flatten(const AllocatorStats& stats);

}  // namespace memtide
