#include "memtide/allocator/caching_allocator.hpp"

#include <algorithm>
#include <chrono>
#include <limits>

#include "memtide/core/assert.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"

namespace memtide {
namespace {

// PyTorch's caching allocator constants; matching them keeps fragmentation behaviour familiar.
constexpr std::size_t kRound = 512;
constexpr std::size_t kSmallSize = 1ULL << 20;         // requests <= 1 MiB use the small pool
constexpr std::size_t kSmallSegment = 2ULL << 20;      // small pool segment size
constexpr std::size_t kMediumLimit = 10ULL << 20;      // requests < 10 MiB share 20 MiB segments
constexpr std::size_t kMediumSegment = 20ULL << 20;
constexpr std::size_t kLargeRound = 2ULL << 20;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::uint64_t stream_id(Stream s) { return reinterpret_cast<std::uint64_t>(s.handle); }

double wall_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace

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
// DirectResource

void* DirectResource::do_allocate(std::size_t bytes, Stream /*stream*/) { return device_.allocate(bytes); }
void DirectResource::do_deallocate(void* ptr, Stream /*stream*/) { device_.deallocate(ptr, 0); }

// ---------------------------------------------------------------------------------------------
// CachingAllocator: construction and bookkeeping

bool CachingAllocator::BlockLess::operator()(const Block* a, const Block* b) const noexcept {
  if (a->stream.handle != b->stream.handle) return a->stream.handle < b->stream.handle;
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

CachingAllocator::CachingAllocator(Device& device, AllocatorConfig config)
    : device_(device), config_(config), tracker_(config.phase_history) {
  if (!(config_.memory_fraction > 0.0 && config_.memory_fraction <= 1.0)) {
    throw InvalidArgument("CachingAllocator: memory_fraction " + std::to_string(config_.memory_fraction) +
                          " is outside (0, 1]");
  }
  limit_ = compute_limit_locked();
  tracker_.set_limit(limit_);
  if (config_.record_history) trace_.reserve(std::min<std::size_t>(config_.history_entries, 1 << 16));
  if (config_.expandable_segments) {
    granule_ = device_.vmm_granularity();
    if (granule_ == 0) {
      MEMTIDE_LOG(info, "CachingAllocator: " + device_.properties().name +
                            " has no virtual memory management; expandable segments are off");
    }
  }
}

CachingAllocator::~CachingAllocator() {
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

std::uint64_t CachingAllocator::compute_limit_locked() const {
  const double total = static_cast<double>(device_.properties().total_memory);
  auto limit = static_cast<std::uint64_t>(total * config_.memory_fraction);
  if (config_.max_bytes != 0) limit = std::min(limit, config_.max_bytes);
  return limit;
}

CachingAllocator::Block* CachingAllocator::new_block_locked() {
  if (!spare_blocks_.empty()) {
    Block* b = spare_blocks_.back();
    spare_blocks_.pop_back();
    return b;
  }
  return &block_storage_.emplace_back();
}

void CachingAllocator::recycle_block_locked(Block* block) {
  // Keep the stashed container nodes: the next block made from this one reuses them.
  block->prev = block->next = nullptr;
  block->allocated = false;
  block->pending_events = 0;
  block->uses.clear();
  spare_blocks_.push_back(block);
}

Event CachingAllocator::take_event_locked() {
  if (!spare_events_.empty()) {
    Event e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  return device_.create_event(/*timing=*/false);
}

void CachingAllocator::trace_locked(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream) {
  if (!config_.record_history) return;
  TraceEntry e{action, addr, size, stream_id(stream), static_cast<std::int64_t>(wall_ns() / 1e3)};
  if (trace_.size() < config_.history_entries) {
    trace_.push_back(e);
  } else {
    trace_[trace_next_] = e;
    trace_next_ = (trace_next_ + 1) % trace_.size();
    trace_wrapped_ = true;
  }
}

// A free block that shares its segment with other blocks counts as an inactive split.
void CachingAllocator::insert_free_locked(Block* block) {
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

void CachingAllocator::remove_free_locked(Block* block) {
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

CachingAllocator::Pool& CachingAllocator::pool_for_locked(Stream stream) {
  for (auto& [pool, filter] : routes_) {
    if (!filter || filter(stream)) return *pool;
  }
  return default_pool_;
}

CachingAllocator::Pool* CachingAllocator::find_pool_locked(PoolId id) const {
  auto it = private_pools_.find(id);
  return it == private_pools_.end() ? nullptr : it->second.get();
}

CachingAllocator::Block* CachingAllocator::find_free_locked(Pool& pool, bool small, Stream stream, std::size_t size) {
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

CachingAllocator::Block* CachingAllocator::alloc_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size) {
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
  trace_locked(TraceAction::segment_alloc, b->addr, seg, stream);
  return b;
}

CachingAllocator::Block* CachingAllocator::steal_segment_locked(Pool& pool, bool small, Stream stream, std::size_t size) {
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

void CachingAllocator::release_segment_locked(Block* head) {
  const std::uintptr_t addr = head->addr;
  const std::size_t size = head->size;
  const bool small = head->small;
  device_.deallocate(reinterpret_cast<void*>(addr), size);
  ++stats_.num_device_free;
  --head->pool->segments;
  segments_.erase(addr);
  update_stat(stats_.segment, small, -1);
  update_stat(stats_.reserved_bytes, small, -static_cast<std::int64_t>(size));
  trace_locked(TraceAction::segment_free, addr, size, head->stream);
  recycle_block_locked(head);
}

void CachingAllocator::release_free_segments_locked(Pool& pool) {
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

void CachingAllocator::release_cached_locked() {
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

CachingAllocator::Block* CachingAllocator::split_locked(Block* block, std::size_t size) {
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

void* CachingAllocator::do_allocate(std::size_t bytes, Stream stream) {
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
    const std::uint64_t given = reclaim(size, loans);
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
  trace_locked(TraceAction::alloc, b->addr, b->size, stream);
  return reinterpret_cast<void*>(b->addr);
}

namespace {
// Set while this thread asks the lenders: an allocation a lender makes meanwhile does not ask again.
thread_local bool t_reclaiming = false;
}  // namespace

std::uint64_t CachingAllocator::add_lender(Lender lender) {
  std::lock_guard lock(lenders_mutex_);
  const std::uint64_t id = next_lender_++;
  lenders_.emplace_back(id, std::move(lender));
  return id;
}

void CachingAllocator::remove_lender(std::uint64_t id) {
  std::lock_guard lock(lenders_mutex_);
  lenders_.erase(std::remove_if(lenders_.begin(), lenders_.end(), [&](const auto& l) { return l.first == id; }),
                 lenders_.end());
}

std::uint64_t CachingAllocator::reclaim(std::uint64_t needed, std::string& loans) {
  if (t_reclaiming) return 0;
  t_reclaiming = true;
  struct Reset {
    ~Reset() { t_reclaiming = false; }
  } reset;
  std::uint64_t given = 0;
  try {
    std::lock_guard lock(lenders_mutex_);
    for (auto& [id, lender] : lenders_) {
      if (lender.give_back) given += lender.give_back(needed);
      const std::uint64_t still = lender.borrowed ? lender.borrowed() : 0;
      if (still > 0) loans += (loans.empty() ? "" : ", ") + lender.name + " " + format_bytes(still);
    }
  } catch (const std::exception& e) {
    // A lender that fails to give back leaves the allocation to fail as it would have.
    MEMTIDE_LOG(warn, std::string("CachingAllocator: a lender could not give memory back: ") + e.what());
  }
  if (given > 0) {
    MEMTIDE_LOG(info, "CachingAllocator: out of memory; lenders gave back " + format_bytes(given) + " and the allocation is retried");
  }
  return given;
}

void CachingAllocator::throw_oom_locked(std::size_t bytes, Stream stream, const std::string& loans) {
  ++stats_.num_ooms;
  trace_locked(TraceAction::oom, 0, bytes, stream);
  MemInfo mem{};
  try {
    mem = device_.mem_info();
  } catch (const Error&) {
    // The message is still useful without the device's own view.
  }
  const auto allocated = static_cast<std::uint64_t>(stats_.allocated_bytes[0].current);
  const auto reserved = static_cast<std::uint64_t>(stats_.reserved_bytes[0].current);
  std::string msg = "memtide: out of memory on " + device_.properties().backend + " device " +
                    std::to_string(device_.properties().index) + ": tried to allocate " + format_bytes(bytes) +
                    ". Limit " + format_bytes(limit_) + "; allocated " + format_bytes(allocated) + ", reserved " +
                    format_bytes(reserved) + " (" + format_bytes(reserved - allocated) +
                    " cached in fragments too small or on other streams); device free " + format_bytes(mem.free) +
                    " of " + format_bytes(mem.total) + ". Current phase: " + phase_name(tracker_.phase()) + ".";
  const auto& history = tracker_.history();
  if (!history.empty()) {
    msg += " Peak allocated in the last iteration:";
    const IterationRecord& last = history.back();
    for (int i = 0; i < kPhaseCount; ++i) {
      const PhaseWatermark& w = last.phases[i];
      if (w.seen) msg += std::string(" ") + phase_name(static_cast<Phase>(i)) + " " + format_bytes(w.peak_allocated) + ";";
    }
  } else {
    msg += " No training iteration has completed yet (no phase history).";
  }
  msg += loans.empty() ? " Nothing is on loan to tiering."
                       : " Still on loan to tiering after asking for it back: " + loans + ".";
  msg += " Lower the batch size, or raise MEMTIDE_MEMORY_FRACTION / MEMTIDE_MAX_BYTES if they are set.";
  throw OutOfMemory(msg);
}

// ---------------------------------------------------------------------------------------------
// Free

void CachingAllocator::do_deallocate(void* ptr, Stream /*stream*/) {
  std::lock_guard lock(mutex_);
  deallocate_locked(ptr, std::nullopt, std::nullopt);
}

void CachingAllocator::deallocate(void* ptr, std::size_t size, Stream stream) {
  if (ptr == nullptr) return;
  std::lock_guard lock(mutex_);
  deallocate_locked(ptr, size, stream);
}

void CachingAllocator::deallocate_locked(void* ptr, std::optional<std::size_t> size, std::optional<Stream> stream) {
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
  trace_locked(TraceAction::free_requested, b->addr, b->size, b->stream);
  observe_locked();
  if (!pf.events.empty()) {
    b->uses.clear();
    b->pending_events = static_cast<int>(pf.events.size());
    pending_.push_back(std::move(pf));
    return;
  }
  free_block_locked(b);
}

void CachingAllocator::free_block_locked(Block* b) {
  MEMTIDE_ASSERT(!b->allocated);
  update_stat(stats_.active, b->small, -1);
  update_stat(stats_.active_bytes, b->small, -static_cast<std::int64_t>(b->size));
  trace_locked(TraceAction::free_completed, b->addr, b->size, b->stream);
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

void CachingAllocator::process_pending_locked(bool wait) {
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
  std::lock_guard lock(mutex_);
  Block** found = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr) throw InvalidArgument("memtide: record_stream on a pointer that is not allocated here");
  Block* b = *found;
  if (stream == b->stream) return;  // its own stream is ordered already
  if (std::find(b->uses.begin(), b->uses.end(), stream) != b->uses.end()) return;
  // An event recorded on the stream now proves the device knows it: a bad handle fails here,
  // naming the call that passed it, rather than in the free that would need it.
  const Event probe = take_event_locked();
  try {
    device_.record_event(probe, stream);
  } catch (...) {
    spare_events_.push_back(probe);
    throw;
  }
  spare_events_.push_back(probe);
  b->uses.push_back(stream);
}

// ---------------------------------------------------------------------------------------------
// Limits, stats, phases, snapshots

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  process_pending_locked(/*wait=*/false);
  release_cached_locked();
}

void CachingAllocator::set_memory_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    throw InvalidArgument("memory fraction " + std::to_string(fraction) + " is outside (0, 1]");
  }
  std::lock_guard lock(mutex_);
  config_.memory_fraction = fraction;
  limit_ = compute_limit_locked();
  tracker_.set_limit(limit_);
}

void CachingAllocator::set_max_bytes(std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  config_.max_bytes = bytes;
  limit_ = compute_limit_locked();
  tracker_.set_limit(limit_);
}

double CachingAllocator::memory_fraction() const {
  std::lock_guard lock(mutex_);
  return config_.memory_fraction;
}

std::uint64_t CachingAllocator::limit() const {
  std::lock_guard lock(mutex_);
  return limit_;
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard lock(mutex_);
  stats_.for_each_array([](const char*, StatArray& a) {
    for (Stat& s : a) s.reset_peak();
  });
}

void CachingAllocator::reset_accumulated_stats() {
  std::lock_guard lock(mutex_);
  stats_.for_each_array([](const char*, StatArray& a) {
    for (Stat& s : a) s.reset_accumulated();
  });
  stats_.num_alloc_retries = stats_.num_ooms = stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = stats_.num_device_free = stats_.num_invalid_frees = 0;
  stats_.num_cross_stream_reuse = 0;
}

void CachingAllocator::mark_phase(Phase phase) {
  std::lock_guard lock(mutex_);
  const double now = wall_ns();
  tracker_.mark(phase, static_cast<std::uint64_t>(stats_.allocated_bytes[0].current),
                static_cast<std::uint64_t>(stats_.reserved_bytes[0].current), now);
  if (config_.record_history) {
    phase_marks_.push_back({static_cast<std::int64_t>(now / 1e3), phase});
    while (phase_marks_.size() > std::max<std::size_t>(config_.history_entries / 16, 1)) phase_marks_.pop_front();
  }
}

std::vector<CachingAllocator::PhaseMark> CachingAllocator::phase_marks() const {
  std::lock_guard lock(mutex_);
  return {phase_marks_.begin(), phase_marks_.end()};
}

Phase CachingAllocator::phase() const {
  std::lock_guard lock(mutex_);
  return tracker_.phase();
}

Headroom CachingAllocator::headroom(Phase until, std::optional<std::uint64_t> margin) const {
  std::lock_guard lock(mutex_);
  return tracker_.headroom(until, static_cast<std::uint64_t>(stats_.allocated_bytes[0].current),
                           margin.value_or(config_.headroom_margin));
}

PhaseReport CachingAllocator::phase_report() const {
  std::lock_guard lock(mutex_);
  PhaseReport r;
  r.current = tracker_.phase();
  r.iterations = tracker_.iterations();
  r.running = tracker_.current();
  r.history.assign(tracker_.history().begin(), tracker_.history().end());
  return r;
}

void CachingAllocator::set_record_history(bool enabled) {
  std::lock_guard lock(mutex_);
  config_.record_history = enabled;
  if (!enabled) {
    trace_.clear();
    phase_marks_.clear();
    trace_next_ = 0;
    trace_wrapped_ = false;
  }
}

// ---------------------------------------------------------------------------------------------
// Expandable segments

CachingAllocator::Block* CachingAllocator::grow_expandable_locked(Stream stream, std::size_t size) {
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
  trace_locked(TraceAction::segment_map, at, bytes, stream);
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

void CachingAllocator::trim_expandable_locked() {
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
    trace_locked(TraceAction::segment_unmap, from, bytes, x.stream);
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

// ---------------------------------------------------------------------------------------------
// Private pools

void CachingAllocator::create_or_incref_pool(PoolId id) {
  if (id == PoolId{0, 0}) throw InvalidArgument("memtide: pool id (0, 0) is the default pool, not a private one");
  std::lock_guard lock(mutex_);
  std::unique_ptr<Pool>& pool = private_pools_[id];
  if (!pool) {
    pool = std::make_unique<Pool>();
    pool->id = id;
  }
  ++pool->use_count;
}

void CachingAllocator::begin_allocate_to_pool(PoolId id, std::function<bool(Stream)> filter) {
  if (id == PoolId{0, 0}) throw InvalidArgument("memtide: pool id (0, 0) is the default pool, not a private one");
  std::lock_guard lock(mutex_);
  if (Pool* p = find_pool_locked(id)) {
    for (const auto& route : routes_) {
      if (route.first == p) {
        throw InvalidArgument("memtide: already allocating to pool (" + std::to_string(id.first) + ", " +
                              std::to_string(id.second) + ")");
      }
    }
  }
  routes_.reserve(routes_.size() + 1);
  std::unique_ptr<Pool>& pool = private_pools_[id];
  if (!pool) {
    pool = std::make_unique<Pool>();
    pool->id = id;
  }
  ++pool->use_count;
  routes_.emplace_back(pool.get(), std::move(filter));
}

void CachingAllocator::end_allocate_to_pool(PoolId id) {
  std::lock_guard lock(mutex_);
  Pool* pool = find_pool_locked(id);
  auto it = std::find_if(routes_.begin(), routes_.end(), [&](const auto& r) { return pool != nullptr && r.first == pool; });
  if (it == routes_.end()) {
    throw InvalidArgument("memtide: end_allocate_to_pool(" + std::to_string(id.first) + ", " + std::to_string(id.second) +
                          ") without a matching begin_allocate_to_pool");
  }
  routes_.erase(it);
}

void CachingAllocator::release_pool(PoolId id) {
  std::lock_guard lock(mutex_);
  Pool* pool = find_pool_locked(id);
  if (pool == nullptr || pool->use_count == 0) {
    throw InvalidArgument("memtide: release_pool(" + std::to_string(id.first) + ", " + std::to_string(id.second) +
                          ") of a pool that is not held");
  }
  if (--pool->use_count > 0) return;
  process_pending_locked(/*wait=*/false);
  release_cached_locked();
}

int CachingAllocator::pool_use_count(PoolId id) const {
  std::lock_guard lock(mutex_);
  const Pool* pool = find_pool_locked(id);
  return pool == nullptr ? 0 : pool->use_count;
}

std::size_t CachingAllocator::largest_free_block() const {
  std::lock_guard lock(mutex_);
  std::size_t largest = 0;
  for (const FreeSet* set : {&default_pool_.small_free, &default_pool_.large_free}) {
    for (const Block* b : *set) largest = std::max(largest, b->size);
  }
  // What a new segment could still get: the limit's remainder, bounded by what the device has.
  const auto reserved = static_cast<std::uint64_t>(stats_.reserved_bytes[0].current);
  std::uint64_t room = limit_ > reserved ? limit_ - reserved : 0;
  try {
    room = std::min<std::uint64_t>(room, device_.mem_info().free);
  } catch (const Error&) {
    room = 0;  // no device view: only what is cached counts
  }
  return std::max<std::size_t>(largest, static_cast<std::size_t>(room));
}

std::optional<std::pair<void*, std::size_t>> CachingAllocator::segment_of(void* ptr) const {
  std::lock_guard lock(mutex_);
  Block* const* found = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr) return std::nullopt;
  const Block* head = *found;
  while (head->prev != nullptr) head = head->prev;
  return std::pair{reinterpret_cast<void*>(head->addr), segments_.at(head->addr).size};
}

bool CachingAllocator::record_history() const {
  std::lock_guard lock(mutex_);
  return config_.record_history;
}

std::optional<std::size_t> CachingAllocator::allocation_size(void* ptr) const {
  std::lock_guard lock(mutex_);
  Block* const* found = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (found == nullptr) return std::nullopt;
  return (*found)->size;
}

Snapshot CachingAllocator::snapshot() const {
  std::lock_guard lock(mutex_);
  Snapshot snap;
  std::vector<const Segment*> order;
  order.reserve(segments_.size());
  for (const auto& [addr, seg] : segments_) order.push_back(&seg);
  std::sort(order.begin(), order.end(), [](const Segment* a, const Segment* b) { return a->head->addr < b->head->addr; });
  for (const Segment* seg : order) {
    SegmentSnapshot s;
    s.device = device_.properties().index;
    s.address = seg->head->addr;
    s.total_size = seg->size;
    s.stream = stream_id(seg->head->stream);
    s.small = seg->head->small;
    s.expandable = seg->head->expandable;
    s.pool_first = seg->head->pool->id.first;
    s.pool_second = seg->head->pool->id.second;
    for (const Block* b = seg->head; b != nullptr; b = b->next) {
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
  std::vector<TraceEntry> trace;
  if (trace_wrapped_) {
    trace.assign(trace_.begin() + static_cast<std::ptrdiff_t>(trace_next_), trace_.end());
    trace.insert(trace.end(), trace_.begin(), trace_.begin() + static_cast<std::ptrdiff_t>(trace_next_));
  } else {
    trace = trace_;
  }
  snap.device_traces.push_back(std::move(trace));
  return snap;
}

}  // namespace memtide
