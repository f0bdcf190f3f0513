#pragma once
/// @file
/// HostArena: pinned host memory on one NUMA node, carved from a few large slabs.
///
/// Each slab is made in the order that is fast and places pages where they belong: an anonymous
/// private mmap, mbind(MPOL_BIND) to the node, a first touch of every page in parallel on a
/// ThreadPool whose workers run on that node's cores, and one host registration with the Device
/// (cudaHostRegister on CUDA). A few big registrations instead of one per tensor keep the
/// registration cost and the number of kernel mappings small.
///
/// Buffers are sub-allocated best fit (the smallest free block that fits; ties by address) with
/// free neighbours coalesced, so a freed buffer's memory is reused without another slab. Whole
/// slabs are also handed out through SlabSource, for PinnedHeap.
///
/// libnuma is optional: without it (MEMTIDE_HAVE_NUMA undefined), or on a kernel without NUMA,
/// slabs are not bound (one warning) and placement is reported as unknown.

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "memtide/allocator/host_slab.hpp"

namespace memtide {

class Device;
class ThreadPool;

/// How far apart arrays that are streamed together should start within their arena blocks. The
/// arena aligns large blocks to 2 MiB (huge pages), so such arrays would all start at one offset
/// modulo every cache's way size: element i of each maps to one cache set and the streams evict
/// each other. 4 KiB + one line moves each to other sets, with no 4K aliasing between loads and
/// stores (2-core EPYC VM, 64M-element stream probe: 107 ms aligned, 64 ms skewed; torch's own
/// tensors: 68 ms).
inline constexpr std::size_t kStreamSkew = 4096 + 64;

/// What a slab does when its NUMA node has too little memory available for it.
enum class NodeFullPolicy {
  strict,    ///< throw OutOfMemory naming the node and the sizes
  fallback,  ///< log a warning, then place the slab with MPOL_PREFERRED (other nodes allowed)
};

/// Parses "strict" | "fallback". Throws ConfigError.
NodeFullPolicy parse_node_full_policy(const std::string& name);

struct HostArenaConfig {
  int numa_node = -1;                    ///< node the slabs are bound to; -1 = not bound
  std::size_t slab_bytes = 256ULL << 20; ///< size of each slab the arena maps for sub-allocation
  std::uint64_t max_bytes = 0;           ///< cap on mapped bytes (all slabs); 0 = none
  std::size_t alignment = 256;           ///< alignment of every buffer (a power of two)
  NodeFullPolicy on_node_full = NodeFullPolicy::strict;
  /// Ask for transparent huge pages (madvise MADV_HUGEPAGE, slabs 2 MiB aligned): the first touch
  /// then faults 2 MiB at a time, several times faster than 4 KiB pages. Ignored where THP is off.
  bool huge_pages = true;
  /// Touches pages on first use; its workers should run on the node's cores (the caller binds
  /// them). Null: the calling thread touches every page.
  ThreadPool* toucher = nullptr;
  /// Registers each slab (page-locks it for DMA). Null: slabs are touched but not registered.
  Device* device = nullptr;

  /// slab_bytes, max_bytes, on_node_full and huge_pages from the options table (host_slab_size,
  /// host_max_bytes, host_node_full, host_huge_pages). Node, pool and device are the caller's to set.
  static HostArenaConfig from_options();
};

/// Where the pages of a range are, from sampled pages (move_pages without moving).
struct PlacementReport {
  bool known = false;               ///< false: placement could not be asked (reason says why)
  int wanted_node = -1;             ///< the arena's node; -1 = not bound (any node is fine)
  std::size_t pages_sampled = 0;
  std::size_t pages_not_present = 0;       ///< sampled pages not faulted in yet
  std::map<int, std::size_t> pages_per_node;  ///< node -> sampled pages on it
  std::string reason;               ///< why placement is unknown; empty when known

  /// Every sampled page is present and on wanted_node (or wanted_node is -1). False when unknown.
  [[nodiscard]] bool on_wanted_node() const;
  /// One line, e.g. "64 pages sampled: node 0: 64 (all on node 0)".
  [[nodiscard]] std::string describe() const;
};

struct HostArenaStats {
  std::uint64_t reserved_bytes = 0;   ///< mapped, in all slabs (whole slabs included)
  std::uint64_t allocated_bytes = 0;  ///< in live buffers (rounded to the alignment)
  std::uint64_t peak_allocated_bytes = 0;
  std::uint64_t allocations = 0;      ///< live buffers
  std::uint64_t slabs = 0;            ///< mapped slabs, whole slabs included
  std::uint64_t whole_slabs = 0;      ///< slabs handed out through SlabSource
  std::uint64_t registered_slabs = 0; ///< slabs registered with the Device
  std::uint64_t fallback_slabs = 0;   ///< slabs that could not be bound to the node (fallback policy)
  std::uint64_t slabs_released = 0;   ///< slabs given back by release_free_slabs (accumulated)
  std::map<int, std::uint64_t> bytes_per_node;  ///< reserved bytes by the node slabs are bound to (-1 = unbound)
  double map_bind_seconds = 0;        ///< accumulated time in mmap + mbind
  double touch_seconds = 0;           ///< accumulated time in the first touch
  double register_seconds = 0;        ///< accumulated time in host registration
};

class HostArena final : public SlabSource {
 public:
  /// Validates the configuration (node, alignment, slab size) and maps nothing yet.
  /// Throws InvalidArgument naming the bad value and what is accepted.
  explicit HostArena(HostArenaConfig config = {});
  /// Unregisters and unmaps every slab, with a warning for buffers still live. Once the process
  /// is exiting (after the first slab's registration, an exit handler is installed), it leaves
  /// everything to the OS instead: the device runtime may already be gone.
  ~HostArena() override;

  /// A buffer of at least `bytes`, aligned to config().alignment, from the best-fitting free
  /// block or a new slab. Throws InvalidArgument for zero or overflowing sizes, OutOfMemory when
  /// max_bytes, the node's memory or the machine's memory cannot hold it.
  void* allocate(std::size_t bytes);
  /// Returns a buffer from allocate(). Throws InvalidArgument for any other pointer.
  void deallocate(void* ptr);
  /// Size (rounded to the alignment) of the live buffer at `ptr`; 0 when `ptr` is not one.
  [[nodiscard]] std::size_t allocation_size(const void* ptr) const;

  /// Unmaps every sub-allocation slab with no live buffer; returns the bytes released.
  std::size_t release_free_slabs();

  [[nodiscard]] HostArenaStats stats() const;
  [[nodiscard]] const HostArenaConfig& config() const noexcept { return config_; }
  /// The slabs currently mapped (sub-allocation and whole), in address order.
  [[nodiscard]] std::vector<HostSlab> slabs() const;

  /// Samples up to `max_samples` pages of [p, p + bytes) and reports the node of each.
  [[nodiscard]] PlacementReport verify_placement(const void* p, std::size_t bytes, std::size_t max_samples = 64) const;

  /// True when memtide was built with libnuma and the kernel supports NUMA.
  [[nodiscard]] static bool numa_supported();
  /// Nodes a slab can be bound to (existing, with memory), ascending.
  [[nodiscard]] static std::vector<int> valid_numa_nodes();

 private:
  struct Slab {
    char* base = nullptr;
    std::size_t bytes = 0;
    int node = -1;            // bound node; -1 = unbound (or fallback)
    bool registered = false;
    bool whole = false;       // handed out through SlabSource
    bool fallback = false;
    std::size_t live = 0;     // live buffers in it
  };
  struct Block {
    std::size_t size = 0;
    Slab* slab = nullptr;
    bool free = true;
  };

  HostSlab do_map_slab(std::size_t bytes, std::size_t alignment) override;
  void do_unmap_slab(const HostSlab& slab) override;

  std::size_t round_request(std::size_t bytes, const char* what) const;
  /// Checks the cap and memory for a new slab of `bytes` (under mutex_; grow_mutex_ held).
  void check_capacity_locked(std::size_t bytes, std::size_t requested) const;
  /// Maps, binds, touches and registers; no lock held but grow_mutex_.
  Slab make_slab(std::size_t bytes, std::size_t alignment);
  /// Unregisters and unmaps; never throws.
  void destroy_slab(const Slab& slab) noexcept;
  using BlockMap = std::map<std::uintptr_t, Block>;
  using FreeSet = std::set<std::pair<std::size_t, std::uintptr_t>>;
  /// Map nodes allocated before the bookkeeping changes anything, so that no step of it can
  /// fail half-way (the strong guarantee): taking a block may split it (a block and a free
  /// entry), freeing one inserts a free entry.
  struct Nodes {
    BlockMap::node_type block;
    FreeSet::node_type free;
    static Nodes make(bool block, bool free);
  };
  void* take_block_locked(BlockMap::iterator it, std::size_t bytes, Nodes& nodes) noexcept;
  BlockMap::iterator find_fit_locked(std::size_t bytes);
  /// Adds a made slab's counters (the caller inserted it).
  void count_slab_locked(const Slab& s) noexcept;
  using SlabNode = std::map<std::uintptr_t, Slab>::node_type;
  /// The map node for a made slab and its node's counter, allocated before anything is counted,
  /// with `lock` taken on mutex_; if an allocation fails the slab is destroyed and the arena is
  /// as it was.
  SlabNode adopt_slab(const Slab& made, std::unique_lock<std::mutex>& lock);
  [[nodiscard]] std::string describe_locked() const;

  HostArenaConfig config_;
  std::size_t page_bytes_;
  std::uint64_t physical_bytes_;
  bool bind_;  // config_.numa_node >= 0 and NUMA is supported

  std::mutex grow_;           // one slab is made at a time; taken before mutex_, never after
  mutable std::mutex mutex_;  // guards everything below
  std::map<std::uintptr_t, Slab> slabs_;
  std::map<std::uintptr_t, Block> blocks_;                 // every block of every sub-allocation slab
  std::set<std::pair<std::size_t, std::uintptr_t>> free_;  // (size, address) of free blocks
  HostArenaStats stats_;
  bool exit_guard_installed_ = false;
};

}  // namespace memtide
