#pragma once
/// @file
/// PinnedHeap: malloc/free for the many small and medium pinned staging buffers, carved from
/// whole slabs of a SlabSource by jemalloc or mimalloc.
///
/// Both libraries are loaded with dlopen(RTLD_LOCAL) and used through their explicit-arena APIs
/// only, so the process's own malloc is never replaced (Debian builds both unprefixed: linking
/// either would take over malloc for the whole process).
///
/// - jemalloc: an arena made with `arenas.create` and extent hooks that serve every extent from
///   the slabs; decay is off and decommit/purge are refused, so pinned pages are never returned.
///   dlopen'ing it needs more static TLS than glibc keeps spare: the process must start with
///   GLIBC_TUNABLES=glibc.rtld.optional_static_tls=16384, else `automatic` uses mimalloc.
/// - mimalloc: each slab becomes an exclusive arena (`mi_manage_os_memory_ex`), and each thread
///   gets its own heap in it (a mimalloc heap allocates only on the thread that created it).
///
/// Requests of at least `direct_threshold` bytes skip the library: they are cut page-exact from
/// slabs, because both libraries round large sizes up to classes (jemalloc: up to 25% more;
/// mimalloc: whole 32 MiB segments above 32 MiB), which would dominate the bytes of a staging mix.

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "memtide/allocator/host_slab.hpp"

namespace memtide {

/// Which library carves the slabs.
enum class PinnedHeapBackend { automatic, jemalloc, mimalloc };

/// "auto" | "jemalloc" | "mimalloc". Throws ConfigError for anything else.
PinnedHeapBackend parse_pinned_heap_backend(const std::string& name);
/// "auto", "jemalloc" or "mimalloc".
const char* to_string(PinnedHeapBackend backend) noexcept;

/// Whether a backend can be used in this process; when not, `why` says what failed (the library
/// file tried and the loader's message, or that memtide was built without its header).
bool pinned_heap_backend_available(PinnedHeapBackend backend, std::string* why = nullptr);

/// How a PinnedHeap is set up. `from_options()` reads the options table.
struct PinnedHeapConfig {
  PinnedHeapBackend backend = PinnedHeapBackend::automatic;
  /// Slabs start at 32 MiB (mimalloc: 64 MiB) and grow with the heap up to this size; a larger
  /// request gets a slab of its own size.
  std::size_t slab_bytes = std::size_t{256} << 20;
  /// Requests of at least this many bytes, or aligned to more than 1 MiB, are cut page-exact from
  /// slabs (0 = by alignment only): cheaper in bytes than the libraries' large size classes and,
  /// for jemalloc without a thread cache, faster too.
  std::size_t direct_threshold = std::size_t{64} << 10;

  /// MEMTIDE_PINNED_HEAP_BACKEND, _SLAB_SIZE and _DIRECT_THRESHOLD.
  static PinnedHeapConfig from_options();
};

/// What a PinnedHeap holds.
struct PinnedHeapStats {
  std::size_t requested_live = 0;   ///< bytes asked for by allocations not yet freed
  std::size_t requested_peak = 0;   ///< highest requested_live so far
  std::size_t allocations_live = 0; ///< allocations not yet freed
  std::size_t reserved = 0;         ///< bytes of slabs mapped from the source
  std::size_t reserved_peak = 0;
  std::size_t slab_count = 0;       ///< slabs mapped from the source
};

/// General pinned malloc over slabs. Thread-safe: any thread may allocate, and any thread may
/// free what another allocated. The SlabSource must outlive the heap; with mimalloc it must
/// outlive every thread that used the heap (in practice: the process), because mimalloc keeps
/// referring to its arenas after the heap is gone.
class PinnedHeap {
 public:
  /// Throws Error when the chosen backend cannot be loaded (with `automatic`, only when neither
  /// can), ConfigError for a slab size below 2 MiB.
  explicit PinnedHeap(SlabSource& source, PinnedHeapConfig config = PinnedHeapConfig::from_options());
  /// Gives every slab back to the source (jemalloc), or keeps them mapped until the process
  /// exits (mimalloc 2.0 cannot remove an arena; see docs/architecture.md). Live allocations
  /// become invalid.
  ~PinnedHeap();
  PinnedHeap(const PinnedHeap&) = delete;
  PinnedHeap& operator=(const PinnedHeap&) = delete;

  /// `bytes` (>= 1) of pinned memory aligned to `alignment` (a power of two, at most 64 MiB).
  /// Never returns null: throws OutOfMemory when the source cannot provide a slab,
  /// InvalidArgument for a zero size or a bad alignment.
  void* allocate(std::size_t bytes, std::size_t alignment = 64);
  /// Frees memory from allocate(). Throws InvalidArgument for a pointer this heap does not own
  /// (or no longer owns).
  void deallocate(void* ptr);
  /// As deallocate(ptr), and checks that `bytes` is the size that was asked for.
  void deallocate(void* ptr, std::size_t bytes);
  /// True when `ptr` is a live allocation of this heap (as returned by allocate()).
  [[nodiscard]] bool owns(const void* ptr) const;

  [[nodiscard]] PinnedHeapStats stats() const;
  /// The backend in use (never `automatic`).
  [[nodiscard]] PinnedHeapBackend backend() const noexcept;
  /// The slabs mapped so far (every byte this heap hands out lies in one of them).
  [[nodiscard]] std::vector<HostSlab> slabs() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtide
