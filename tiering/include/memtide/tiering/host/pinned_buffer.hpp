#pragma once
/// @file
/// Pinned host buffers and phantom host ranges: the host memory both the engine (staging,
/// counters) and the NVMe tier (its staging buffers) take. It lives below both so that the NVMe
/// tier needs nothing of the engine (engine -> nvme is the only direction between them).

#include <cstddef>
#include <utility>

#include "memtide/allocator/host_slab.hpp"
#include "memtide/device/device.hpp"

namespace memtide::tiering {

/// Pinned host memory for small engine buffers (staging, counters): from a SlabSource when given,
/// else aligned_alloc + Device::host_register; on a phantom SimDevice a registered phantom range.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  /// `bytes` pinned bytes (none for 0). Throws OutOfMemory when the host has none left.
  PinnedBuffer(Device& device, std::size_t bytes, SlabSource* slabs = nullptr);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept { swap(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    PinnedBuffer tmp(std::move(other));
    swap(tmp);
    return *this;
  }
  [[nodiscard]] void* data() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }

 private:
  void swap(PinnedBuffer& o) noexcept;
  Device* device_ = nullptr;
  SlabSource* slabs_ = nullptr;
  HostSlab slab_{};
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  bool heap_ = false;
};

/// True when `device` stores no data (a phantom SimDevice: nothing may be dereferenced).
bool is_phantom(Device& device) noexcept;
/// A fresh range of `bytes` phantom host addresses (never dereferenceable; 64-byte aligned).
void* reserve_phantom_host(std::size_t bytes);

}  // namespace memtide::tiering
