#pragma once
/// @file
/// The update-phase performance model (paper Eq. 1, extended) and the planner built on it.
///
/// The paper balances CPU update time against GPU swap time to pick the stride k. memtide's
/// model also counts (a) the fused downscale (no separate D_c pass), (b) host DRAM shared by CPU
/// updates and DMA, (c) how many GPU slots fit in the update-phase headroom, and (d) separate H2D
/// and D2H rates. It predicts the update time of any placement; the planner searches placements.
/// Its yardstick is the resource bound: the busiest resource's time (CPU, GPU, H2D, D2H, DRAM).

#include <cstddef>
#include <string>
#include <vector>

#include "memtide/tiering/placement.hpp"

namespace memtide::tiering {

/// Throughputs the model runs on. Calibration keeps them current from measurements.
struct Rates {
  double h2d_bytes_per_s = 55e9;         ///< pinned host -> device
  double d2h_bytes_per_s = 55e9;         ///< device -> pinned host
  double cpu_update_params_per_s = 2e9;  ///< U_c: the fused CPU step (low-precision copy included)
  double gpu_update_params_per_s = 35e9; ///< U_g
  double cpu_downscale_params_per_s = 0; ///< D_c: a separate fp32 -> 16-bit pass; 0 = fused into U_c
  double host_dram_bytes_per_s = 220e9;  ///< host DRAM, shared by CPU updates and DMA
  double cpu_dram_bytes_per_param = 30;  ///< DRAM traffic of one CPU-updated param
};

/// What is being updated and what the GPU can hold.
struct Workload {
  std::vector<std::size_t> subgroup_params;  ///< params per subgroup, in update order
  std::size_t low_precision_bytes = 2;       ///< bytes per param of the model's copy (fp16/bf16)
  bool grads_on_host = true;                 ///< fp32 grads are in host memory
  std::size_t gpu_slot_limit = 3;            ///< streamed subgroups that fit in the headroom at once
  std::size_t gpu_static_limit = 0;          ///< subgroups that may stay resident on the GPU
};

/// Predicted busy time per resource and the resulting update time.
struct Prediction {
  double total_ns = 0;  ///< predicted update-phase time
  double bound_ns = 0;  ///< the busiest resource's time: no schedule of this placement beats it
  double cpu_ns = 0, gpu_ns = 0, h2d_ns = 0, d2h_ns = 0, dram_ns = 0;
  std::string busiest;  ///< "cpu", "gpu", "h2d", "d2h" or "dram"
};

/// A placement for one update phase.
struct Plan {
  Policy policy = Policy::automatic;
  std::vector<Placement> placement;
  double k = 0;                      ///< stride of streamed GPU updates (see interleave); 0 = none
  std::size_t gpu_slots = 0;         ///< GPU buffers the scheduler takes for streamed subgroups
  std::size_t static_residents = 0;
  Prediction prediction;
};

class PerfModel {
 public:
  /// Update time of `placement` (one entry per subgroup) under `rates`.
  [[nodiscard]] Prediction predict(const Workload& work, const Rates& rates,
                                   const std::vector<Placement>& placement) const;
  /// The plan `policy` gives. `static_fraction` is the GPU-resident share for static_split;
  /// `k` is the stride for interleaved.
  [[nodiscard]] Plan plan(const Workload& work, const Rates& rates, Policy policy,
                          double static_fraction = 0.2, double k = 2) const;
};

}  // namespace memtide::tiering
