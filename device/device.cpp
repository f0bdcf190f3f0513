#include "memtide/device/device.hpp"

#include <chrono>
#include <cmath>
#include <string>

#include "memtide/core/error.hpp"

namespace memtide {

// Argument checks live here, once, so the backends can assume sane input.

void* Device::allocate(std::size_t bytes) {
  if (bytes == 0) throw InvalidArgument("Device::allocate: zero bytes requested");
  return do_allocate(bytes);
}

void Device::deallocate(void* ptr, std::size_t bytes) {
  if (ptr == nullptr) return;
  do_deallocate(ptr, bytes);
}

Stream Device::create_stream() { return do_create_stream(); }
void Device::destroy_stream(Stream stream) {
  if (stream.handle != nullptr) do_destroy_stream(stream);
}
Event Device::create_event(bool timing) { return do_create_event(timing); }
void Device::destroy_event(Event event) {
  if (event.valid()) do_destroy_event(event);
}
void Device::record_event(Event event, Stream stream) {
  if (!event.valid()) throw InvalidArgument("Device::record_event: invalid event");
  do_record_event(event, stream);
}
void Device::stream_wait_event(Stream stream, Event event) {
  if (!event.valid()) throw InvalidArgument("Device::stream_wait_event: invalid event");
  do_stream_wait_event(stream, event);
}
bool Device::event_query(Event event) {
  if (!event.valid()) throw InvalidArgument("Device::event_query: invalid event");
  return do_event_query(event);
}
void Device::event_synchronize(Event event) {
  if (!event.valid()) throw InvalidArgument("Device::event_synchronize: invalid event");
  do_event_synchronize(event);
}
float Device::event_elapsed_ms(Event start, Event end) {
  if (!start.valid() || !end.valid()) throw InvalidArgument("Device::event_elapsed_ms: invalid event");
  return do_event_elapsed_ms(start, end);
}
void Device::stream_synchronize(Stream stream) { do_stream_synchronize(stream); }
void Device::synchronize() { do_synchronize(); }

void Device::copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) {
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) throw InvalidArgument("Device::copy_async: null pointer");
  do_copy_async(dst, src, bytes, kind, stream);
}

void Device::memset_async(void* ptr, int value, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  if (ptr == nullptr) throw InvalidArgument("Device::memset_async: null pointer");
  do_memset_async(ptr, value, bytes, stream);
}

void Device::host_register(void* ptr, std::size_t bytes) {
  if (ptr == nullptr || bytes == 0) throw InvalidArgument("Device::host_register: null pointer or zero bytes");
  do_host_register(ptr, bytes);
}

void Device::host_unregister(void* ptr) {
  if (ptr != nullptr) do_host_unregister(ptr);
}

MemInfo Device::mem_info() { return do_mem_info(); }

std::size_t Device::vmm_granularity() { return do_vmm_granularity(); }

namespace {
void check_granules(Device& d, const void* at, std::size_t bytes, const char* what) {
  const std::size_t g = d.vmm_granularity();
  if (g == 0) throw Error(std::string("Device::") + what + ": " + d.properties().name + " has no virtual memory management");
  if (bytes == 0 || bytes % g != 0 || reinterpret_cast<std::uintptr_t>(at) % g != 0) {
    throw InvalidArgument(std::string("Device::") + what + ": address and size must be multiples of the " +
                          std::to_string(g) + "-byte granule (got " + std::to_string(bytes) + " bytes)");
  }
}
}  // namespace

void* Device::reserve_address(std::size_t bytes) {
  check_granules(*this, nullptr, bytes, "reserve_address");
  return do_reserve_address(bytes);
}
void Device::release_address(void* base, std::size_t bytes) {
  check_granules(*this, base, bytes, "release_address");
  do_release_address(base, bytes);
}
void Device::map_memory(void* at, std::size_t bytes) {
  check_granules(*this, at, bytes, "map_memory");
  do_map_memory(at, bytes);
}
void Device::unmap_memory(void* at, std::size_t bytes) {
  check_granules(*this, at, bytes, "unmap_memory");
  do_unmap_memory(at, bytes);
}
void* Device::do_reserve_address(std::size_t) { throw Error("virtual memory is not supported by " + props_.name); }
void Device::do_release_address(void*, std::size_t) { throw Error("virtual memory is not supported by " + props_.name); }
void Device::do_map_memory(void*, std::size_t) { throw Error("virtual memory is not supported by " + props_.name); }
void Device::do_unmap_memory(void*, std::size_t) { throw Error("virtual memory is not supported by " + props_.name); }

void Device::enqueue_kernel(Stream stream, const DeviceKernel& kernel) {
  if (!(kernel.hbm_bytes >= 0) || !(kernel.params >= 0)) {
    throw InvalidArgument("Device::enqueue_kernel: hbm_bytes and params must be >= 0, got " +
                          std::to_string(kernel.hbm_bytes) + " and " + std::to_string(kernel.params));
  }
  if (!do_can_run(kernel)) {
    throw Error("Device::enqueue_kernel: device \"" + props_.name + "\" cannot run this kernel: " +
                (props_.backend == "cuda" ? "this build has no CUDA kernel for it" : "it has no host form"));
  }
  do_enqueue_kernel(stream, kernel);
}

bool Device::can_run(const DeviceKernel& kernel) const { return do_can_run(kernel); }

double Device::host_now_ns() { return do_host_now_ns(); }

double Device::run_host_work(const HostWork& work, const std::function<void()>& body) {
  if (!(work.dram_bytes >= 0) || !(work.params >= 0)) {
    throw InvalidArgument("Device::run_host_work: dram_bytes and params must be >= 0, got " +
                          std::to_string(work.dram_bytes) + " and " + std::to_string(work.params));
  }
  return do_run_host_work(work, body);
}

double Device::do_host_now_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

double Device::do_run_host_work(const HostWork& /*work*/, const std::function<void()>& body) {
  const double t0 = do_host_now_ns();
  if (body) body();
  return do_host_now_ns() - t0;
}

bool Device::times_storage() const { return do_times_storage(); }

void Device::enqueue_storage(Stream stream, double bytes, double bytes_per_s) {
  if (!(bytes >= 0) || !(bytes_per_s > 0) || !std::isfinite(bytes) || !std::isfinite(bytes_per_s)) {
    throw InvalidArgument("Device::enqueue_storage: bytes must be >= 0 and bytes_per_s > 0, got " +
                          std::to_string(bytes) + " and " + std::to_string(bytes_per_s));
  }
  do_enqueue_storage(stream, bytes, bytes_per_s);
}

void Device::do_enqueue_storage(Stream /*stream*/, double /*bytes*/, double /*bytes_per_s*/) {
  throw Error("Device::enqueue_storage: device \"" + props_.name + "\" has no storage clock to time transfers on");
}

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::automatic;
  if (name == "cuda") return Backend::cuda;
  if (name == "sim") return Backend::sim;
  throw ConfigError("device backend \"" + name + "\" is not accepted: expected auto, cuda or sim");
}

}  // namespace memtide
