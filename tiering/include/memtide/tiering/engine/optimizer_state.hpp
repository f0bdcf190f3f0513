#pragma once
/// @file
/// The fp32 optimizer state of one process (params, exp_avg, exp_avg_sq, grads), split into
/// subgroups: the unit the UpdateScheduler places on the CPU or the GPU.
///
/// Subgroups are contiguous ranges of the flattened parameters (boundaries need not align with
/// tensors). The host arrays live in one of three kinds of memory:
/// - owned: one pinned slab per subgroup from a SlabSource, the four arrays inside it, each
///   64-byte aligned;
/// - external: pointers the caller owns (e.g. torch tensors of a Python optimizer);
/// - phantom: no bytes at all. Addresses are reserved in a range no allocator uses and registered
///   with a phantom SimDevice, which never dereferences them; for simulating large plans.

#include <cstddef>
#include <memory>
#include <vector>

#include "memtide/allocator/host_slab.hpp"
#include "memtide/device/device.hpp"
#include "memtide/tiering/host/pinned_buffer.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"
#include "memtide/tiering/model/placement.hpp"
#include "memtide/tiering/nvme/spill_state.hpp"

namespace memtide::tiering {

/// One subgroup's host arrays and where its gradient and low-precision params are on the device.
struct Subgroup {
  std::size_t offset = 0;  ///< first element in the flattened parameters
  std::size_t n = 0;       ///< elements
  float* param = nullptr;  ///< host fp32 master params
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* grad = nullptr;   ///< host fp32 gradient (filled by the GradSink or the caller)
  /// fp32 gradient kept in device memory (GradSink, for GPU-updated subgroups); null = on host.
  const float* device_grad = nullptr;
  /// The model's low-precision params for this range, in device memory; null = not written.
  void* model_param = nullptr;
  /// The NVMe tier's subgroup (NvmeStaging) that holds this range's state, or kInHostMemory:
  /// then `param`, `exp_avg` and `exp_avg_sq` above are not read or written by a step; the state
  /// comes from staging, starting `nvme_offset` elements into that subgroup.
  std::size_t nvme_subgroup = kInHostMemory;
  std::size_t nvme_offset = 0;
  static constexpr std::size_t kInHostMemory = static_cast<std::size_t>(-1);
  [[nodiscard]] bool on_nvme() const noexcept { return nvme_subgroup != kInHostMemory; }
};

/// Caller-owned arrays of one subgroup (external memory).
struct ExternalSubgroup {
  float* param = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* grad = nullptr;
  std::size_t n = 0;
  /// The model's low-precision params for these elements, in device memory; null = not written.
  void* model_param = nullptr;
};

enum class StateMemory { owned, external, phantom };

/// Implements SpillRoutes: the NVMe tier routes spilled entries to its staging through it.
class OptimizerState final : public SpillRoutes {
 public:
  /// Owned memory: `total_params` split into subgroups of `subgroup_size` (0: the
  /// MEMTIDE_SUBGROUP_SIZE option), one slab each from `slabs`; state zeroed.
  static std::unique_ptr<OptimizerState> owned(Device& device, SlabSource& slabs, std::size_t total_params,
                                               std::size_t subgroup_size = 0);
  /// External memory: one subgroup per entry, in order. Pointers must stay valid. `model_dtype`
  /// (fp16 or bf16) is the type of the entries' model_param; required when any is set.
  static std::unique_ptr<OptimizerState> external(Device& device, const std::vector<ExternalSubgroup>& subgroups,
                                                  DType model_dtype = DType::none);
  /// Phantom memory on a device that stores no data (a phantom SimDevice); throws
  /// InvalidArgument for any other device.
  static std::unique_ptr<OptimizerState> phantom(Device& device, std::size_t total_params,
                                                 std::size_t subgroup_size = 0);

  ~OptimizerState();
  OptimizerState(const OptimizerState&) = delete;
  OptimizerState& operator=(const OptimizerState&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return subgroups_.size(); }
  [[nodiscard]] Subgroup& operator[](std::size_t i) { return subgroups_.at(i); }
  [[nodiscard]] const Subgroup& operator[](std::size_t i) const { return subgroups_.at(i); }
  [[nodiscard]] std::size_t total_params() const noexcept { return total_; }
  [[nodiscard]] std::size_t largest_subgroup() const noexcept;
  [[nodiscard]] StateMemory memory() const noexcept { return memory_; }
  [[nodiscard]] Device& device() noexcept { return device_; }
  /// Host bytes this object holds (owned slabs; 0 for external and phantom).
  [[nodiscard]] std::size_t host_bytes() const noexcept;

  /// Points every subgroup's model_param into `device_params`, the flattened low-precision model
  /// parameters (fp16 or bf16) in device memory; null detaches. Throws InvalidArgument for fp32/none.
  void set_model_params(void* device_params, DType dtype);
  /// The model's low-precision type (none until set_model_params).
  [[nodiscard]] DType model_dtype() const noexcept { return model_dtype_; }

  /// Index of the subgroup that holds flattened element `offset`.
  [[nodiscard]] std::size_t subgroup_of(std::size_t offset) const;

  /// SpillRoutes: subgroup `range` is stepped from the NVMe tier's staging (Subgroup::nvme_subgroup).
  void stage_from(std::size_t range, std::size_t subgroup, std::size_t offset) override {
    Subgroup& g = subgroups_.at(range);
    g.nvme_subgroup = subgroup;
    g.nvme_offset = offset;
  }

 private:
  OptimizerState(Device& device, StateMemory memory) : device_(device), memory_(memory) {}

  Device& device_;
  StateMemory memory_;
  std::vector<Subgroup> subgroups_;
  std::size_t total_ = 0;
  SlabSource* slabs_ = nullptr;
  std::vector<HostSlab> owned_slabs_;
  void* phantom_base_ = nullptr;  ///< registered phantom range (phantom memory)
  std::size_t phantom_bytes_ = 0;
  DType model_dtype_ = DType::none;
};

}  // namespace memtide::tiering
