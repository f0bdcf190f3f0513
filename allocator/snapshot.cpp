#include "memtide/allocator/snapshot.hpp"

#include <cstring>
#include <map>
#include <set>
#include <string_view>

namespace memtide {

const char* block_state_name(BlockState state) noexcept {
  switch (state) {
    case BlockState::active_allocated: return "active_allocated";
    case BlockState::active_pending_free: return "active_pending_free";
    case BlockState::inactive: return "inactive";
  }
  return "inactive";
}

const char* trace_action_name(TraceAction action) noexcept {
  switch (action) {
    case TraceAction::alloc: return "alloc";
    case TraceAction::free_requested: return "free_requested";
    case TraceAction::free_completed: return "free_completed";
    case TraceAction::segment_alloc: return "segment_alloc";
    case TraceAction::segment_free: return "segment_free";
    case TraceAction::segment_map: return "segment_map";
    case TraceAction::segment_unmap: return "segment_unmap";
    case TraceAction::oom: return "oom";
    case TraceAction::snapshot: return "snapshot";
  }
  return "snapshot";
}

namespace {

/// Emits the few pickle opcodes a nested dict/list/str/int document needs. No memo is written;
/// Python's unpickler does not require one.
class PickleWriter {
 public:
  explicit PickleWriter(std::ostream& out) : out_(out) {
    put(0x80);  // PROTO
    put(4);
  }
  void finish() { put('.'); }  // STOP

  void dict_begin() {
    put('}');  // EMPTY_DICT
    put('(');  // MARK
  }
  void dict_end() { put('u'); }  // SETITEMS
  void list_begin() {
    put(']');  // EMPTY_LIST
    put('(');  // MARK
  }
  void list_end() { put('e'); }  // APPENDS

  void str(std::string_view s) {
    if (s.size() < 256) {
      put(0x8c);  // SHORT_BINUNICODE
      put(static_cast<unsigned char>(s.size()));
    } else {
      put('X');  // BINUNICODE
      le(static_cast<std::uint64_t>(s.size()), 4);
    }
    out_.write(s.data(), static_cast<std::streamsize>(s.size()));
  }

  void integer(std::int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      put('J');  // BININT
      le(static_cast<std::uint64_t>(static_cast<std::uint32_t>(static_cast<std::int32_t>(v))), 4);
      return;
    }
    put(0x8a);  // LONG1, 8 bytes two's complement
    put(8);
    le(static_cast<std::uint64_t>(v), 8);
  }

  /// Unsigned values above INT64_MAX (addresses never are on x86-64, but be exact anyway).
  void uinteger(std::uint64_t v) {
    if (v <= static_cast<std::uint64_t>(INT64_MAX)) {
      integer(static_cast<std::int64_t>(v));
      return;
    }
    put(0x8a);
    put(9);
    le(v, 8);
    put(0);  // sign byte keeps it positive
  }

  void key(std::string_view k) { str(k); }

 private:
  void put(unsigned char c) { out_.put(static_cast<char>(c)); }
  void le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) put(static_cast<unsigned char>((v >> (8 * i)) & 0xff));
  }
  std::ostream& out_;
};

}  // namespace

void write_memory_viz_pickle(const Snapshot& snapshot, std::ostream& out) {
  PickleWriter w(out);
  w.dict_begin();
  w.key("segments");
  w.list_begin();
  for (const SegmentSnapshot& s : snapshot.segments) {
    w.dict_begin();
    w.key("device"), w.integer(s.device);
    w.key("address"), w.uinteger(s.address);
    w.key("total_size"), w.uinteger(s.total_size);
    w.key("allocated_size"), w.uinteger(s.allocated_size);
    w.key("active_size"), w.uinteger(s.active_size);
    w.key("requested_size"), w.uinteger(s.requested_size);
    w.key("stream"), w.uinteger(s.stream);
    w.key("segment_type"), w.str(s.small ? "small" : "large");
    w.key("segment_pool_id");
    w.list_begin();
    w.uinteger(s.pool_first);
    w.uinteger(s.pool_second);
    w.list_end();
    w.key("is_expandable");
    w.integer(s.expandable ? 1 : 0);
    w.key("frames");
    w.list_begin();
    w.list_end();
    w.key("blocks");
    w.list_begin();
    for (const BlockSnapshot& b : s.blocks) {
      w.dict_begin();
      w.key("address"), w.uinteger(b.address);
      w.key("size"), w.uinteger(b.size);
      w.key("requested_size"), w.uinteger(b.requested_size);
      w.key("state"), w.str(block_state_name(b.state));
      w.key("frames");
      w.list_begin();
      w.list_end();
      w.dict_end();
    }
    w.list_end();
    w.dict_end();
  }
  w.list_end();
  w.key("device_traces");
  w.list_begin();
  for (const auto& trace : snapshot.device_traces) {
    w.list_begin();
    for (const TraceEntry& e : trace) {
      w.dict_begin();
      w.key("action"), w.str(trace_action_name(e.action));
      w.key("addr"), w.uinteger(e.addr);
      w.key("size"), w.uinteger(e.size);
      w.key("stream"), w.uinteger(e.stream);
      w.key("time_us"), w.integer(e.time_us);
      w.key("frames");
      w.list_begin();
      w.list_end();
      w.dict_end();
    }
    w.list_end();
  }
  w.list_end();
  w.dict_end();
  w.finish();
}

std::string validate_snapshot(const Snapshot& snapshot) {
  std::set<std::uint64_t> live_blocks;    // active (allocated or pending) at the end
  std::set<std::uint64_t> live_segments;
  for (const SegmentSnapshot& s : snapshot.segments) {
    live_segments.insert(s.address);
    std::uint64_t cursor = s.address;
    for (const BlockSnapshot& b : s.blocks) {
      if (b.address != cursor) {
        return "segment " + std::to_string(s.address) + ": block at " + std::to_string(b.address) +
               " does not start where the previous one ended (" + std::to_string(cursor) + ")";
      }
      if (b.size == 0) return "segment " + std::to_string(s.address) + ": empty block";
      cursor += b.size;
      if (b.state != BlockState::inactive) live_blocks.insert(b.address);
    }
    if (cursor != s.address + s.total_size) {
      return "segment " + std::to_string(s.address) + ": blocks cover " + std::to_string(cursor - s.address) +
             " of " + std::to_string(s.total_size) + " bytes";
    }
  }
  // Walk each trace backwards from the final state. Only actions on this state's objects are
  // checked; a trace that starts mid-run (ring buffer wrapped) is still consistent backwards.
  for (const auto& trace : snapshot.device_traces) {
    std::set<std::uint64_t> blocks = live_blocks;
    std::set<std::uint64_t> segments = live_segments;
    for (auto it = trace.rbegin(); it != trace.rend(); ++it) {
      const TraceEntry& e = *it;
      const std::string where = std::string(trace_action_name(e.action)) + " at " + std::to_string(e.addr);
      switch (e.action) {
        case TraceAction::alloc:
          if (blocks.erase(e.addr) == 0) return "trace replay: " + where + " of a block that is not live after it";
          break;
        case TraceAction::free_requested:
          if (blocks.count(e.addr) == 0) return "trace replay: " + where + " of a block that is not active after it";
          break;
        case TraceAction::free_completed:
          if (!blocks.insert(e.addr).second) return "trace replay: " + where + " of a block that is live after it";
          break;
        case TraceAction::segment_alloc:
          if (segments.erase(e.addr) == 0) return "trace replay: " + where + " of a segment that does not exist after it";
          break;
        case TraceAction::segment_free:
          if (!segments.insert(e.addr).second) return "trace replay: " + where + " of a segment that exists after it";
          break;
        case TraceAction::segment_map:    // an expandable segment's size, not its existence
        case TraceAction::segment_unmap:
        case TraceAction::oom:
        case TraceAction::snapshot:
          break;
      }
    }
  }
  return {};
}

}  // namespace memtide
