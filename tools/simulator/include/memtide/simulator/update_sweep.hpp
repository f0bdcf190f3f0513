#pragma once
/// @file
/// The update-phase sweep: the UpdateScheduler alone on a phantom SimDevice of the Deep Optimizer
/// States H100 node, for the paper's Table 2 models, comparing all-CPU (ZeRO-Offload), static 20%
/// (TwinFlow) and interleaved placement over a sweep of the stride k, and checking the
/// PerfModel's automatic plan (made with the SimDevice's own rates) against the best swept k.
/// Each GPU updates its ZeRO-3 shard (1/gpus of the parameters) with its share of the host; the
/// shards run at once, so the node's update time is one shard's. `memtide simulate --update-sweep`
/// runs it (docs/simulator.md).

#include <cstddef>
#include <string>
#include <vector>

namespace memtide::tiering {

/// What the sweep runs on.
struct UpdateSweepSetup {
  double host_dram_bytes_per_s = 220e9;  ///< the host DRAM share of one GPU
  int gpus = 4;                          ///< shards: the ZeRO-3 data-parallel degree
  std::size_t gpu_slots = 4;             ///< streamed subgroups in flight on the GPU
  std::size_t subgroup_params = 100'000'000;
  /// Table 2 names (ModelShape::table2); empty: 7B, 8.3B, 10B, 13B and 20B.
  std::vector<std::string> models;
  /// Throws InvalidArgument naming the first field out of range.
  void validate() const;
};

/// One simulated update phase, with the PerfModel's prediction of the same placement.
struct UpdateSweepRow {
  std::string model, policy;  ///< policy: cpu, static20, auto or interleaved
  double params = 0;          ///< the model's size as the paper states it
  std::size_t shard_params = 0, subgroups = 0, statics = 0, slots = 0;
  double k = 0, gpu_fraction = 0;
  bool grads_on_gpu = false;  ///< GPU-placed subgroups kept their fp32 gradient there (paper 4.1)
  double update_s = 0, predicted_s = 0, bound_s = 0;
  double throughput_gps = 0, speedup_vs_cpu = 0;
  double cpu_busy_s = 0, gpu_busy_s = 0, h2d_busy_s = 0, d2h_busy_s = 0, h2d_d2h_overlap_s = 0;
  double wall_ms = 0;  ///< the simulation's own run time (the only figure that depends on this machine)
};

/// The plan against the best swept k, per model and gradient placement.
struct UpdateSweepVerdict {
  std::string model;
  bool grads_on_gpu = false;
  double cpu_s = 0, static20_s = 0, best_k = 0, best_s = 0;
  double plan_k = 0, plan_predicted_s = 0, plan_s = 0;
  bool within_tolerance = false;  ///< the plan's simulated time is within `tolerance` of the best
};

struct UpdateSweep {
  static constexpr double tolerance = 0.05;
  std::vector<UpdateSweepRow> rows;
  std::vector<UpdateSweepVerdict> verdicts;
};

/// Runs the sweep (deterministic: virtual time). Throws InvalidArgument for a bad setup.
[[nodiscard]] UpdateSweep simulate_update_sweep(const UpdateSweepSetup& setup);

}  // namespace memtide::tiering
