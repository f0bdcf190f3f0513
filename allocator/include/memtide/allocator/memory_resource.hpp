#pragma once
/// @file
/// The stream-ordered device memory resource interface, in the style of RMM: a small public,
/// non-virtual surface and a private virtual core, so a resource can be wrapped by an adaptor
/// that forwards to it. CachingAllocator keeps its features inside (docs/architecture.md says why).

#include <cstddef>

#include "memtide/device/device.hpp"

namespace memtide {

class DeviceMemoryResource {
 public:
  virtual ~DeviceMemoryResource() = default;

  /// `bytes` of device memory usable on `stream` in stream order. Null for zero bytes.
  /// Throws OutOfMemory.
  void* allocate(std::size_t bytes, Stream stream) { return bytes == 0 ? nullptr : do_allocate(bytes, stream); }
  /// Returns `ptr`; work already queued on its stream may still use it. Null is ignored.
  /// Throws InvalidArgument for a pointer this resource does not own.
  void deallocate(void* ptr, Stream stream) {
    if (ptr != nullptr) do_deallocate(ptr, stream);
  }

 private:
  virtual void* do_allocate(std::size_t bytes, Stream stream) = 0;
  virtual void do_deallocate(void* ptr, Stream stream) = 0;
};

/// No caching: every request goes to the device (cudaMalloc / cudaFree). The baseline in
/// benchmarks, and a check that the resource contract holds for the simplest implementation.
class DirectResource final : public DeviceMemoryResource {
 public:
  explicit DirectResource(Device& device) : device_(device) {}

 private:
  void* do_allocate(std::size_t bytes, Stream stream) override;
  void do_deallocate(void* ptr, Stream stream) override;
  Device& device_;
};

}  // namespace memtide
