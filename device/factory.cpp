#include <string>

#include "memtide/core/error.hpp"
#include "memtide/device/device.hpp"
#include "memtide/device/sim_device.hpp"

namespace memtide {

#ifdef MEMTIDE_HAVE_CUDA
std::unique_ptr<Device> make_cuda_device(int index);  // cuda_device.cpp
#else
CudaStatus cuda_status() {
  CudaStatus st;
  st.reason = "memtide was built without CUDA";
  return st;
}
#endif

Backend resolve_backend(Backend backend) {
  if (backend != Backend::automatic) return backend;
  return cuda_status().usable ? Backend::cuda : Backend::sim;
}

int device_count(Backend backend) {
  backend = resolve_backend(backend);
  if (backend == Backend::sim) return 1;
  const CudaStatus st = cuda_status();
  return st.usable ? st.device_count : 0;
}

std::unique_ptr<Device> open_device(Backend backend, int index) {
  backend = resolve_backend(backend);
  if (backend == Backend::sim) {
    if (index != 0) throw InvalidArgument("SimDevice has one device; index " + std::to_string(index) + " requested");
    SimConfig config = sim_config_from_options();
    return std::make_unique<SimDevice>(config);
  }
  const CudaStatus st = cuda_status();
  if (!st.usable) throw Error("CUDA device requested but CUDA is not usable: " + st.reason);
  if (index < 0 || index >= st.device_count) {
    throw InvalidArgument("GPU index " + std::to_string(index) + " out of range: " + std::to_string(st.device_count) +
                          " GPU(s) present");
  }
#ifdef MEMTIDE_HAVE_CUDA
  return make_cuda_device(index);
#else
  throw Error("unreachable: CUDA usable without CUDA support");
#endif
}

}  // namespace memtide
