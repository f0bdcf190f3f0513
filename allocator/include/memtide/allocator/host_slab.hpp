#pragma once
/// @file
/// Large pinned host regions ("slabs") and the interface that hands them out.
///
/// HostArena maps slabs (mmap, mbind to a NUMA node, parallel first touch, one host registration
/// per slab) and sub-allocates optimizer buffers from them. PinnedHeap asks a SlabSource for
/// whole slabs and lets jemalloc or mimalloc carve them into small and medium staging buffers.
/// The interface keeps PinnedHeap independent of how slabs are made, so its tests can run over
/// plain mmap'ed memory as well as over HostArena.

#include <cstddef>

namespace memtide {

/// One contiguous pinned host region.
struct HostSlab {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  int numa_node = -1;       ///< node the pages were placed on; -1 = not bound
  bool registered = false;  ///< page-locked with the Device (cudaHostRegister or SimDevice's)
};

/// Hands out whole slabs. Implementations are thread-safe.
class SlabSource {
 public:
  virtual ~SlabSource() = default;
  SlabSource() = default;
  SlabSource(const SlabSource&) = delete;
  SlabSource& operator=(const SlabSource&) = delete;

  /// A slab of at least `bytes`, aligned to `alignment` (a power of two). Throws OutOfMemory
  /// when none can be made, InvalidArgument for a zero size or a bad alignment.
  HostSlab map_slab(std::size_t bytes, std::size_t alignment) { return do_map_slab(bytes, alignment); }
  /// Gives back a slab from map_slab (unregistered and unmapped).
  void unmap_slab(const HostSlab& slab) { do_unmap_slab(slab); }

 private:
  virtual HostSlab do_map_slab(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_unmap_slab(const HostSlab& slab) = 0;
};

}  // namespace memtide
