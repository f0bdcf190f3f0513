#pragma once
/// @file
/// The process-wide runtime behind the C ABI and the Python module: one CachingAllocator per
/// device, created on first use from the options table, and never destroyed (see NoDestructor).

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/core/no_destructor.hpp"
#include "memtide/device/device.hpp"

namespace memtide {

class Runtime {
 public:
  /// The runtime, created on first call. Throws ConfigError for bad options.
  static Runtime& get();

  [[nodiscard]] Backend backend() const noexcept { return backend_; }
  [[nodiscard]] int device_count() const noexcept { return static_cast<int>(slots_.size()); }
  /// The allocator of `device`, opened on first use. Throws InvalidArgument for a bad index.
  CachingAllocator& allocator(int device);
  /// Allocators opened so far (null for devices never used).
  std::vector<CachingAllocator*> opened();

  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

 private:
  friend class NoDestructor<Runtime>;
  Runtime();
  struct Slot {
    std::once_flag once;
    std::unique_ptr<Device> device;
    std::unique_ptr<CachingAllocator> allocator;
    std::atomic<CachingAllocator*> ready{nullptr};  ///< published once `allocator` is built
  };
  Backend backend_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace memtide
