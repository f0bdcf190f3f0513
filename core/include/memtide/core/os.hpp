#pragma once
/// @file
/// memtide's calls into the OS for memory, in one place (as mimalloc's prim.c): mapping, address
/// space reservation, huge-page advice, NUMA binding and page-placement queries. None throws: each returns
/// 0 or an errno value (or null and the errno), and callers turn that into their own errors.
///
/// Every call can be made to fail from a test (memtide/core/detail/os_testing.hpp), so each
/// caller's failure path, and the guarantee that a failed operation leaves its object as it was,
/// is tested rather than assumed.

#include <cstddef>

namespace memtide::os {

/// The system page size.
[[nodiscard]] std::size_t page_bytes() noexcept;

/// A private read-write anonymous mapping of `bytes` (a multiple of the page size) starting on
/// an `alignment` boundary (a power of two; below a page means a page): over-mapped, then
/// trimmed at both ends. `noreserve`: no swap reservation (MAP_NORESERVE). Null on failure, with
/// the errno in `err`.
[[nodiscard]] void* map(std::size_t bytes, std::size_t alignment, bool noreserve, int& err) noexcept;

/// Address space only: like map() but inaccessible (PROT_NONE) and reserving no memory or swap;
/// protect() makes parts of it usable. Null on failure, with the errno in `err`.
[[nodiscard]] void* reserve(std::size_t bytes, std::size_t alignment, int& err) noexcept;

/// Makes a page-aligned range of mapped or reserved space readable and writable, or inaccessible
/// again. 0 or errno.
int protect(void* p, std::size_t bytes, bool accessible) noexcept;

/// Unmaps what map() or reserve() returned (the same bytes). 0 or errno.
int unmap(void* p, std::size_t bytes) noexcept;

/// Gives the pages of a page-aligned range back to the OS (MADV_DONTNEED): they read as zeros
/// and cost no memory until written again. The range must not be locked (host-registered).
/// 0 or errno.
int discard(void* p, std::size_t bytes) noexcept;

/// Lets the kernel take the pages of a page-aligned range back when memory runs short
/// (MADV_FREE): until then they stay, and a write keeps the page it lands on; taken ones read as
/// zeros. Counts as a discard() for the tests' fault injection. 0 or errno.
int lazy_free(void* p, std::size_t bytes) noexcept;

/// Faults in every page of a page-aligned range at once, writable (MADV_POPULATE_WRITE, Linux
/// 5.14): one call instead of a fault per page on first touch. Counts as an advise_huge_pages()
/// for the tests' fault injection. 0 or errno (EINVAL: an older kernel; the pages then fault in
/// on first touch as usual).
int populate(void* p, std::size_t bytes) noexcept;

/// Asks for transparent huge pages over the range. 0 or errno (EINVAL: the kernel has no THP).
int advise_huge_pages(void* p, std::size_t bytes) noexcept;

/// Binds a range that has no pages yet to NUMA `node`: `strict` = MPOL_BIND with
/// MPOL_MF_STRICT (fail rather than place elsewhere), else MPOL_PREFERRED. 0 or errno; ENOSYS
/// when memtide was built without libnuma.
int bind_to_node(void* p, std::size_t bytes, int node, bool strict) noexcept;

/// The node of each of `count` pages into `nodes` (or -errno for a page: -ENOENT never touched,
/// -EFAULT not mapped). Nothing moves. 0 or errno; ENOSYS without libnuma.
int page_nodes(void* const* pages, std::size_t count, int* nodes) noexcept;

/// The last-level cache the first CPU's core shares, in bytes: the highest cache level Linux lists
/// under /sys/devices/system/cpu/cpu0/cache. In a VM this is the slice the guest's cores reach
/// (32 MiB on one EPYC guest) where sysconf(_SC_LEVEL3_CACHE_SIZE) gives the whole socket's
/// (320 MiB there). Falls back to sysconf, then 0 when neither knows.
[[nodiscard]] std::size_t last_level_cache_bytes() noexcept;

/// A sysfs cache size ("32768K", "1M", "512") in bytes; 0 if `text` is not one.
[[nodiscard]] std::size_t parse_cache_size(const char* text) noexcept;

}  // namespace memtide::os
