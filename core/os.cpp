#include "memtide/core/os.hpp"
#include "memtide/core/detail/os_testing.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

#ifdef MEMTIDE_HAVE_NUMA
#include <numa.h>
#include <numaif.h>
#endif

namespace memtide::os {
namespace {

struct Injection {
  std::atomic<std::size_t> calls{0};
  std::atomic<std::size_t> fail_at{SIZE_MAX};  // the call number that fails
  std::atomic<int> err{0};
};
Injection g_calls[testing::kCalls];
std::atomic<bool> g_armed{false};

// Counts the call; true (with errno set) when a test made this one fail.
bool injected(testing::Call call) noexcept {
  if (!g_armed.load(std::memory_order_relaxed)) return false;
  Injection& in = g_calls[static_cast<int>(call)];
  const std::size_t n = in.calls.fetch_add(1, std::memory_order_relaxed);
  std::size_t expected = n;
  if (in.fail_at.compare_exchange_strong(expected, SIZE_MAX, std::memory_order_relaxed)) {
    errno = in.err.load(std::memory_order_relaxed);
    return true;
  }
  return false;
}

// The first line of a small sysfs file ("" when it cannot be read).
std::string read_small_file(const std::string& path) noexcept {
  char buf[64];
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  const ssize_t got = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (got <= 0) return {};
  std::string line(buf, static_cast<std::size_t>(got));
  return line.substr(0, line.find('\n'));
}

}  // namespace

std::size_t page_bytes() noexcept {
  static const auto p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

std::size_t parse_cache_size(const char* text) noexcept {
  if (text == nullptr || *text < '0' || *text > '9') return 0;
  std::size_t value = 0;
  for (; *text >= '0' && *text <= '9'; ++text) {
    if (value > SIZE_MAX / 10 - 9) return 0;
    value = value * 10 + static_cast<std::size_t>(*text - '0');
  }
  int shift = 0;
  switch (*text) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    default: break;
  }
  if (shift != 0) ++text;
  const std::size_t unit = std::size_t{1} << shift;
  while (*text == '\n' || *text == ' ') ++text;
  if (*text != '\0' || value > SIZE_MAX / unit) return 0;
  return value * unit;
}

std::size_t last_level_cache_bytes() noexcept {
  static const std::size_t bytes = [] {
    std::size_t best = 0;
    int best_level = 0;
    for (int index = 0; index < 16; ++index) {
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
      const std::string type = read_small_file(dir + "type");
      if (type.empty()) break;
      if (type.rfind("Instruction", 0) == 0) continue;
      const int level = std::atoi(read_small_file(dir + "level").c_str());
      const std::size_t size = parse_cache_size(read_small_file(dir + "size").c_str());
      if (level > best_level && size > 0) {
        best = size;
        best_level = level;
      }
    }
    if (best > 0) return best;
    const long conf = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return conf > 0 ? static_cast<std::size_t>(conf) : std::size_t{0};
  }();
  return bytes;
}

namespace {
void* map_aligned(std::size_t bytes, std::size_t alignment, int prot, int flags, int& err) noexcept {
  err = 0;
  if (injected(testing::Call::map)) {
    err = errno;
    return nullptr;
  }
  const std::size_t page = page_bytes();
  const std::size_t align = alignment < page ? page : alignment;
  const std::size_t length = bytes + (align - page);
  if (length < bytes) {
    err = ENOMEM;
    return nullptr;
  }
  void* raw = ::mmap(nullptr, length, prot, MAP_PRIVATE | MAP_ANONYMOUS | flags, -1, 0);
  if (raw == MAP_FAILED) {
    err = errno;
    return nullptr;
  }
  const auto b = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (b + align - 1) & ~(std::uintptr_t{align} - 1);
  // Trimming only shrinks a mapping this function owns; it cannot fail for a valid range.
  if (start > b) ::munmap(raw, start - b);
  if (b + length > start + bytes) ::munmap(reinterpret_cast<void*>(start + bytes), b + length - (start + bytes));
  return reinterpret_cast<void*>(start);
}
}  // namespace

void* map(std::size_t bytes, std::size_t alignment, bool noreserve, int& err) noexcept {
  return map_aligned(bytes, alignment, PROT_READ | PROT_WRITE, noreserve ? MAP_NORESERVE : 0, err);
}

void* reserve(std::size_t bytes, std::size_t alignment, int& err) noexcept {
  return map_aligned(bytes, alignment, PROT_NONE, MAP_NORESERVE, err);
}

int protect(void* p, std::size_t bytes, bool accessible) noexcept {
  if (injected(testing::Call::protect)) return errno;
  return ::mprotect(p, bytes, accessible ? PROT_READ | PROT_WRITE : PROT_NONE) == 0 ? 0 : errno;
}

int unmap(void* p, std::size_t bytes) noexcept {
  if (injected(testing::Call::unmap)) return errno;
  return ::munmap(p, bytes) == 0 ? 0 : errno;
}

int discard(void* p, std::size_t bytes) noexcept {
  if (injected(testing::Call::discard)) return errno;
  return ::madvise(p, bytes, MADV_DONTNEED) == 0 ? 0 : errno;
}

int lazy_free(void* p, std::size_t bytes) noexcept {
  if (injected(testing::Call::discard)) return errno;
  return ::madvise(p, bytes, MADV_FREE) == 0 ? 0 : errno;
}

int populate(void* p, std::size_t bytes) noexcept {
  if (injected(testing::Call::advise)) return errno;
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack the name
#endif
  return ::madvise(p, bytes, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
}

int advise_huge_pages(void* p, std::size_t bytes) noexcept {
  if (injected(testing::Call::advise)) return errno;
  return ::madvise(p, bytes, MADV_HUGEPAGE) == 0 ? 0 : errno;
}

int bind_to_node(void* p, std::size_t bytes, int node, bool strict) noexcept {
  if (injected(testing::Call::bind)) return errno;
#ifdef MEMTIDE_HAVE_NUMA
  if (node < 0) return EINVAL;
  bitmask* mask = numa_allocate_nodemask();
  if (mask == nullptr) return ENOMEM;
  numa_bitmask_setbit(mask, static_cast<unsigned>(node));
  const long rc = strict ? mbind(p, bytes, MPOL_BIND, mask->maskp, mask->size + 1, MPOL_MF_STRICT)
                         : mbind(p, bytes, MPOL_PREFERRED, mask->maskp, mask->size + 1, 0);
  const int err = rc == 0 ? 0 : errno;
  numa_free_nodemask(mask);
  return err;
#else
  (void)p, (void)bytes, (void)node, (void)strict;
  return ENOSYS;
#endif
}

int page_nodes(void* const* pages, std::size_t count, int* nodes) noexcept {
  if (injected(testing::Call::page_nodes)) return errno;
#ifdef MEMTIDE_HAVE_NUMA
  // nodes == null asks where the pages are; nothing moves.
  return move_pages(0, count, const_cast<void**>(pages), nullptr, nodes, 0) == 0 ? 0 : errno;
#else
  (void)pages, (void)count, (void)nodes;
  return ENOSYS;
#endif
}

namespace testing {

void fail_nth(Call call, std::size_t nth, int err) noexcept {
  Injection& in = g_calls[static_cast<int>(call)];
  in.err.store(err, std::memory_order_relaxed);
  in.fail_at.store(in.calls.load(std::memory_order_relaxed) + nth, std::memory_order_relaxed);
  g_armed.store(true, std::memory_order_relaxed);
}

void reset() noexcept {
  for (Injection& in : g_calls) {
    in.fail_at.store(SIZE_MAX, std::memory_order_relaxed);
    in.calls.store(0, std::memory_order_relaxed);
  }
  g_armed.store(true, std::memory_order_relaxed);  // counting starts here
}

std::size_t count(Call call) noexcept { return g_calls[static_cast<int>(call)].calls.load(std::memory_order_relaxed); }

}  // namespace testing
}  // namespace memtide::os
