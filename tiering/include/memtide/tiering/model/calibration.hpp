#pragma once
/// @file
/// Keeps the PerfModel's Rates current from what the machine actually does, so the next plan
/// follows the machine rather than a config file, and checks the model against measurements
/// (the paper reports no measured-vs-predicted comparison; memtide logs one every iteration).

#include <cstddef>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "memtide/device/device.hpp"
#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

/// How Calibration smooths and what it remembers.
struct CalibrationConfig {
  double alpha = 0.3;         ///< weight of a new measurement, in (0, 1]; 1 = keep only the last
  std::size_t history = 100;  ///< update-phase prediction errors kept, >= 1
  /// From MEMTIDE_CALIBRATION_ALPHA and MEMTIDE_CALIBRATION_HISTORY. Throws ConfigError.
  static CalibrationConfig from_options();
};

/// Recent update-phase prediction errors, each (measured - predicted) / predicted.
struct PredictionErrors {
  std::size_t count = 0;  ///< phases remembered (at most CalibrationConfig::history)
  double last = 0;        ///< the latest phase's error
  double mean_abs = 0;    ///< mean of |error| over the remembered phases
  double max_abs = 0;     ///< largest |error| over the remembered phases
};

/// What the device's own record (CUPTI) says the PCIe links did during one update phase, and
/// what of it memtide issued itself (its scheduler's copies).
struct PcieObservation {
  double window_ns = 0;          ///< the update phase's length
  double h2d_busy_ns = 0;        ///< time at least one H2D copy ran (any process, any library)
  double d2h_busy_ns = 0;
  double own_h2d_busy_ns = 0;    ///< of which memtide's own copies
  double own_d2h_busy_ns = 0;
};

/// Busy time of each PCIe direction over an interval of the host clock, as a tracer (CUPTI) saw
/// it: every process's and library's copies.
struct LinkTraffic {
  double h2d_busy_ns = 0;
  double d2h_busy_ns = 0;
};

/// Rates measured in this process, smoothed with an exponential moving average
/// (rate = (1 - alpha) * rate + alpha * measured). The first measurement of a kind replaces the
/// default outright: a default is a guess, not a measurement. Thread-safe.
class Calibration {
 public:
  /// Starts from `defaults` (e.g. the paper's H100 figures, or rates saved by an earlier run).
  /// Throws InvalidArgument for alpha outside (0, 1] or history 0.
  explicit Calibration(const Rates& defaults = {}, CalibrationConfig config = CalibrationConfig::from_options());

  /// The current rates (a copy: other threads may observe meanwhile).
  [[nodiscard]] Rates rates() const;

  /// A host<->device copy of `bytes` took `ns`. Updates h2d or d2h. Throws InvalidArgument for
  /// 0 bytes, a duration that is not positive and finite, or a device-to-device copy (the model
  /// has no rate for it).
  void observe_copy(CopyKind kind, std::size_t bytes, double ns);
  /// The CPU updated `params` in `ns` (the fused step, low-precision copy included): U_c.
  void observe_cpu_update(std::size_t params, double ns);
  /// The GPU updated `params` in `ns`: U_g.
  void observe_gpu_update(std::size_t params, double ns);
  /// A separate fp32 -> 16-bit pass converted `params` in `ns`: D_c (unused when fused).
  void observe_cpu_downscale(std::size_t params, double ns);

  /// One update phase was predicted to take `predicted_ns` and took `measured_ns`. Logs both at
  /// info level ("update: predicted 1.23 s, measured 1.31 s (+6.5%)"), remembers the error and
  /// returns it as (measured - predicted) / predicted. Throws InvalidArgument unless both are
  /// positive and finite.
  double observe_update_phase(double predicted_ns, double measured_ns);

  /// The PCIe links during an update phase (from CUPTI): the time they were busy with traffic
  /// memtide did not issue (another process, NCCL, the user's copies) is remembered per direction
  /// as a share of the phase, smoothed like the rates. Throws InvalidArgument for a window that
  /// is not positive and finite, or a negative time.
  void observe_pcie(const PcieObservation& o);
  /// The shares of each PCIe direction taken by traffic memtide did not issue (0 to 0.95).
  [[nodiscard]] std::pair<double, double> foreign_pcie_share() const;
  /// rates() with each PCIe rate reduced by the share others take: what a plan can count on.
  [[nodiscard]] Rates rates_for_planning() const;

  /// One whole iteration (forward, backward, update) was predicted to take `predicted_ns`
  /// (PerfModel::predict_iteration) and took `measured_ns`: as observe_update_phase, kept apart.
  double observe_iteration(double predicted_ns, double measured_ns);

  /// The remembered update-phase prediction errors, oldest first.
  [[nodiscard]] std::vector<double> recent_errors() const;
  [[nodiscard]] PredictionErrors error_summary() const { return summarize(kUpdatePhase); }
  [[nodiscard]] PredictionErrors iteration_error_summary() const { return summarize(kIteration); }

 private:
  enum Kind : std::size_t { kH2d, kD2h, kCpuUpdate, kGpuUpdate, kCpuDownscale, kKinds };
  enum Span : std::size_t { kUpdatePhase, kIteration, kSpans };

  void observe(Kind kind, const char* what, double amount, double ns);
  double observe_error(Span span, const char* fn, const char* what, double predicted_ns, double measured_ns);
  [[nodiscard]] PredictionErrors summarize(Span span) const;
  double& field(Kind kind);

  CalibrationConfig config_;
  mutable std::mutex mutex_;
  Rates rates_;
  bool seen_[kKinds] = {};
  std::deque<double> errors_[kSpans];
  double foreign_share_[2] = {0, 0};  // H2D, D2H
  bool foreign_seen_ = false;
};

}  // namespace memtide::tiering
