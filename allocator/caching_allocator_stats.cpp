// What the allocator tells and how it is bounded: limits, stats, phases, the allocation history
// and snapshots, and the queries torch's allocator interface asks of it.

#include <algorithm>

#include "caching_allocator_internal.hpp"
#include "memtide/core/error.hpp"

namespace memtide {

// ---------------------------------------------------------------------------------------------
// AllocationHistory

AllocationHistory::AllocationHistory(bool enabled, std::size_t entries) : enabled_(enabled), entries_(entries) {
  if (enabled_) trace_.reserve(std::min<std::size_t>(entries_, 1 << 16));
}

void AllocationHistory::set_enabled(bool enabled) {
  enabled_ = enabled;
  if (!enabled) {
    trace_.clear();
    marks_.clear();
    next_ = 0;
    wrapped_ = false;
  }
}

void AllocationHistory::append(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream) {
  TraceEntry e{action, addr, size, stream_id(stream), static_cast<std::int64_t>(wall_ns() / 1e3)};
  if (trace_.size() < entries_) {
    trace_.push_back(e);
  } else {
    trace_[next_] = e;
    next_ = (next_ + 1) % trace_.size();
    wrapped_ = true;
  }
}

void AllocationHistory::mark(double now_ns, Phase phase) {
  if (!enabled_) return;
  marks_.push_back({static_cast<std::int64_t>(now_ns / 1e3), phase});
  while (marks_.size() > std::max<std::size_t>(entries_ / 16, 1)) marks_.pop_front();
}

std::vector<TraceEntry> AllocationHistory::entries() const {
  if (!wrapped_) return trace_;
  std::vector<TraceEntry> trace(trace_.begin() + static_cast<std::ptrdiff_t>(next_), trace_.end());
  trace.insert(trace.end(), trace_.begin(), trace_.begin() + static_cast<std::ptrdiff_t>(next_));
  return trace;
}

// ---------------------------------------------------------------------------------------------
// Limits and stats

void CachingAllocator::empty_cache() {
  std::lock_guard lock(impl_->mutex_);
  impl_->process_pending_locked(/*wait=*/false);
  impl_->release_cached_locked();
}

void CachingAllocator::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw InvalidArgument("memory fraction " + std::to_string(fraction) + " is outside (0, 1]");
  }
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  m.config_.memory_fraction = fraction;
  m.limit_ = m.compute_limit_locked();
  m.tracker_.set_limit(m.limit_);
}

void CachingAllocator::set_max_bytes(std::uint64_t bytes) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  m.config_.max_bytes = bytes;
  m.limit_ = m.compute_limit_locked();
  m.tracker_.set_limit(m.limit_);
}

double CachingAllocator::memory_fraction() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->config_.memory_fraction;
}

std::uint64_t CachingAllocator::limit() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->limit_;
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->stats_;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard lock(impl_->mutex_);
  impl_->stats_.for_each_array([](const char*, StatArray& a) {
    for (Stat& s : a) s.reset_peak();
  });
}

void CachingAllocator::reset_accumulated_stats() {
  std::lock_guard lock(impl_->mutex_);
  AllocatorStats& stats = impl_->stats_;
  stats.for_each_array([](const char*, StatArray& a) {
    for (Stat& s : a) s.reset_accumulated();
  });
  stats.num_alloc_retries = stats.num_ooms = stats.num_sync_all_streams = 0;
  stats.num_device_alloc = stats.num_device_free = stats.num_invalid_frees = 0;
  stats.num_cross_stream_reuse = 0;
}

std::uint64_t CachingAllocator::headroom_margin() const noexcept { return impl_->config_.headroom_margin; }

bool CachingAllocator::expandable_segments() const noexcept { return impl_->granule_ != 0; }

Device& CachingAllocator::device() noexcept { return impl_->device_; }

// ---------------------------------------------------------------------------------------------
// Phases

void CachingAllocator::mark_phase(Phase phase) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  const double now = wall_ns();
  m.tracker_.mark(phase, static_cast<std::uint64_t>(m.stats_.allocated_bytes[0].current),
                  static_cast<std::uint64_t>(m.stats_.reserved_bytes[0].current), now);
  m.history_.mark(now, phase);
}

Phase CachingAllocator::phase() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->tracker_.phase();
}

Headroom CachingAllocator::headroom(Phase until, std::optional<std::uint64_t> margin) const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  return m.tracker_.headroom(until, static_cast<std::uint64_t>(m.stats_.allocated_bytes[0].current),
                             margin.value_or(m.config_.headroom_margin));
}

PhaseReport CachingAllocator::phase_report() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  PhaseReport r;
  r.current = m.tracker_.phase();
  r.iterations = m.tracker_.iterations();
  r.running = m.tracker_.current();
  r.history.assign(m.tracker_.history().begin(), m.tracker_.history().end());
  return r;
}

// ---------------------------------------------------------------------------------------------
// History and snapshots

void CachingAllocator::set_record_history(bool enabled) {
  std::lock_guard lock(impl_->mutex_);
  impl_->history_.set_enabled(enabled);
}

bool CachingAllocator::record_history() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->history_.enabled();
}

std::vector<CachingAllocator::PhaseMark> CachingAllocator::phase_marks() const {
  std::lock_guard lock(impl_->mutex_);
  return impl_->history_.marks();
}

Snapshot CachingAllocator::snapshot() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  Snapshot snap;
  std::vector<const Impl::Segment*> order;
  order.reserve(m.segments_.size());
  for (const auto& [addr, seg] : m.segments_) order.push_back(&seg);
  std::sort(order.begin(), order.end(),
            [](const Impl::Segment* a, const Impl::Segment* b) { return a->head->addr < b->head->addr; });
  for (const Impl::Segment* seg : order) {
    SegmentSnapshot s;
    s.device = m.device_.properties().index;
    s.address = seg->head->addr;
    s.total_size = seg->size;
    s.stream = stream_id(seg->head->stream);
    s.small = seg->head->small;
    s.expandable = seg->head->expandable;
    s.pool_first = seg->head->pool->id.first;
    s.pool_second = seg->head->pool->id.second;
    for (const Impl::Block* b = seg->head; b != nullptr; b = b->next) {
      BlockSnapshot bs;
      bs.address = b->addr;
      bs.size = b->size;
      bs.requested_size = b->requested;
      bs.state = b->allocated               ? BlockState::active_allocated
                 : b->pending_events > 0    ? BlockState::active_pending_free
                                            : BlockState::inactive;
      if (bs.state == BlockState::active_allocated) s.allocated_size += b->size;
      if (bs.state != BlockState::inactive) {
        s.active_size += b->size;
        s.requested_size += b->requested;
      }
      s.blocks.push_back(bs);
    }
    snap.segments.push_back(std::move(s));
  }
  snap.device_traces.push_back(m.history_.entries());
  return snap;
}

// ---------------------------------------------------------------------------------------------
// Queries

std::size_t CachingAllocator::largest_free_block() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  std::size_t largest = 0;
  for (const Impl::FreeSet* set : {&m.default_pool_.small_free, &m.default_pool_.large_free}) {
    for (const Impl::Block* b : *set) largest = std::max(largest, b->size);
  }
  // What a new segment could still get: the limit's remainder, bounded by what the device has.
  const auto reserved = static_cast<std::uint64_t>(m.stats_.reserved_bytes[0].current);
  std::uint64_t room = m.limit_ > reserved ? m.limit_ - reserved : 0;
  try {
    room = std::min<std::uint64_t>(room, m.device_.mem_info().free);
  } catch (const Error&) {
    room = 0;  // no device view: only what is cached counts
  }
  return std::max<std::size_t>(largest, static_cast<std::size_t>(room));
}

std::optional<std::pair<void*, std::size_t>> CachingAllocator::segment_of(void* ptr) const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  Impl::Block* const* found = m.allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr) return std::nullopt;
  const Impl::Block* head = *found;
  while (head->prev != nullptr) head = head->prev;
  return std::pair{reinterpret_cast<void*>(head->addr), m.segments_.at(head->addr).size};
}

std::optional<std::size_t> CachingAllocator::allocation_size(void* ptr) const {
  std::lock_guard lock(impl_->mutex_);
  Impl::Block* const* found = impl_->allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr) return std::nullopt;
  return (*found)->size;
}

}  // namespace memtide
