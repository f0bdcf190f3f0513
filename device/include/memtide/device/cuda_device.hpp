#pragma once
/// @file
/// Device over the CUDA runtime. Only built when memtide is configured with CUDA; create it
/// through `open_device`, which checks that a driver and GPU are present first.

#include <cstdint>
#include <map>
#include <mutex>

#include "memtide/device/device.hpp"

namespace memtide {

class CudaDevice final : public Device {
 public:
  /// Opens GPU `index`. Throws CudaError when it cannot be used.
  explicit CudaDevice(int index);
  ~CudaDevice() override = default;

 private:
  void* do_allocate(std::size_t bytes) override;
  void do_deallocate(void* ptr, std::size_t bytes) override;
  Stream do_create_stream() override;
  void do_destroy_stream(Stream stream) override;
  Event do_create_event(bool timing) override;
  void do_destroy_event(Event event) override;
  void do_record_event(Event event, Stream stream) override;
  void do_stream_wait_event(Stream stream, Event event) override;
  bool do_event_query(Event event) override;
  void do_event_synchronize(Event event) override;
  float do_event_elapsed_ms(Event start, Event end) override;
  void do_stream_synchronize(Stream stream) override;
  void do_synchronize() override;
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) override;
  void do_memset_async(void* ptr, int value, std::size_t bytes, Stream stream) override;
  void do_host_register(void* ptr, std::size_t bytes) override;
  void do_host_unregister(void* ptr) override;
  MemInfo do_mem_info() override;
  void do_enqueue_kernel(Stream stream, const DeviceKernel& kernel) override;
  [[nodiscard]] bool do_can_run(const DeviceKernel& kernel) const override;
  /// Virtual memory through the driver API (cuMemAddressReserve, cuMemCreate, cuMemMap), reached
  /// with cudaGetDriverEntryPointByVersion so libmemtide.so needs no libcuda to load. One physical
  /// allocation per granule, so any run of granules can be unmapped on its own.
  std::size_t do_vmm_granularity() override;
  void* do_reserve_address(std::size_t bytes) override;
  void do_release_address(void* base, std::size_t bytes) override;
  void do_map_memory(void* at, std::size_t bytes) override;
  void do_unmap_memory(void* at, std::size_t bytes) override;

  /// Makes this device current on the calling thread (CUDA's current device is per thread).
  void activate() const;
  /// How many bytes from `at` lie wholly inside one registered range, or wholly outside all.
  std::size_t same_registration(std::uintptr_t at, std::size_t bytes) const;
  int index_;
  std::size_t granularity_ = 0;  ///< 0: no virtual memory management (set in the constructor)
  mutable std::mutex registered_mutex_;
  std::map<std::uintptr_t, std::uintptr_t> registered_;  ///< host_register'ed ranges: start -> end
};

}  // namespace memtide
