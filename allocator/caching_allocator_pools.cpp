// Private pools (torch's CUDA graph pools and MemPool): segments that serve only the allocations
// routed to them. Allocation and release find them through Impl::pool_for_locked and
// Impl::release_cached_locked; here they are created, routed to and let go of.

#include <algorithm>

#include "caching_allocator_internal.hpp"
#include "memtide/core/error.hpp"

namespace memtide {
namespace {

void check_private(PoolId id) {
  if (id == PoolId{0, 0}) throw InvalidArgument("memtide: pool id (0, 0) is the default pool, not a private one");
}

}  // namespace

CachingAllocator::Impl::Pool* CachingAllocator::Impl::find_pool_locked(PoolId id) const {
  auto it = private_pools_.find(id);
  return it == private_pools_.end() ? nullptr : it->second.get();
}

CachingAllocator::Impl::Pool& CachingAllocator::Impl::incref_pool_locked(PoolId id) {
  std::unique_ptr<Pool>& pool = private_pools_[id];
  if (!pool) {
    pool = std::make_unique<Pool>();
    pool->id = id;
  }
  ++pool->use_count;
  return *pool;
}

void CachingAllocator::create_or_incref_pool(PoolId id) {
  check_private(id);
  std::lock_guard lock(impl_->mutex_);
  impl_->incref_pool_locked(id);
}

void CachingAllocator::begin_allocate_to_pool(PoolId id, std::function<bool(Stream)> filter) {
  check_private(id);
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  if (Impl::Pool* p = m.find_pool_locked(id)) {
    for (const auto& route : m.routes_) {
      if (route.first == p) {
        throw InvalidArgument("memtide: already allocating to pool (" + std::to_string(id.first) + ", " +
                              std::to_string(id.second) + ")");
      }
    }
  }
  m.routes_.reserve(m.routes_.size() + 1);
  m.routes_.emplace_back(&m.incref_pool_locked(id), std::move(filter));
}

void CachingAllocator::end_allocate_to_pool(PoolId id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  Impl::Pool* pool = m.find_pool_locked(id);
  auto it = std::find_if(m.routes_.begin(), m.routes_.end(),
                         [&](const auto& r) { return pool != nullptr && r.first == pool; });
  if (it == m.routes_.end()) {
    throw InvalidArgument("memtide: end_allocate_to_pool(" + std::to_string(id.first) + ", " + std::to_string(id.second) +
                          ") without a matching begin_allocate_to_pool");
  }
  m.routes_.erase(it);
}

void CachingAllocator::release_pool(PoolId id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex_);
  Impl::Pool* pool = m.find_pool_locked(id);
  if (pool == nullptr || pool->use_count == 0) {
    throw InvalidArgument("memtide: release_pool(" + std::to_string(id.first) + ", " + std::to_string(id.second) +
                          ") of a pool that is not held");
  }
  if (--pool->use_count > 0) return;
  m.process_pending_locked(/*wait=*/false);
  m.release_cached_locked();
}

int CachingAllocator::pool_use_count(PoolId id) const {
  std::lock_guard lock(impl_->mutex_);
  const Impl::Pool* pool = impl_->find_pool_locked(id);
  return pool == nullptr ? 0 : pool->use_count;
}

}  // namespace memtide
