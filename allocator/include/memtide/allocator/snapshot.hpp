#pragma once
/// @file
/// The allocator's state and history in PyTorch's memory_viz model, and its pickle encoding, so
/// pytorch.org/memory_viz and `torch.cuda._memory_viz` open memtide snapshots unchanged.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace memtide {

enum class BlockState { active_allocated, active_pending_free, inactive };
const char* block_state_name(BlockState state) noexcept;

struct BlockSnapshot {
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  std::uint64_t requested_size = 0;
  BlockState state = BlockState::inactive;
};

struct SegmentSnapshot {
  int device = 0;
  std::uint64_t address = 0;
  std::uint64_t total_size = 0;
  std::uint64_t allocated_size = 0;
  std::uint64_t active_size = 0;
  std::uint64_t requested_size = 0;
  std::uint64_t stream = 0;
  bool small = false;  ///< segment_type "small" or "large"
  bool expandable = false;  ///< grown and shrunk in place with virtual memory
  std::uint64_t pool_first = 0;   ///< the owning private pool's id (0, 0: the default pool)
  std::uint64_t pool_second = 0;
  std::vector<BlockSnapshot> blocks;  ///< tile the segment in address order
};

/// segment_map / segment_unmap: an expandable segment grew or shrank by [addr, addr + size).
enum class TraceAction { alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom, snapshot };
const char* trace_action_name(TraceAction action) noexcept;

struct TraceEntry {
  TraceAction action = TraceAction::alloc;
  std::uint64_t addr = 0;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;
  std::int64_t time_us = 0;
};

struct Snapshot {
  std::vector<SegmentSnapshot> segments;
  /// One trace per device, oldest entry first.
  std::vector<std::vector<TraceEntry>> device_traces;
};

/// Writes `snapshot` as a pickle (protocol 4) of the dict torch.cuda.memory._snapshot() returns.
void write_memory_viz_pickle(const Snapshot& snapshot, std::ostream& out);

/// Checks the invariants a viewer relies on: blocks tile each segment contiguously, and the trace
/// replayed backwards from the final state never frees what is free or allocates what is live.
/// Returns an empty string when valid, else what is wrong.
std::string validate_snapshot(const Snapshot& snapshot);

}  // namespace memtide
