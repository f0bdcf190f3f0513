#include "memtide/device/cuda_device.hpp"

#include <cuda_runtime.h>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"

namespace memtide {
namespace {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // clear non-sticky errors so the next call starts clean
  throw CudaError(static_cast<int>(err), std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                             cudaGetErrorString(err) + ")");
}

cudaStream_t raw(Stream s) { return static_cast<cudaStream_t>(s.handle); }
cudaEvent_t raw(Event e) { return static_cast<cudaEvent_t>(e.handle); }

}  // namespace

CudaDevice::CudaDevice(int index) : index_(index) {
  check(cudaSetDevice(index), "cudaSetDevice");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
  props_.backend = "cuda";
  props_.name = prop.name;
  props_.index = index;
  props_.total_memory = prop.totalGlobalMem;
  props_.copy_engines = prop.asyncEngineCount;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, index) == cudaSuccess) props_.pci_bus_id = bus;
}

void CudaDevice::activate() const {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != index_) check(cudaSetDevice(index_), "cudaSetDevice");
}

void* CudaDevice::do_allocate(std::size_t bytes) {
  activate();
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw OutOfMemory("cudaMalloc of " + format_bytes(bytes) + " on GPU " + std::to_string(index_) + " failed");
  }
  check(err, "cudaMalloc");
  return p;
}

void CudaDevice::do_deallocate(void* ptr, std::size_t /*bytes*/) {
  activate();
  check(cudaFree(ptr), "cudaFree");
}

Stream CudaDevice::do_create_stream() {
  activate();
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return Stream{s};
}

void CudaDevice::do_destroy_stream(Stream stream) { check(cudaStreamDestroy(raw(stream)), "cudaStreamDestroy"); }

Event CudaDevice::do_create_event(bool timing) {
  activate();
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
  return Event{e};
}

void CudaDevice::do_destroy_event(Event event) { check(cudaEventDestroy(raw(event)), "cudaEventDestroy"); }

void CudaDevice::do_record_event(Event event, Stream stream) {
  activate();  // the null stream means the current device's default stream
  check(cudaEventRecord(raw(event), raw(stream)), "cudaEventRecord");
}

void CudaDevice::do_stream_wait_event(Stream stream, Event event) {
  activate();  // the null stream means the current device's default stream
  check(cudaStreamWaitEvent(raw(stream), raw(event), 0), "cudaStreamWaitEvent");
}

bool CudaDevice::do_event_query(Event event) {
  const cudaError_t err = cudaEventQuery(raw(event));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void CudaDevice::do_event_synchronize(Event event) { check(cudaEventSynchronize(raw(event)), "cudaEventSynchronize"); }

float CudaDevice::do_event_elapsed_ms(Event start, Event end) {
  float ms = 0;
  check(cudaEventElapsedTime(&ms, raw(start), raw(end)), "cudaEventElapsedTime");
  return ms;
}

void CudaDevice::do_stream_synchronize(Stream stream) {
  activate();
  check(cudaStreamSynchronize(raw(stream)), "cudaStreamSynchronize");
}

void CudaDevice::do_synchronize() {
  activate();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void CudaDevice::do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) {
  activate();  // the null stream means the current device's default stream
  const cudaMemcpyKind k = kind == CopyKind::host_to_device   ? cudaMemcpyHostToDevice
                           : kind == CopyKind::device_to_host ? cudaMemcpyDeviceToHost
                                                              : cudaMemcpyDeviceToDevice;
  check(cudaMemcpyAsync(dst, src, bytes, k, raw(stream)), "cudaMemcpyAsync");
}

void CudaDevice::do_memset_async(void* ptr, int value, std::size_t bytes, Stream stream) {
  activate();  // the null stream means the current device's default stream
  check(cudaMemsetAsync(ptr, value, bytes, raw(stream)), "cudaMemsetAsync");
}

void CudaDevice::do_enqueue_kernel(Stream stream, const DeviceKernel& kernel) {
  activate();  // a launch goes to the current device; the null stream means its default stream
  kernel.launch(stream);  // checks its own launch
}

bool CudaDevice::do_can_run(const DeviceKernel& kernel) const { return static_cast<bool>(kernel.launch); }

void CudaDevice::do_host_register(void* ptr, std::size_t bytes) {
  activate();  // registration maps the range into the current device's context first
  check(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault), "cudaHostRegister");
}

void CudaDevice::do_host_unregister(void* ptr) {
  activate();
  check(cudaHostUnregister(ptr), "cudaHostUnregister");
}

MemInfo CudaDevice::do_mem_info() {
  activate();
  MemInfo m;
  check(cudaMemGetInfo(&m.free, &m.total), "cudaMemGetInfo");
  return m;
}

CudaStatus cuda_status() {
  CudaStatus st;
  st.compiled = true;
  cudaRuntimeGetVersion(&st.runtime_version);
  if (cudaDriverGetVersion(&st.driver_version) != cudaSuccess) st.driver_version = 0;
  const cudaError_t err = cudaGetDeviceCount(&st.device_count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    st.device_count = 0;
    switch (err) {
      case cudaErrorInsufficientDriver: st.reason = "no NVIDIA driver is loaded (cudaErrorInsufficientDriver)"; break;
      case cudaErrorStubLibrary: st.reason = "only the CUDA stub driver library is present (cudaErrorStubLibrary)"; break;
      case cudaErrorNoDevice: st.reason = "the driver reports no CUDA device (cudaErrorNoDevice)"; break;
      default: st.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err); break;
    }
    return st;
  }
  if (st.device_count == 0) {
    st.reason = "the driver reports no CUDA device";
    return st;
  }
  st.usable = true;
  return st;
}

std::unique_ptr<Device> make_cuda_device(int index) { return std::make_unique<CudaDevice>(index); }

}  // namespace memtide
