#pragma once
// Private pieces of PinnedHeap shared by its backends (not installed, not public API).

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "memtide/allocator/host_slab.hpp"

namespace memtide::detail {

/// The slabs one PinnedHeap mapped from its source. Thread-safe.
class SlabPool {
 public:
  explicit SlabPool(SlabSource& source) : source_(source) {}
  /// Unmaps every slab, unless keep_mapped() was called.
  ~SlabPool();
  SlabPool(const SlabPool&) = delete;
  SlabPool& operator=(const SlabPool&) = delete;

  HostSlab map(std::size_t bytes, std::size_t alignment);
  /// Gives one slab back at once (a slab a backend could not use).
  void unmap(const HostSlab& slab);
  /// The slabs stay mapped when the pool is destroyed: memory a library still refers to.
  void keep_mapped() noexcept;

  [[nodiscard]] std::size_t reserved() const;
  [[nodiscard]] std::size_t reserved_peak() const;
  [[nodiscard]] std::size_t count() const;
  [[nodiscard]] std::vector<HostSlab> slabs() const;

 private:
  SlabSource& source_;
  mutable std::mutex mutex_;
  std::vector<HostSlab> slabs_;
  std::size_t reserved_ = 0;
  std::size_t reserved_peak_ = 0;
  bool keep_ = false;
};

/// Cuts address ranges out of slabs: best fit by size, coalescing freed neighbours within a
/// slab (never across two slabs that happen to be adjacent in the address space). Maps a new
/// slab from the pool when nothing fits. Thread-safe. Sizes and alignments are in multiples of
/// `granule` (a power of two).
class SlabRanges {
 public:
  SlabRanges(SlabPool& pool, std::size_t slab_bytes, std::size_t granule)
      : pool_(pool), slab_bytes_(slab_bytes), granule_(granule) {}

  struct Free {
    std::size_t bytes;
    std::uintptr_t slab;  // start of the slab the range lies in
  };
  /// The map nodes of one free range, allocated before anything changes: every operation makes
  /// the ones it may need first, so none can fail half-way (the strong guarantee).
  struct Spare {
    std::map<std::uintptr_t, Free>::node_type addr;
    std::set<std::pair<std::size_t, std::uintptr_t>>::node_type size;
    static Spare make();
  };

  /// A free range of `bytes` aligned to `alignment`; maps a slab if needed (throws OutOfMemory).
  void* take(std::size_t bytes, std::size_t alignment);
  /// Takes exactly [addr, addr + bytes) when all of it is free; false otherwise.
  bool take_at(void* addr, std::size_t bytes);
  /// Returns a range from take/take_at.
  void give(void* addr, std::size_t bytes) { give(addr, bytes, Spare::make()); }
  /// As give(addr, bytes), with the nodes made beforehand: cannot fail.
  void give(void* addr, std::size_t bytes, Spare spare) noexcept;
  /// True when [a, a + a_bytes) and [b, ...) lie in the same slab.
  [[nodiscard]] bool same_slab(const void* a, const void* b) const;
  [[nodiscard]] std::size_t granule() const noexcept { return granule_; }

 private:
  void insert_free(std::uintptr_t start, std::size_t bytes, std::uintptr_t slab, Spare& spare) noexcept;
  void erase_free(std::map<std::uintptr_t, Free>::iterator it);
  [[nodiscard]] std::uintptr_t slab_of(std::uintptr_t addr) const;  // 0 when none

  static constexpr std::size_t kFirstSlab = std::size_t{32} << 20;
  SlabPool& pool_;
  const std::size_t slab_bytes_;
  const std::size_t granule_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Free> by_addr_;
  std::set<std::pair<std::size_t, std::uintptr_t>> by_size_;
  std::map<std::uintptr_t, std::uintptr_t> slab_ends_;  // slab start -> end
};

/// One library's way of carving slabs.
class Engine {
 public:
  virtual ~Engine() = default;
  /// Null only never: throws OutOfMemory (or the source's error) when no slab can be mapped.
  virtual void* allocate(std::size_t bytes, std::size_t alignment) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept = 0;
};

/// Load the library (once per process); false with the reason when it cannot be used.
bool jemalloc_available(std::string* why);
bool mimalloc_available(std::string* why);
/// Throw Error with that reason when unavailable. jemalloc's extents come from `ranges`, the
/// same ranges the heap cuts its direct (large) requests from, so both share the slabs' room.
std::unique_ptr<Engine> make_jemalloc_engine(SlabRanges& ranges);
std::unique_ptr<Engine> make_mimalloc_engine(SlabPool& pool, std::size_t slab_bytes);

}  // namespace memtide::detail
