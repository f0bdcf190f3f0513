#include "memtide/allocator/mmap_slab_source.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/device/device.hpp"

namespace memtide {
namespace {

constexpr std::size_t kMaxSlab = std::size_t{1} << 44;
constexpr std::size_t kMaxAlignment = std::size_t{1} << 30;

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

std::size_t page_size() {
  static const auto p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

}  // namespace

MmapSlabSource::~MmapSlabSource() {
  for (auto& [ptr, m] : mappings_) {
    if (m.slab.registered && device_ != nullptr) {
      try {
        device_->host_unregister(m.slab.ptr);
      } catch (const std::exception& e) {
        MEMTIDE_LOG(warn, std::string("MmapSlabSource: host_unregister at destruction failed: ") + e.what());
      }
    }
    munmap(m.base, m.length);
  }
}

std::size_t MmapSlabSource::slab_count() const {
  std::lock_guard lock(mutex_);
  return mappings_.size();
}

std::size_t MmapSlabSource::mapped_bytes() const {
  std::lock_guard lock(mutex_);
  return mapped_bytes_;
}

HostSlab MmapSlabSource::do_map_slab(std::size_t bytes, std::size_t alignment) {
  if (bytes == 0 || bytes > kMaxSlab) {
    throw InvalidArgument("MmapSlabSource::map_slab: bytes=" + std::to_string(bytes) +
                          " is not accepted: expected 1 byte to " + format_bytes(kMaxSlab));
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kMaxAlignment) {
    throw InvalidArgument("MmapSlabSource::map_slab: alignment=" + std::to_string(alignment) +
                          " is not accepted: expected a power of two up to " + format_bytes(kMaxAlignment));
  }
  const std::size_t page = page_size();
  const std::size_t size = (bytes + page - 1) / page * page;
  const std::size_t align = alignment < page ? page : alignment;
  // Over-map by the alignment and trim both ends, so the slab starts on an `align` boundary.
  const std::size_t length = size + align - page;
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    throw OutOfMemory("MmapSlabSource: mmap of " + format_bytes(length) + " failed: " + std::strerror(errno));
  }
  const auto b = reinterpret_cast<std::uintptr_t>(base);
  const std::uintptr_t start = (b + align - 1) & ~(std::uintptr_t{align} - 1);
  if (start > b) munmap(base, start - b);
  const std::uintptr_t end = b + length;
  if (end > start + size) munmap(reinterpret_cast<void*>(start + size), end - (start + size));

  HostSlab slab;
  slab.ptr = reinterpret_cast<void*>(start);
  slab.bytes = size;
  if (device_ != nullptr) {
    try {
      device_->host_register(slab.ptr, slab.bytes);
    } catch (...) {
      munmap(slab.ptr, slab.bytes);
      throw;
    }
    slab.registered = true;
  }
  std::lock_guard lock(mutex_);
  mappings_.emplace(slab.ptr, Mapping{slab.ptr, slab.bytes, slab});
  mapped_bytes_ += slab.bytes;
  return slab;
}

void MmapSlabSource::do_unmap_slab(const HostSlab& slab) {
  Mapping m{};
  {
    std::lock_guard lock(mutex_);
    auto it = mappings_.find(slab.ptr);
    if (it == mappings_.end()) {
      throw InvalidArgument("MmapSlabSource::unmap_slab: " + hex(slab.ptr) +
                            " is not a slab of this source");
    }
    m = it->second;
    mappings_.erase(it);
    mapped_bytes_ -= m.slab.bytes;
  }
  if (m.slab.registered && device_ != nullptr) device_->host_unregister(m.slab.ptr);
  munmap(m.base, m.length);
}

}  // namespace memtide
