// CachingAllocator: construction, allocation, free and the block bookkeeping they share. The
// other concepts are beside it: caching_allocator_expandable.cpp (segments that grow in place),
// _pools.cpp (private pools), _reclaim.cpp (lenders and the out-of-memory error), _stats.cpp
// (limits, stats, phases, history and snapshots).

#include <algorithm>
#include <chrono>
#include <limits>

#include "caching_allocator_internal.hpp"
#include "memtide/core/assert.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"

namespace memtide {

double wall_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

AllocatorConfig AllocatorConfig::from_options() {
  const Options& o = options();
  AllocatorConfig c;
  c.max_bytes = o.max_bytes;
  c.memory_fraction = o.memory_fraction;
  c.record_history = o.record_history;
  c.history_entries = static_cast<std::size_t>(o.history_entries);
  c.phase_history = static_cast<std::size_t>(o.phase_history);
  c.headroom_margin = o.headroom_margin;
  c.expandable_segments = o.expandable_segments;
  return c;
}

// ---------------------------------------------------------------------------------------------
// CachingAllocator: construction and bookkeeping

bool CachingAllocator::Impl::BlockLess::operator()(const Block* a, const Block* b) const noexcept {
  if (a->stream.handle != b->stream.handle) return a->stream.handle < b->stream.handle;
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

CachingAllocator::CachingAllocator(Device& device, AllocatorConfig config)
    : impl_(std::make_unique<Impl>(device, config)) {}

CachingAllocator::~CachingAllocator() = default;

CachingAllocator::Impl::Impl(Device& device, AllocatorConfig config)
    : device_(device),
      config_(config),
      tracker_(config.phase_history),
      history_(config.record_history, config.history_entries) {
  if (!(config_.memory_fraction > 0.0 && config_.memory_fraction <= 1.0)) {
    throw InvalidArgument("CachingAllocator: memory_fraction " + std::to_string(config_.memory_fraction) +
                          " is outside (0, 1]");
  }
  limit_ = compute_limit_locked();
  tracker_.set_limit(limit_);
  if (config_.expandable_segments) {
    granule_ = device_.vmm_granularity();
    if (granule_ == 0) {
      MEMTIDE_LOG(info, "CachingAllocator: " + device_.properties().name +
                            " has no virtual memory management; expandable segments are off");
    }
  }
}

CachingAllocator::Impl::~Impl() {
  std::lock_guard lock(mutex_);
  try {
    process_pending_locked(/*wait=*/true);
    if (!allocated_.empty()) {
      MEMTIDE_LOG(warn, "CachingAllocator destroyed with " + std::to_string(allocated_.size()) +
                            " live allocation(s) (" + format_bytes(static_cast<std::uint64_t>(stats_.allocated_bytes[0].current)) +
                            "); their segments are not returned");
    }
    release_cached_locked();
    for (const Expandable& x : expandable_) {
      if (x.mapped == 0) device_.release_address(reinterpret_cast<void*>(x.base), x.reserved);
    }
    for (Event e : spare_events_) device_.destroy_event(e);
  } catch (const std::exception& e) {
    MEMTIDE_LOG(error, std::string("CachingAllocator teardown: ") + e.what());
  }
}

std::uint64_t CachingAllocator::Impl::compute_limit_locked() const {
  const double total = static_cast<double>(device_.properties().total_memory);
  auto limit = static_cast<std::uint64_t>(total * config_.memory_fraction);
  if (config_.max_bytes != 0) limit = std::min(limit, config_.max_bytes);
  return limit;
}

CachingAllocator::Impl::Block* CachingAllocator::Impl::new_block_locked() {
  if (!spare_blocks_.empty()) {
    Block* b = spare_blocks_.back();
    spare_blocks_.pop_back();
    return b;
  }
  return &block_storage_.emplace_back();
}

void CachingAllocator::Impl::recycle_block_locked(Block* block) {
  // Keep the stashed container nodes: the next block made from this one reuses them.
  block->prev = block->next = nullptr;
  block->allocated = false;
  block->pending_events = 0;
  block->uses.clear();
  spare_blocks_.push_back(block);
}

Event CachingAllocator::Impl::take_event_locked() {
  if (!spare_events_.empty()) {
    Event e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return device_.create_event(/*timing=*/false);
}

// A free block that shares its segment with other blocks counts as an inactive split.
void CachingAllocator::Impl::insert_free_locked(Block* block) {
  if (block->prev != nullptr || block->next != nullptr) {
    update_stat(stats_.inactive_split, block->small, 1);
    update_stat(stats_.inactive_split_bytes, block->small, static_cast<std::int64_t>(block->size));
  }
  FreeSet& set = block->pool->free(block->small);
  if (!block->free_node.empty()) {
    block->free_node.value() = block;
    block->free_it = set.insert(std::move(block->free_node)).position;
  } else {
    block->free_it = set.insert(block).first;
  }
}

void CachingAllocator::Impl::remove_free_locked(Block* block) {
  FreeSet& set = block->pool->free(block->small);
  MEMTIDE_ASSERT_EXPENSIVE(set.find(block) == block->free_it);
  block->free_node = set.extract(block->free_it);
  if (block->prev != nullptr || block->next != nullptr) {
    update_stat(stats_.inactive_split, block->small, -1);
    update_stat(stats_.inactive_split_bytes, block->small, -static_cast<std::int64_t>(block->size));
  }
}

// ---------------------------------------------------------------------------------------------
// Allocation

CachingAllocator::Impl::Pool& CachingAllocator::Impl::pool_for_locked(Stream stream) {
  for (auto& [pool, filter] : routes_) {
    if (!filter || filter(stream)) return *pool;
  }
  return default_pool_;
}

CachingAllocator::Impl::Block* CachingAllocator::Impl::find_free_locked(Pool& pool, bool small, Stream stream, std::size_t size) {
  FreeSet& set = pool.free(small);
  Block key;
  key.stream = stream;
  key.size = size;
  key.addr = 0;
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream) return nullptr;
  Block* b = *it;
  remove_free_locked(b);
  return b;
}

CachingAllocator::Impl::Block* CachingAllocator::Impl::alloc_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size) {
  std::size_t seg = small ? kSmallSegment : size < kMediumLimit ? kMediumSegment : round_up(size, kLargeRound);
  const auto reserved = static_cast<std::uint64_t>(stats_.reserved_bytes[0].current);
  if (reserved + seg > limit_ && !small && seg != round_up(size, kLargeRound)) {
    seg = round_up(size, kLargeRound);  // near the limit, a shared 20 MiB segment is a luxury
  }
  if (reserved + seg > limit_) return nullptr;
  void* ptr = nullptr;
  try {
    ptr = device_.allocate(seg);
  } catch (const OutOfMemory&) {
    return nullptr;
  }
  ++stats_.num_device_alloc;
  Block* b = new_block_locked();
  b->addr = reinterpret_cast<std::uintptr_t>(ptr);
  b->size = seg;
  b->stream = stream;
  b->pool = &pool;
  b->small = small;
  b->expandable = false;
  segments_[b->addr] = Segment{b, seg};
  ++pool.segments;
  update_stat(stats_.segment, small, 1);
  update_stat(stats_.reserved_bytes, small, static_cast<std::int64_t>(seg));
  history_.record(TraceAction::segment_alloc, b->addr, seg, stream);
  return b;
}

CachingAllocator::Impl::Block* CachingAllocator::Impl::steal_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size) {
  // The smallest whole free segment of another stream; among equals the lowest address, not the
  // first in the set's order: that order is the streams' handles, which are heap addresses, and a
  // choice that followed them would differ from one process to the next.
  Block* best = nullptr;
  for (Block* b : pool.free(small)) {
    if (b->stream != stream && !b->expandable && b->prev == nullptr && b->next == nullptr && b->size >= size &&
        (best == nullptr || b->size < best->size || (b->size == best->size && b->addr < best->addr))) {
      best = b;
    }
  }
  if (best == nullptr) return nullptr;
  remove_free_locked(best);
  // The new stream must not start before the old stream's queued work on this memory is done.
  Event e = take_event_locked();
  device_.record_event(e, best->stream);
  device_.stream_wait_event(stream, e);
  spare_events_.push_back(e);
  best->stream = stream;
  ++stats_.num_cross_stream_reuse;
  return best;
}

void CachingAllocator::Impl::release_segment_locked(Block* head) {
  const std::uintptr_t addr = head->addr;
  const std::size_t size = head->size;
  const bool small = head->small;
  device_.deallocate(reinterpret_cast<void*>(addr), size);
  ++stats_.num_device_free;
  --head->pool->segments;
  segments_.erase(addr);
  update_stat(stats_.segment, small, -1);
  update_stat(stats_.reserved_bytes, small, -static_cast<std::int64_t>(size));
  history_.record(TraceAction::segment_free, addr, size, head->stream);
  recycle_block_locked(head);
}

void CachingAllocator::Impl::release_free_segments_locked(Pool& pool) {
  for (FreeSet* set : {&pool.small_free, &pool.large_free}) {
    for (auto it = set->begin(); it != set->end();) {
      Block* b = *it;
      if (b->prev == nullptr && b->next == nullptr && !b->expandable) {
        it = set->erase(it);
        b->free_node = {};
        b->free_it = {};
        release_segment_locked(b);
      } else {
        ++it;
      }
    }
  }
}

void CachingAllocator::Impl::release_cached_locked() {
  release_free_segments_locked(default_pool_);
  if (!expandable_.empty()) trim_expandable_locked();
  // A private pool's cache belongs to its graph until the graph lets go of it.
  for (auto it = private_pools_.begin(); it != private_pools_.end();) {
    Pool& pool = *it->second;
    if (pool.use_count == 0) release_free_segments_locked(pool);
    const bool routed = std::any_of(routes_.begin(), routes_.end(), [&](const auto& r) { return r.first == &pool; });
    if (pool.use_count == 0 && pool.segments == 0 && !routed) {
      it = private_pools_.erase(it);
    } else {
      ++it;
    }
  }
  observe_locked();
}

CachingAllocator::Impl::Block* CachingAllocator::Impl::split_locked(Block* block, std::size_t size) {
  const std::size_t remaining = block->size - size;
  // In an expandable segment any rest is worth keeping apart: it is at most a granule's slack at
  // the end, or a hole the next fitting request takes (torch splits the same way there).
  const bool split = block->small || block->expandable ? remaining >= kRound : remaining > kSmallSize;
  if (!split) return block;
  Block* rest = new_block_locked();
  rest->addr = block->addr + size;
  rest->size = remaining;
  rest->stream = block->stream;
  rest->pool = block->pool;
  rest->small = block->small;
  rest->expandable = block->expandable;
  rest->prev = block;
  rest->next = block->next;
  if (rest->next != nullptr) rest->next->prev = rest;
  block->next = rest;
  block->size = size;
  insert_free_locked(rest);
  return block;
}

void* CachingAllocator::do_allocate(std::size_t bytes, Stream stream) { return impl_->allocate(bytes, stream); }

void* CachingAllocator::Impl::allocate(std::size_t bytes, Stream stream) {
  if (bytes > (std::numeric_limits<std::size_t>::max() >> 1)) {
    throw InvalidArgument("CachingAllocator: request of " + std::to_string(bytes) + " bytes is absurd");
  }
  const std::size_t size = round_up(bytes, kRound);
  const bool small = size <= kSmallSize;
  std::unique_lock lock(mutex_);
  if (!pending_.empty()) process_pending_locked(/*wait=*/false);

  Pool& pool = routes_.empty() ? default_pool_ : pool_for_locked(stream);
  const bool grow = granule_ != 0 && !small && &pool == &default_pool_;
  auto fresh = [&] { return grow ? grow_expandable_locked(stream, size) : alloc_segment_locked(pool, small, stream, size); };
  Block* b = find_free_locked(pool, small, stream, size);
  if (b == nullptr) b = fresh();
  if (b == nullptr) b = steal_segment_locked(pool, small, stream, size);
  if (b == nullptr) {
    ++stats_.num_alloc_retries;
    process_pending_locked(/*wait=*/true);
    release_cached_locked();
    b = find_free_locked(pool, small, stream, size);
    if (b == nullptr) b = fresh();
  }
  std::string loans;
  if (b == nullptr) {
    // Last: what tiering borrowed goes back (its frees come through here, so the lock is let go),
    // and what they freed is returned to the device for one more try.
    lock.unlock();
    const std::uint64_t given = lenders_.reclaim(size, loans);
    lock.lock();
    if (given > 0) {
      process_pending_locked(/*wait=*/true);
      release_cached_locked();
      b = find_free_locked(pool, small, stream, size);
      if (b == nullptr) b = fresh();
    }
  }
  if (b == nullptr) throw_oom_locked(bytes, stream, loans);

  b = split_locked(b, size);
  b->allocated = true;
  b->requested = bytes;
  allocated_.insert(b->addr, b);
  update_stat(stats_.allocation, small, 1);
  update_stat(stats_.active, small, 1);
  update_stat(stats_.allocated_bytes, small, static_cast<std::int64_t>(b->size));
  update_stat(stats_.active_bytes, small, static_cast<std::int64_t>(b->size));
  update_stat(stats_.requested_bytes, small, static_cast<std::int64_t>(bytes));
  observe_locked();
  history_.record(TraceAction::alloc, b->addr, b->size, stream);
  return reinterpret_cast<void*>(b->addr);
}

// ---------------------------------------------------------------------------------------------
// Free

void CachingAllocator::do_deallocate(void* ptr, Stream /*stream*/) {
  std::lock_guard lock(impl_->mutex_);
  impl_->deallocate_locked(ptr, std::nullopt, std::nullopt);
}

void CachingAllocator::deallocate(void* ptr, std::size_t size, Stream stream) {
  if (ptr == nullptr) return;
  std::lock_guard lock(impl_->mutex_);
  impl_->deallocate_locked(ptr, size, stream);
}

void CachingAllocator::Impl::deallocate_locked(void* ptr, std::optional<std::size_t> size, std::optional<Stream> stream) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  Block** found = allocated_.find(addr);
  if (found == nullptr) {
    ++stats_.num_invalid_frees;
    throw InvalidArgument("memtide: free of a pointer that is not allocated here (unknown or already freed)");
  }
  Block* b = *found;
  if (size && *size != b->requested) {
    ++stats_.num_invalid_frees;
    throw InvalidArgument("memtide: free of " + std::to_string(*size) + " bytes at a block allocated with " +
                          std::to_string(b->requested) + " bytes: nothing freed");
  }
  if (stream && *stream != b->stream) {
    ++stats_.num_invalid_frees;
    throw InvalidArgument("memtide: free on another stream than the allocation's (" + std::to_string(stream_id(*stream)) +
                          " vs " + std::to_string(stream_id(b->stream)) + "): nothing freed");
  }
  // What can fail comes first, so a failure leaves the block allocated and the allocator as it
  // was: an event on each extra stream the block was used on.
  PendingFree pf{b, {}};
  if (!b->uses.empty()) {
    pf.events.reserve(b->uses.size());
    spare_events_.reserve(spare_events_.size() + b->uses.size());
    try {
      for (Stream s : b->uses) {
        pf.events.push_back(take_event_locked());
        device_.record_event(pf.events.back(), s);
      }
    } catch (...) {
      for (Event e : pf.events) spare_events_.push_back(e);
      throw;
    }
    pending_.reserve(pending_.size() + 1);
  }

  allocated_.erase(addr);
  b->allocated = false;
  update_stat(stats_.allocation, b->small, -1);
  update_stat(stats_.allocated_bytes, b->small, -static_cast<std::int64_t>(b->size));
  update_stat(stats_.requested_bytes, b->small, -static_cast<std::int64_t>(b->requested));
  history_.record(TraceAction::free_requested, b->addr, b->size, b->stream);
  observe_locked();
  if (!pf.events.empty()) {
    b->uses.clear();
    b->pending_events = static_cast<int>(pf.events.size());
    pending_.push_back(std::move(pf));
    return;
  }
  free_block_locked(b);
}

void CachingAllocator::Impl::free_block_locked(Block* b) {
  MEMTIDE_ASSERT(!b->allocated);
  update_stat(stats_.active, b->small, -1);
  update_stat(stats_.active_bytes, b->small, -static_cast<std::int64_t>(b->size));
  history_.record(TraceAction::free_completed, b->addr, b->size, b->stream);
  b->pending_events = 0;
  b->requested = 0;
  // Coalesce with free neighbours; the lower-addressed block survives so a segment's head never
  // changes.
  if (Block* p = b->prev; p != nullptr && !p->allocated && p->pending_events == 0) {
    remove_free_locked(p);
    p->size += b->size;
    p->next = b->next;
    if (p->next != nullptr) p->next->prev = p;
    recycle_block_locked(b);
    b = p;
  }
  if (Block* n = b->next; n != nullptr && !n->allocated && n->pending_events == 0) {
    remove_free_locked(n);
    b->size += n->size;
    b->next = n->next;
    if (b->next != nullptr) b->next->prev = b;
    recycle_block_locked(n);
  }
  insert_free_locked(b);
}

void CachingAllocator::Impl::process_pending_locked(bool wait) {
  if (wait && !pending_.empty()) ++stats_.num_sync_all_streams;
  for (auto it = pending_.begin(); it != pending_.end();) {
    bool done = true;
    for (Event e : it->events) {
      if (wait) {
        device_.event_synchronize(e);
      } else if (!device_.event_query(e)) {
        done = false;
        break;
      }
    }
    if (!done) {
      ++it;
      continue;
    }
    for (Event e : it->events) spare_events_.push_back(e);
    Block* b = it->block;
    it = pending_.erase(it);
    free_block_locked(b);
  }
}

void CachingAllocator::record_stream(void* ptr, Stream stream) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  Impl::Block** found = m.allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr) throw InvalidArgument("memtide: record_stream on a pointer that is not allocated here");
  Impl::Block* b = *found;
  if (stream == b->stream) return;  // its own stream is ordered already
  if (std::find(b->uses.begin(), b->uses.end(), stream) != b->uses.end()) return;
  // An event recorded on the stream now proves the device knows it: a bad handle fails here,
  // naming the call that passed it, rather than in the free that would need it.
  const Event probe = m.take_event_locked();
  try {
    m.device_.record_event(probe, stream);
  } catch (...) {
    m.spare_events_.push_back(probe);
    throw;
  }
  m.spare_events_.push_back(probe);
  b->uses.push_back(stream);
}

}  // namespace memtide
