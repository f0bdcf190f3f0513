#pragma once
/// @file
/// The machine as memtide sees it: device memory, streams, events and asynchronous copies, behind
/// a non-virtual surface over a private virtual core (docs/architecture.md, "Device").

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace memtide {

/// A stream handle (CudaDevice: the `cudaStream_t`; null is the default stream), keyed by handle.
struct Stream {
  void* handle = nullptr;
  friend bool operator==(Stream a, Stream b) noexcept { return a.handle == b.handle; }
  friend auto operator<=>(Stream a, Stream b) noexcept { return a.handle <=> b.handle; }
};

/// An event handle, created and destroyed by its Device.
struct Event {
  void* handle = nullptr;
  [[nodiscard]] bool valid() const noexcept { return handle != nullptr; }
};

enum class CopyKind { host_to_device, device_to_host, device_to_device };

/// What the allocator and the planner need to know about a device.
struct DeviceProperties {
  std::string backend;         ///< "cuda" or "sim"
  std::string name;            ///< e.g. "NVIDIA H200" or "SimDevice (H100 model, data)"
  int index = 0;               ///< device ordinal
  std::size_t total_memory = 0;
  int copy_engines = 2;        ///< asynchronous copy engines (2 = full-duplex H2D and D2H)
  std::string pci_bus_id;      ///< "0000:1b:00.0"; empty when unknown
  bool stores_data = true;     ///< false: a phantom SimDevice, whose memory may not be dereferenced
  bool virtual_clock = false;  ///< times are modelled (a SimDevice): nothing on the host's clock sees them
  bool host_addressable = false;  ///< its memory is host memory (a SimDevice in data mode)
};

/// One kernel in both forms: the CUDA launch and the same computation on the host; the device
/// runs the form it can and charges the cost to the stream.
struct DeviceKernel {
  /// Enqueues the CUDA kernel (the device is current); null where the build has no CUDA kernels.
  std::function<void(Stream)> launch;
  /// The same result computed on the calling thread (a simulated device in data mode runs it).
  std::function<void()> host;
  double hbm_bytes = 0;  ///< bytes the kernel moves through device memory
  double params = 0;     ///< optimizer parameters it steps (0: not an optimizer step)
};

/// Work the host does for the device's pipeline, whose time the device's host clock counts.
struct HostWork {
  double dram_bytes = 0;  ///< host DRAM traffic (shared with DMA on a simulated device)
  double params = 0;      ///< optimizer parameters stepped on the CPU (0: a bandwidth-bound scan)
};

/// Free and total device memory, as cudaMemGetInfo reports them.
struct MemInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

/// Abstract device. Thread-safe: every method may be called from any thread.
class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// Raw device memory (a segment, like cudaMalloc); never null for bytes > 0. Throws OutOfMemory.
  void* allocate(std::size_t bytes);
  /// Returns memory from allocate(). Implicitly synchronizes the device, like cudaFree.
  void deallocate(void* ptr, std::size_t bytes);

  /// @name Virtual memory (cuMemAddressReserve / cuMemMap; for expandable segments)
  /// @{
  /// The granule in bytes; 0 when this device cannot (a driver without virtual memory management).
  [[nodiscard]] std::size_t vmm_granularity();
  /// Reserves `bytes` (granules) of address space, no memory. Throws Error, or OutOfMemory.
  void* reserve_address(std::size_t bytes);
  /// Releases a reservation; nothing in it may be mapped.
  void release_address(void* base, std::size_t bytes);
  /// Backs [at, at + bytes) of a reservation with device memory. Throws OutOfMemory (nothing mapped).
  void map_memory(void* at, std::size_t bytes);
  /// Returns the memory of a mapped range; synchronizes the device first, like cudaFree.
  void unmap_memory(void* at, std::size_t bytes);
  /// @}

  Stream create_stream();
  void destroy_stream(Stream stream);
  /// `timing` events can be passed to event_elapsed_ms; others are cheaper to record.
  Event create_event(bool timing = false);
  void destroy_event(Event event);

  /// Marks the point in `stream` that the event completes at.
  void record_event(Event event, Stream stream);
  /// Work queued on `stream` after this call waits for `event`. The host does not block.
  void stream_wait_event(Stream stream, Event event);
  /// True when the event has completed (or was never recorded).
  bool event_query(Event event);
  void event_synchronize(Event event);
  /// Milliseconds between two completed events.
  float event_elapsed_ms(Event start, Event end);
  void stream_synchronize(Stream stream);
  void synchronize();

  /// Asynchronous copy ordered on `stream` (unregistered host memory goes at pageable rates).
  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream);
  /// Asynchronous fill of device memory with a byte value.
  void memset_async(void* ptr, int value, std::size_t bytes, Stream stream);

  /// Page-locks host memory so copies from and to it run at full bandwidth.
  void host_register(void* ptr, std::size_t bytes);
  void host_unregister(void* ptr);

  /// Enqueues `kernel` on `stream`. Throws Error where !can_run, InvalidArgument for negative costs.
  void enqueue_kernel(Stream stream, const DeviceKernel& kernel);
  /// True when this device has the form of `kernel` it runs (a GPU its launch, a SimDevice its host).
  [[nodiscard]] bool can_run(const DeviceKernel& kernel) const;

  /// The host's clock in ns, the one events are compared with (wall time, or the virtual clock).
  double host_now_ns();
  /// Runs `body` as host work for the device's pipeline; returns its duration on host_now_ns()'s
  /// clock (a simulated device charges `work` and runs `body` only when it stores data).
  double run_host_work(const HostWork& work, const std::function<void()>& body);

  /// True when the device times storage transfers on a clock of its own (a simulated drive).
  [[nodiscard]] bool times_storage() const;
  /// A host <-> drive transfer of `bytes` at `bytes_per_s` on `stream`. Throws InvalidArgument
  /// for bytes < 0 or a rate not > 0 and finite, Error where times_storage() is false.
  void enqueue_storage(Stream stream, double bytes, double bytes_per_s);

  [[nodiscard]] const DeviceProperties& properties() const noexcept { return props_; }
  [[nodiscard]] MemInfo mem_info();

 protected:
  DeviceProperties props_;

 private:
  virtual void* do_allocate(std::size_t bytes) = 0;
  virtual void do_deallocate(void* ptr, std::size_t bytes) = 0;
  /// Virtual memory, storage clock, host clock: defaults for a device without them.
  virtual std::size_t do_vmm_granularity() { return 0; }
  virtual void* do_reserve_address(std::size_t bytes);
  virtual void do_release_address(void* base, std::size_t bytes);
  virtual void do_map_memory(void* at, std::size_t bytes);
  virtual void do_unmap_memory(void* at, std::size_t bytes);
  virtual Stream do_create_stream() = 0;
  virtual void do_destroy_stream(Stream stream) = 0;
  virtual Event do_create_event(bool timing) = 0;
  virtual void do_destroy_event(Event event) = 0;
  virtual void do_record_event(Event event, Stream stream) = 0;
  virtual void do_stream_wait_event(Stream stream, Event event) = 0;
  virtual bool do_event_query(Event event) = 0;
  virtual void do_event_synchronize(Event event) = 0;
  virtual float do_event_elapsed_ms(Event start, Event end) = 0;
  virtual void do_stream_synchronize(Stream stream) = 0;
  virtual void do_synchronize() = 0;
  virtual void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) = 0;
  virtual void do_memset_async(void* ptr, int value, std::size_t bytes, Stream stream) = 0;
  virtual void do_host_register(void* ptr, std::size_t bytes) = 0;
  virtual void do_host_unregister(void* ptr) = 0;
  virtual MemInfo do_mem_info() = 0;
  virtual void do_enqueue_kernel(Stream stream, const DeviceKernel& kernel) = 0;
  [[nodiscard]] virtual bool do_can_run(const DeviceKernel& kernel) const = 0;
  virtual double do_host_now_ns();
  virtual double do_run_host_work(const HostWork& work, const std::function<void()>& body);
  [[nodiscard]] virtual bool do_times_storage() const { return false; }
  virtual void do_enqueue_storage(Stream stream, double bytes, double bytes_per_s);
};

/// Which backend `open_device` picks.
enum class Backend { automatic, cuda, sim };
/// Parses "auto" | "cuda" | "sim". Throws ConfigError.
Backend parse_backend(const std::string& name);

/// Why CUDA can or cannot be used on this machine.
struct CudaStatus {
  bool compiled = false;   ///< memtide was built with CUDA
  bool usable = false;     ///< a driver and at least one GPU answered
  int device_count = 0;
  int runtime_version = 0; ///< cudart version memtide was built against (e.g. 13000)
  int driver_version = 0;  ///< 0 when no driver
  std::string reason;      ///< why not usable, in words
};

CudaStatus cuda_status();  ///< probes CUDA on each call; never throws nor crashes without a driver
/// Opens device `index`: `automatic` is CUDA when cuda_status() is usable, else SimDevice (set
/// from the options table). Asking for `cuda` where it is not usable throws Error with the reason.
std::unique_ptr<Device> open_device(Backend backend, int index = 0);
Backend resolve_backend(Backend backend);  ///< the backend `automatic` resolves to on this machine
/// Number of devices the backend offers (SimDevice: 1).
int device_count(Backend backend);

}  // namespace memtide
