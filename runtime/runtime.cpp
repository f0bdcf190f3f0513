#include "memtide/runtime/runtime.hpp"

#include <cstdlib>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/job.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/no_destructor.hpp"
#include "memtide/core/options.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/device/topology.hpp"

namespace memtide {

Runtime& Runtime::get() {
  static NoDestructor<Runtime> runtime;
  return *runtime;
}

Runtime::Runtime() : backend_(resolve_backend(parse_backend(options().device))) {
  const int n = memtide::device_count(backend_);
  for (int i = 0; i < n; ++i) slots_.push_back(std::make_unique<Slot>());
  MEMTIDE_LOG(info, std::string("runtime: backend ") + (backend_ == Backend::cuda ? "cuda" : "sim") + ", " +
                        std::to_string(n) + " device(s)");
}

Runtime::Slot& Runtime::slot(int device) const {
  if (device < 0 || device >= device_count()) {
    throw InvalidArgument("device index " + std::to_string(device) + " out of range: " +
                          std::to_string(device_count()) + " device(s)");
  }
  return *slots_[static_cast<std::size_t>(device)];
}

CachingAllocator& Runtime::allocator(int device) {
  Slot& slot = this->slot(device);
  // Every tensor of torch comes through here: once made, one acquire load (call_once costs
  // more than the rest of the ABI's overhead).
  if (CachingAllocator* made = slot.ready.load(std::memory_order_acquire)) return *made;
  std::call_once(slot.once, [&] {
    slot.device = open_device(backend_, device);
    slot.allocator = std::make_unique<CachingAllocator>(*slot.device, AllocatorConfig::from_options());
    slot.ready.store(slot.allocator.get(), std::memory_order_release);
  });
  return *slot.allocator;
}

std::vector<CachingAllocator*> Runtime::opened() {
  std::vector<CachingAllocator*> out;
  for (auto& slot : slots_) out.push_back(slot->ready.load(std::memory_order_acquire));
  return out;
}

const Topology& Runtime::topology() const {
  std::call_once(topology_once_, [this] { topology_ = std::make_unique<Topology>(Topology::discover()); });
  return *topology_;
}

int Runtime::host_node(int device) const {
  (void)slot(device);  // validates the index
  if (options().host_node >= 0) return options().host_node;
  if (backend_ != Backend::cuda) return -1;
  const Topology& topo = topology();
  if (device >= static_cast<int>(topo.gpus().size())) {
    MEMTIDE_LOG(warn, "runtime: GPU " + std::to_string(device) + " is not in the topology (" + topo.source() +
                          "); its pinned host memory is not bound to a NUMA node");
    return -1;
  }
  return topo.preferred_node(device);
}

int Runtime::ranks_on_node() const {
  if (options().local_ranks > 0) return options().local_ranks;
  return job_local_world_size().value_or(1);
}

ThreadPool& Runtime::host_pool(int device) {
  if (backend_ != Backend::cuda) return default_pool();
  std::lock_guard lock(host_pools_mutex_);
  std::unique_ptr<ThreadPool>& pool = host_pools_[device];
  if (!pool) {
    const Topology& topo = topology();
    if (device >= static_cast<int>(topo.gpus().size())) return default_pool();
    pool = make_gpu_pool(topo, device, 0, ranks_on_node());
  }
  return *pool;
}

HostArena& Runtime::host_arena(int device) { return host_arena(device, host_node(device)); }

HostArena& Runtime::host_arena(int device, int numa_node) {
  allocator(device);  // opens the device, whose registration the slabs use
  Slot& s = slot(device);
  std::lock_guard lock(s.host_mutex);
  std::unique_ptr<HostArena>& arena = s.host[numa_node];
  if (!arena) {
    HostArenaConfig config = HostArenaConfig::from_options();
    config.numa_node = numa_node;
    config.device = s.device.get();
    // Pages land on the node by mbind either way; touching from the GPU's own cores keeps the
    // touch off the interconnect.
    config.toucher = &host_pool(device);
    try {
      arena = std::make_unique<HostArena>(config);
    } catch (...) {
      s.host.erase(numa_node);
      throw;
    }
  }
  return *arena;
}

void Runtime::host_free(void* ptr) {
  for (HostArena* arena : host_arenas()) {
    if (arena->allocation_size(ptr) != 0) {
      arena->deallocate(ptr);
      return;
    }
  }
  throw InvalidArgument("pointer is not a live pinned host buffer of memtide (never allocated by memtide_host_alloc, or freed already)");
}

std::vector<HostArena*> Runtime::host_arenas() {
  std::vector<HostArena*> out;
  for (auto& s : slots_) {
    std::lock_guard lock(s->host_mutex);
    for (auto& [node, arena] : s->host) out.push_back(arena.get());
  }
  return out;
}

}  // namespace memtide
