#include "memtide/runtime.hpp"

#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/no_destructor.hpp"
#include "memtide/core/options.hpp"
#include "memtide/core/thread_pool.hpp"

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

int Runtime::host_node(int device) const {
  (void)slot(device);  // validates the index
  // For now only the explicit override. The Topology lookup (the GPU's PCI bus id -> its NUMA
  // node, via hwloc or sysfs) is wired in here when device/Topology lands; everything else asks
  // this function, so that is the only change needed.
  return options().host_node;
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
    // The process-wide pool is not bound to the node's cores yet: pages land on the node by
    // mbind either way, only the touch runs slower from remote cores. A pool bound to the
    // device's local cores comes with Topology.
    config.toucher = &default_pool();
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
