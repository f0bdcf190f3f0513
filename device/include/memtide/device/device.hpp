#pragma once
/// @file
/// The machine as memtide sees it: device memory, streams, events and asynchronous copies.
///
/// `Device` has a small public, non-virtual interface and a private virtual core (`allocate` ->
/// `do_allocate`), so argument checks and accounting live in one place and the two
/// implementations (CudaDevice, SimDevice) only do the work. Everything above `device/` is written
/// against this interface and runs unchanged on both.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace memtide {

/// A stream handle. For CudaDevice this is the `cudaStream_t`; null is the default stream.
/// Streams are compared and hashed by handle, which is how the caching allocator keys its pools.
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
  /// False for a device whose memory holds no bytes (a phantom SimDevice: timing only). Nothing
  /// in its memory, nor in host memory registered as phantom, may be dereferenced.
  bool stores_data = true;
  /// Its streams and events keep time on a virtual clock (a SimDevice): their durations are
  /// modelled, and what watches the host's clock (CUPTI, the phase tracker's wall times) sees none.
  bool virtual_clock = false;
  /// Its memory is host memory the CPU may address (a SimDevice in data mode).
  bool host_addressable = false;
};

/// One kernel in the two forms the device layer can run: the CUDA launch, and the same
/// computation on the host over memory the host can reach (a simulated device's memory). The
/// device picks the form it runs and charges its cost to the stream.
struct DeviceKernel {
  /// Enqueues the CUDA kernel on the stream; the device is current when it is called. Null where
  /// the build has no CUDA kernels.
  std::function<void(Stream)> launch;
  /// The same result computed on the calling thread (a simulated device runs it, in data mode).
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

  /// Raw device memory (a whole segment, like cudaMalloc). Throws OutOfMemory when the device
  /// cannot provide `bytes`; never returns null for bytes > 0.
  void* allocate(std::size_t bytes);
  /// Returns memory from allocate(). Implicitly synchronizes the device, like cudaFree.
  void deallocate(void* ptr, std::size_t bytes);

  /// @name Virtual memory
  /// Address ranges whose memory is mapped and unmapped in granules (CUDA's cuMemAddressReserve,
  /// cuMemCreate, cuMemMap): the caching allocator's expandable segments grow and shrink in place.
  /// @{
  /// The granule in bytes; 0 when this device cannot (a driver without virtual memory management).
  [[nodiscard]] std::size_t vmm_granularity();
  /// Reserves `bytes` (a multiple of the granule) of address space; no memory yet. Throws Error
  /// when the device cannot, OutOfMemory when the address space is exhausted.
  void* reserve_address(std::size_t bytes);
  /// Releases a reservation; nothing in it may be mapped.
  void release_address(void* base, std::size_t bytes);
  /// Backs [at, at + bytes) of a reservation (granule-aligned) with device memory, readable and
  /// writable by this device. Throws OutOfMemory when the device has no room (nothing mapped then).
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

  /// Asynchronous copy ordered on `stream`. Host memory should be registered (pinned) for full
  /// bandwidth; unregistered host memory is copied at pageable rates.
  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream);
  /// Asynchronous fill of device memory with a byte value.
  void memset_async(void* ptr, int value, std::size_t bytes, Stream stream);

  /// Page-locks host memory so copies from and to it run at full bandwidth.
  void host_register(void* ptr, std::size_t bytes);
  void host_unregister(void* ptr);

  /// Enqueues `kernel` on `stream`, this device current. Throws Error when this device cannot run
  /// it (see can_run), InvalidArgument for negative costs.
  void enqueue_kernel(Stream stream, const DeviceKernel& kernel);
  /// True when enqueue_kernel can run `kernel` here: a GPU needs its launch, a simulated device
  /// its host form.
  [[nodiscard]] bool can_run(const DeviceKernel& kernel) const;

  /// The host's clock in ns, the one the device's events are compared with: wall time on a real
  /// device, the virtual host clock on a simulated one.
  double host_now_ns();
  /// Runs `body` on the calling thread as host work for this device's pipeline and returns its
  /// duration on host_now_ns()'s clock. A simulated device charges `work` to its virtual clock
  /// (and runs `body` only when it stores data); a real one runs and times `body`.
  double run_host_work(const HostWork& work, const std::function<void()>& body);

  /// @name Storage transfers
  /// A device with a clock of its own for the storage drive (a simulated one) times the NVMe
  /// tier's transfers there, so its host clock shows the drive; on a real device the drive is
  /// timed by the transfers themselves and there is nothing to enqueue.
  /// @{
  /// True when enqueue_storage is available on this device.
  [[nodiscard]] bool times_storage() const;
  /// A transfer between host memory and a storage drive on `stream`: `bytes` at `bytes_per_s`,
  /// one drive serving reads and writes in turn. Throws InvalidArgument for bytes < 0 or a rate
  /// <= 0 (or not finite), Error where times_storage() is false.
  void enqueue_storage(Stream stream, double bytes, double bytes_per_s);
  /// @}

  [[nodiscard]] const DeviceProperties& properties() const noexcept { return props_; }
  [[nodiscard]] MemInfo mem_info();

 protected:
  DeviceProperties props_;

 private:
  virtual void* do_allocate(std::size_t bytes) = 0;
  virtual void do_deallocate(void* ptr, std::size_t bytes) = 0;
  /// Virtual memory: unsupported (granule 0, the rest throw) unless overridden.
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
  /// Wall clock (steady_clock) unless overridden.
  virtual double do_host_now_ns();
  /// Runs and times `body` on the wall clock unless overridden.
  virtual double do_run_host_work(const HostWork& work, const std::function<void()>& body);
  /// No storage clock unless overridden (enqueue_storage then throws).
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

/// Probes CUDA once per call. Never throws and never crashes without a driver.
CudaStatus cuda_status();

/// Opens device `index` on the requested backend. `automatic` picks CUDA when `cuda_status()`
/// is usable and SimDevice otherwise. Asking for `cuda` where it is not usable throws Error
/// with the reason. SimDevice settings come from the options table.
std::unique_ptr<Device> open_device(Backend backend, int index = 0);

/// The backend `automatic` resolves to on this machine.
Backend resolve_backend(Backend backend);

/// Number of devices the backend offers (SimDevice: 1).
int device_count(Backend backend);

}  // namespace memtide
