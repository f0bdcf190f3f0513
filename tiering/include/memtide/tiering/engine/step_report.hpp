#pragma once
/// @file
/// What an update phase reports: per-resource busy time and bytes, every operation for the
/// timeline, and the rates it measured for the Calibration.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "memtide/tiering/nvme/nvme_staging.hpp"

namespace memtide::tiering {

/// How long one resource was busy in a phase (the union of its operations' intervals) and what
/// it moved.
struct ResourceUse {
  double busy_ns = 0;
  double bytes = 0;
  double params = 0;
  std::uint64_t ops = 0;
};

/// Rates measured in one phase, in the units Calibration consumes (0 where nothing ran).
struct Measurements {
  double h2d_bytes_per_ns = 0;
  double d2h_bytes_per_ns = 0;
  double cpu_update_params_per_ns = 0;
  double gpu_update_params_per_ns = 0;
  double phase_ns = 0;
};

/// One operation of an update phase, for the timeline: what it was ("prefetch", "gpu update",
/// "flush", "cpu update", "param upload", "grad upload", "grad to host"), the subgroup it served,
/// when it ran (ns from the phase start) and the bytes it moved (for an update: through memory).
struct TieringOp {
  const char* what = "";
  std::size_t subgroup = 0;
  double start_ns = 0;
  double end_ns = 0;
  double bytes = 0;
};

struct StepReport {
  bool skipped = false;  ///< a gradient was not finite: nothing was stepped
  /// A CPU update met a non-finite scaled gradient (the fused kernel's own flag; the state of
  /// that subgroup now holds it). Only meaningful when the run was not told the gradients are finite.
  bool cpu_nonfinite = false;
  /// Every operation of the phase (device ops on the device's clock from the phase start event,
  /// CPU updates on the host clock from the phase start).
  std::vector<TieringOp> ops;
  double phase_start_ns = 0;  ///< host clock at the phase start
  double phase_ns = 0;   ///< from the phase start to the last transfer's end (host clock)
  ResourceUse cpu, gpu, h2d, d2h;
  double h2d_d2h_overlap_ns = 0;  ///< time both PCIe directions were busy at once
  NvmeUse nvme;                   ///< the NVMe tier's reads and write-backs (none without one)
  /// Each of them, and each wait for a read, with its times (NvmeTransfer: absolute, on the
  /// transfers' own clock) and the engine's subgroup.
  std::vector<NvmeTransfer> nvme_transfers;
  std::size_t params_cpu = 0;
  std::size_t params_gpu = 0;
  std::size_t params_gpu_static = 0;
  /// CachingAllocator counts: allocations made while setting up the phase, and inside the loop
  /// (must be 0), and device segment allocations inside the loop (must be 0).
  std::int64_t setup_allocations = 0;
  std::int64_t loop_allocations = 0;
  std::int64_t loop_device_allocs = 0;

  [[nodiscard]] Measurements measurements() const;
};

}  // namespace memtide::tiering
