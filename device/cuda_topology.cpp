// CUDA's view of the GPUs for Topology::discover(): which PCI device each CUDA ordinal is, so that
// GPU indices in the topology are the ordinals every CUDA call uses (whatever CUDA_DEVICE_ORDER
// and CUDA_VISIBLE_DEVICES say).

#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace memtide {

bool cuda_pci_devices(std::vector<std::string>& bus_ids, std::vector<std::string>& names) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  bus_ids.clear();
  names.clear();
  for (int i = 0; i < count; ++i) {
    char bus[64] = {};
    if (cudaDeviceGetPCIBusId(bus, static_cast<int>(sizeof bus), i) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    cudaDeviceProp prop{};
    std::string name;
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      name = prop.name;
    } else {
      (void)cudaGetLastError();
    }
    bus_ids.emplace_back(bus);
    names.push_back(name);
  }
  return true;
}

}  // namespace memtide
