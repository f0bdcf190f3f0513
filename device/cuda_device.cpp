#include "memtide/device/cuda_device.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <iterator>
#include <type_traits>

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

// torch captures a CUDA graph in the global capture mode, in which any thread's cudaMalloc is
// refused (cudaErrorStreamCaptureUnsupported) and invalidates the capture. A new segment during
// capture is legitimate (the graph's private pool grows), so, as torch's own caching allocator
// does, the allocation runs in the relaxed mode for this thread and the mode is restored after.
// https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__STREAM.html (cudaThreadExchangeStreamCaptureMode)
class RelaxedCapture {
 public:
  RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// The driver's virtual memory functions, looked up once. Null members: this driver has none.
struct VmmApi {
  PFN_cuMemGetAllocationGranularity_v10020 granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 reserve = nullptr;
  PFN_cuMemAddressFree_v10020 release = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 free_handle = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  bool complete = false;
};

const VmmApi& vmm_api() {
  static const VmmApi api = [] {
    VmmApi a;
    auto get = [](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found) == cudaSuccess &&
          found == cudaDriverEntryPointSuccess) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      } else {
        (void)cudaGetLastError();
      }
      return fn != nullptr;
    };
    a.complete = get("cuMemGetAllocationGranularity", a.granularity) & get("cuMemAddressReserve", a.reserve) &
                 get("cuMemAddressFree", a.release) & get("cuMemCreate", a.create) &
                 get("cuMemRelease", a.free_handle) & get("cuMemMap", a.map) & get("cuMemUnmap", a.unmap) &
                 get("cuMemSetAccess", a.set_access);
    return a;
  }();
  return api;
}

void check_cu(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return;
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) throw OutOfMemory(std::string(what) + " failed: out of device memory");
  throw CudaError(static_cast<int>(rc), std::string(what) + " failed: CUresult " + std::to_string(static_cast<int>(rc)));
}

CUmemAllocationProp device_prop(int index) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = index;
  return prop;
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
  // A device or driver without virtual memory management answers the granularity query with an
  // error (CUDA_ERROR_NOT_SUPPORTED): granularity_ stays 0 and segments are plain cudaMalloc.
  if (const VmmApi& api = vmm_api(); api.complete) {
    const CUmemAllocationProp vmm_prop = device_prop(index);
    std::size_t g = 0;
    if (api.granularity(&g, &vmm_prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS) granularity_ = g;
  }
  (void)cudaGetLastError();
}

std::size_t CudaDevice::do_vmm_granularity() { return granularity_; }

void* CudaDevice::do_reserve_address(std::size_t bytes) {
  activate();
  CUdeviceptr base = 0;
  check_cu(vmm_api().reserve(&base, bytes, granularity_, 0, 0), "cuMemAddressReserve");
  return reinterpret_cast<void*>(base);
}

void CudaDevice::do_release_address(void* base, std::size_t bytes) {
  check_cu(vmm_api().release(reinterpret_cast<CUdeviceptr>(base), bytes), "cuMemAddressFree");
}

void CudaDevice::do_map_memory(void* at, std::size_t bytes) {
  activate();
  const VmmApi& api = vmm_api();
  const CUmemAllocationProp prop = device_prop(index_);
  const auto base = reinterpret_cast<CUdeviceptr>(at);
  std::size_t done = 0;
  const RelaxedCapture relaxed;  // expandable segments grow during capture too
  try {
    for (; done < bytes; done += granularity_) {
      CUmemGenericAllocationHandle handle{};
      check_cu(api.create(&handle, granularity_, &prop, 0), "cuMemCreate");
      // The mapping keeps the memory alive; the handle is not needed after it.
      const CUresult mapped = api.map(base + done, granularity_, 0, handle, 0);
      (void)api.free_handle(handle);
      check_cu(mapped, "cuMemMap");
    }
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check_cu(api.set_access(base, bytes, &access, 1), "cuMemSetAccess");
  } catch (...) {
    // Nothing stays mapped from a failed call.
    for (std::size_t undo = 0; undo < done; undo += granularity_) (void)api.unmap(base + undo, granularity_);
    throw;
  }
}

void CudaDevice::do_unmap_memory(void* at, std::size_t bytes) {
  activate();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // like cudaFree: queued work is done first
  const auto base = reinterpret_cast<CUdeviceptr>(at);
  for (std::size_t off = 0; off < bytes; off += granularity_) {
    check_cu(vmm_api().unmap(base + off, granularity_), "cuMemUnmap");
  }
}

void CudaDevice::activate() const {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != index_) check(cudaSetDevice(index_), "cudaSetDevice");
}

void* CudaDevice::do_allocate(std::size_t bytes) {
  activate();
  void* p = nullptr;
  const cudaError_t err = [&] {
    const RelaxedCapture relaxed;
    return cudaMalloc(&p, bytes);
  }();
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
  if (kind == CopyKind::device_to_device) {
    check(cudaMemcpyAsync(dst, src, bytes, k, raw(stream)), "cudaMemcpyAsync");
    return;
  }
  // The runtime takes a host pointer inside a registered range for that range's memory and
  // refuses a copy that runs past the range's end (cudaErrorInvalidValue; seen on an H200 with
  // CUDA 13.0). Such a copy is legitimate here: the NVMe tier registers the host ranges of the
  // subgroups kept in memory, rounded out to pages, and a spilled neighbour's range starts or ends
  // inside such a page. So a host range is copied in pieces that each lie inside one registered
  // range or outside all of them; almost every copy is one piece.
  const auto host = reinterpret_cast<std::uintptr_t>(kind == CopyKind::host_to_device ? src : dst);
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t n = same_registration(host + done, bytes - done);
    check(cudaMemcpyAsync(static_cast<unsigned char*>(dst) + done, static_cast<const unsigned char*>(src) + done, n,
                          k, raw(stream)),
          "cudaMemcpyAsync");
    done += n;
  }
}

std::size_t CudaDevice::same_registration(std::uintptr_t at, std::size_t bytes) const {
  const std::uintptr_t end = at + bytes;
  const std::lock_guard lock(registered_mutex_);
  auto next = registered_.upper_bound(at);  // the first range that starts after `at`
  if (next != registered_.begin()) {
    const auto here = std::prev(next);
    if (at < here->second) return std::min(end, here->second) - at;  // inside it
  }
  if (next != registered_.end() && next->first < end) return next->first - at;  // up to the next one
  return bytes;
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
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  const std::lock_guard lock(registered_mutex_);
  registered_[at] = at + bytes;
}

void CudaDevice::do_host_unregister(void* ptr) {
  activate();
  check(cudaHostUnregister(ptr), "cudaHostUnregister");
  const std::lock_guard lock(registered_mutex_);
  registered_.erase(reinterpret_cast<std::uintptr_t>(ptr));
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
