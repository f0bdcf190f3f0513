#pragma once
/// @file
/// The process-wide runtime behind the C ABI and the Python module: one CachingAllocator per
/// device, created on first use from the options table, and never destroyed (see NoDestructor).

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/no_destructor.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/device/device.hpp"
#include "memtide/device/topology.hpp"

namespace memtide {

class Runtime {
 public:
  /// The runtime, created on first call. Throws ConfigError for bad options.
  static Runtime& get();

  [[nodiscard]] Backend backend() const noexcept { return backend_; }
  [[nodiscard]] int device_count() const noexcept { return static_cast<int>(slots_.size()); }
  /// The allocator of `device`, opened on first use. Throws InvalidArgument for a bad index.
  CachingAllocator& allocator(int device);
  /// Allocators opened so far (null for devices never used).
  std::vector<CachingAllocator*> opened();
  /// `device`'s allocator if it is open, else null (also for a bad index); one load, no lock.
  [[nodiscard]] CachingAllocator* opened(int device) const noexcept {
    if (device < 0 || device >= device_count()) return nullptr;
    return slots_[static_cast<std::size_t>(device)]->ready.load(std::memory_order_acquire);
  }

  /// The NUMA node whose memory serves `device`'s pinned host buffers; -1 = not bound. The one
  /// place that maps a GPU to a node: MEMTIDE_HOST_NODE when set, else (CUDA) the GPU's nearest
  /// node from the Topology, else -1 (SimDevice has no PCI locality). Throws InvalidArgument for a
  /// bad index.
  int host_node(int device) const;
  /// The machine's topology, discovered on first use (MEMTIDE_TOPOLOGY honoured).
  const Topology& topology() const;
  /// The pinned host arena of `device` on `numa_node` (-1 = not bound; by default host_node),
  /// created on first use with slabs registered with the device. Throws InvalidArgument for a bad
  /// device or node.
  HostArena& host_arena(int device);
  HostArena& host_arena(int device, int numa_node);
  /// Returns a buffer to whichever host arena handed it out. Throws InvalidArgument when none did.
  void host_free(void* ptr);
  /// Every host arena created so far.
  std::vector<HostArena*> host_arenas();
  /// The workers for `device`'s host-side work (first-touching its slabs, the CPU optimizer
  /// step): on a GPU, bound to its share of its local cpus among the ranks on this machine
  /// (Topology::cpu_share with ranks_on_node()); on a SimDevice, the process's default pool.
  ThreadPool& host_pool(int device);
  /// Ranks of the job on this machine, each on its own GPU: the `local_ranks` option when set,
  /// else torchrun's LOCAL_WORLD_SIZE, else 1.
  [[nodiscard]] int ranks_on_node() const;

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

 private:
  friend class NoDestructor<Runtime>;
  Runtime();
  struct Slot {
    std::once_flag once;
    std::unique_ptr<Device> device;
    std::unique_ptr<CachingAllocator> allocator;
    std::atomic<CachingAllocator*> ready{nullptr};  ///< published once `allocator` is built
    std::mutex host_mutex;                              ///< guards host
    std::map<int, std::unique_ptr<HostArena>> host;     ///< by NUMA node (-1 = not bound)
  };
  Slot& slot(int device) const;
  Backend backend_;
  mutable std::once_flag topology_once_;
  mutable std::unique_ptr<Topology> topology_;
  std::mutex host_pools_mutex_;
  std::map<int, std::unique_ptr<ThreadPool>> host_pools_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace memtide
