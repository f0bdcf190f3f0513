// Expandable segments: one reservation per stream that grows by mapping granules at its end and
// shrinks by unmapping free ones there (AllocatorConfig::expandable_segments).

#include <algorithm>
#include <iterator>

#include "caching_allocator_internal.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"

namespace memtide {

CachingAllocator::Impl::Block* CachingAllocator::Impl::grow_expandable_locked(Stream stream, std::size_t size) {
  auto x = std::find_if(expandable_.begin(), expandable_.end(), [&](const Expandable& e) { return e.stream == stream; });
  if (x == expandable_.end()) {
    // The whole device's worth of address space, so the segment never needs a second one.
    Expandable fresh;
    fresh.reserved = round_up(device_.properties().total_memory, granule_);
    fresh.stream = stream;
    try {
      fresh.base = reinterpret_cast<std::uintptr_t>(device_.reserve_address(fresh.reserved));
    } catch (const Error& e) {
      MEMTIDE_LOG(warn, std::string("CachingAllocator: expandable segments are off: ") + e.what());
      granule_ = 0;
      return alloc_segment_locked(default_pool_, false, stream, size);
    }
    expandable_.push_back(fresh);
    x = std::prev(expandable_.end());
  }
  // The last block, if free (and not waiting for other streams), grows into the new granules.
  Block* tail = nullptr;
  if (x->mapped > 0) {
    for (tail = segments_.at(x->base).head; tail->next != nullptr;) tail = tail->next;
  }
  const bool extend = tail != nullptr && !tail->allocated && tail->pending_events == 0;
  const std::size_t need = extend ? size - std::min(size, tail->size) : size;
  const std::size_t bytes = round_up(need, granule_);
  const auto reserved = static_cast<std::uint64_t>(stats_.reserved_bytes[0].current);
  if (reserved + bytes > limit_ || x->mapped + bytes > x->reserved) return nullptr;
  const std::uintptr_t at = x->base + x->mapped;
  try {
    device_.map_memory(reinterpret_cast<void*>(at), bytes);
  } catch (const OutOfMemory&) {
    return nullptr;
  }
  ++stats_.num_device_alloc;
  x->mapped += bytes;
  update_stat(stats_.reserved_bytes, false, static_cast<std::int64_t>(bytes));
  history_.record(TraceAction::segment_map, at, bytes, stream);
  if (extend) {
    remove_free_locked(tail);
    tail->size += bytes;
    segments_.at(x->base).size = x->mapped;
    return tail;
  }
  Block* b = new_block_locked();
  b->addr = at;
  b->size = bytes;
  b->stream = stream;
  b->pool = &default_pool_;
  b->small = false;
  b->expandable = true;
  if (tail == nullptr) {
    segments_[x->base] = Segment{b, x->mapped};
    ++default_pool_.segments;
    update_stat(stats_.segment, false, 1);
  } else {
    // The old tail is allocated or waits for other streams: not in the free set, not counted
    // as an inactive split until it is freed (with its new neighbour).
    b->prev = tail;
    tail->next = b;
    segments_.at(x->base).size = x->mapped;
  }
  return b;
}

void CachingAllocator::Impl::trim_expandable_locked() {
  for (Expandable& x : expandable_) {
    if (x.mapped == 0) continue;
    Block* tail = segments_.at(x.base).head;
    while (tail->next != nullptr) tail = tail->next;
    if (tail->allocated || tail->pending_events != 0) continue;
    const std::uintptr_t end = x.base + x.mapped;
    const std::uintptr_t from = round_up(tail->addr, granule_);
    if (from >= end) continue;
    const std::size_t bytes = end - from;
    device_.unmap_memory(reinterpret_cast<void*>(from), bytes);
    ++stats_.num_device_free;
    x.mapped -= bytes;
    update_stat(stats_.reserved_bytes, false, -static_cast<std::int64_t>(bytes));
    history_.record(TraceAction::segment_unmap, from, bytes, x.stream);
    remove_free_locked(tail);
    if (from > tail->addr) {
      tail->size = from - tail->addr;
      insert_free_locked(tail);
      segments_.at(x.base).size = x.mapped;
      continue;
    }
    // The whole tail block went.
    Block* prev = tail->prev;
    if (prev == nullptr) {
      segments_.erase(x.base);
      --default_pool_.segments;
      update_stat(stats_.segment, false, -1);
    } else {
      // prev is allocated or pending (a free one would have coalesced with the tail).
      prev->next = nullptr;
      segments_.at(x.base).size = x.mapped;
    }
    recycle_block_locked(tail);
  }
}

}  // namespace memtide
