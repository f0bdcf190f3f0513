#pragma once
/// @file
/// The unbound SlabSource: slabs from plain anonymous mmap, not bound to a NUMA node, optionally
/// page-locked with a Device. HostArena is the NUMA-bound source for production; this one serves
/// tests, benchmarks and machines where placement does not matter.

#include <cstddef>
#include <mutex>
#include <unordered_map>

#include "memtide/allocator/host_slab.hpp"

namespace memtide {

class Device;

/// Slabs from anonymous mmap. Thread-safe. Pages are not touched here: the first write to each
/// page faults it in. With a Device, each slab is registered (page-locked) when mapped and
/// unregistered before it is unmapped.
class MmapSlabSource final : public SlabSource {
 public:
  /// `device` may be null (slabs are plain pageable memory, `registered` = false). When given, it
  /// must outlive this source.
  explicit MmapSlabSource(Device* device = nullptr) : device_(device) {}
  /// Slabs still mapped are unmapped.
  ~MmapSlabSource() override;

  /// Slabs currently mapped, and their bytes.
  [[nodiscard]] std::size_t slab_count() const;
  [[nodiscard]] std::size_t mapped_bytes() const;

 private:
  HostSlab do_map_slab(std::size_t bytes, std::size_t alignment) override;
  void do_unmap_slab(const HostSlab& slab) override;

  struct Mapping {
    void* base;          ///< what mmap returned (before alignment)
    std::size_t length;  ///< what was mapped
    HostSlab slab;
  };
  Device* device_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Mapping> mappings_;  ///< keyed by slab.ptr
  std::size_t mapped_bytes_ = 0;
};

}  // namespace memtide
