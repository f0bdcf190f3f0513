#pragma once
// The device implementations every typed suite runs against: SimDevice always, CudaDevice when a
// GPU answers (skipped otherwise, with the reason).

#include <gtest/gtest.h>

#include <memory>

#include "memtide/device/device.hpp"
#include "memtide/device/sim_device.hpp"

namespace memtide::test {

struct SimBackend {
  static constexpr bool simulated = true;
  static std::unique_ptr<Device> make() {
    SimConfig config;
    config.capacity = 512ULL << 20;
    return std::make_unique<SimDevice>(config);
  }
};

struct CudaBackend {
  static constexpr bool simulated = false;
  static std::unique_ptr<Device> make() {
    if (!cuda_status().usable) return nullptr;
    return open_device(Backend::cuda, 0);
  }
};

using DeviceBackends = ::testing::Types<SimBackend, CudaBackend>;

struct BackendNames {
  template <typename T>
  static std::string GetName(int) {
    return T::simulated ? "Sim" : "Cuda";
  }
};

template <typename Backend>
class WithDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = Backend::make();
    if (!device_) GTEST_SKIP() << "no usable GPU: " << cuda_status().reason;
  }
  Device& device() { return *device_; }
  /// The SimDevice, or null on real hardware.
  SimDevice* sim() { return dynamic_cast<SimDevice*>(device_.get()); }
  std::unique_ptr<Device> device_;
};

}  // namespace memtide::test
