#include "memtide/tiering/host/pinned_buffer.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "memtide/core/error.hpp"

namespace memtide::tiering {
namespace {

constexpr std::size_t kArrayAlign = 64;
// Phantom host addresses: far from the heap, the stack and SimDevice's phantom device range, so
// a stray dereference faults instead of corrupting memory.
constexpr std::uintptr_t kPhantomHostBase = std::uintptr_t{0x6d68} << 32;
std::atomic<std::uintptr_t> g_next_phantom{kPhantomHostBase};

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

bool is_phantom(Device& device) noexcept { return !device.properties().stores_data; }

void* reserve_phantom_host(std::size_t bytes) {
  const std::uintptr_t at = g_next_phantom.fetch_add(round_up(std::max<std::size_t>(bytes, 1), 4096));
  return reinterpret_cast<void*>(at);
}

PinnedBuffer::PinnedBuffer(Device& device, std::size_t bytes, SlabSource* slabs)
    : device_(&device), slabs_(slabs), bytes_(bytes) {
  if (bytes == 0) return;
  if (is_phantom(device)) {
    ptr_ = reserve_phantom_host(bytes);
    device.host_register(ptr_, bytes);
  } else if (slabs != nullptr) {
    slab_ = slabs->map_slab(bytes, kArrayAlign);
    ptr_ = slab_.ptr;
  } else {
    ptr_ = std::aligned_alloc(4096, round_up(bytes, 4096));
    if (ptr_ == nullptr) throw OutOfMemory("PinnedBuffer: could not allocate " + std::to_string(bytes) + " host bytes");
    heap_ = true;
    try {
      device.host_register(ptr_, bytes);
    } catch (...) {
      std::free(ptr_);
      throw;
    }
  }
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ == nullptr) return;
  if (slab_.ptr != nullptr) {
    slabs_->unmap_slab(slab_);
    return;
  }
  try {
    device_->host_unregister(ptr_);
  } catch (const Error&) {
    // Unregistering can only fail for a range the device no longer knows; the memory is ours.
  }
  if (heap_) std::free(ptr_);
}

void PinnedBuffer::swap(PinnedBuffer& o) noexcept {
  std::swap(device_, o.device_);
  std::swap(slabs_, o.slabs_);
  std::swap(slab_, o.slab_);
  std::swap(ptr_, o.ptr_);
  std::swap(bytes_, o.bytes_);
  std::swap(heap_, o.heap_);
}

}  // namespace memtide::tiering
