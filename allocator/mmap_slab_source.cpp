#include "memtide/allocator/mmap_slab_source.hpp"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "memtide/core/os.hpp"
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
    (void)os::unmap(m.base, m.length);
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
  const std::size_t page = os::page_bytes();
  const std::size_t size = (bytes + page - 1) / page * page;
  int err = 0;
  void* ptr = os::map(size, alignment, true, err);
  if (ptr == nullptr) {
    throw OutOfMemory("MmapSlabSource: mmap of " + format_bytes(size) + " failed: " + std::strerror(err));
  }
  HostSlab slab;
  slab.ptr = ptr;
  slab.bytes = size;
  // Whatever fails from here on (registration, the bookkeeping's allocation) gives the slab back.
  try {
    if (device_ != nullptr) {
      device_->host_register(slab.ptr, slab.bytes);
      slab.registered = true;
    }
    std::lock_guard lock(mutex_);
    mappings_.emplace(slab.ptr, Mapping{slab.ptr, slab.bytes, slab});
    mapped_bytes_ += slab.bytes;
  } catch (...) {
    if (slab.registered) {
      try {
        device_->host_unregister(slab.ptr);
      } catch (const std::exception& e) {
        MEMTIDE_LOG(warn, std::string("MmapSlabSource: host_unregister after a failed map_slab failed: ") + e.what());
      }
    }
    (void)os::unmap(slab.ptr, slab.bytes);
    throw;
  }
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
  }
  // Unregistered first: if that fails, the slab is still mapped and still this source's.
  if (m.slab.registered && device_ != nullptr) device_->host_unregister(m.slab.ptr);
  {
    std::lock_guard lock(mutex_);
    mappings_.erase(m.slab.ptr);
    mapped_bytes_ -= m.slab.bytes;
  }
  if (const int err = os::unmap(m.base, m.length); err != 0) {
    MEMTIDE_LOG(error, "MmapSlabSource: munmap of " + format_bytes(m.length) + " at " + hex(m.base) +
                           " failed: " + std::strerror(err));
  }
}

}  // namespace memtide
