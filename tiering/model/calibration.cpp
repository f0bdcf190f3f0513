#include "memtide/tiering/model/calibration.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"
#include "model_inputs.hpp"

namespace memtide::tiering {
namespace {

void require_duration(const char* where, const char* field, double ns) {
  if (!(ns > 0) || !std::isfinite(ns)) {
    throw InvalidArgument(std::string("Calibration::") + where + ": " + field + " = " + show_number(ns) +
                          " is not accepted: expected a positive, finite number of nanoseconds");
  }
}

}  // namespace

CalibrationConfig CalibrationConfig::from_options() {
  const Options& o = options();
  CalibrationConfig c;
  c.alpha = o.calibration_alpha;
  c.history = static_cast<std::size_t>(o.calibration_history);
  return c;
}

Calibration::Calibration(const Rates& defaults, CalibrationConfig config) : config_(config), rates_(defaults) {
  if (!(config.alpha > 0 && config.alpha <= 1)) {
    throw InvalidArgument("Calibration: alpha = " + show_number(config.alpha) + " is not accepted: expected a number in (0, 1]");
  }
  if (config.history == 0) {
    throw InvalidArgument("Calibration: history = 0 is not accepted: expected at least 1 phase");
  }
}

Rates Calibration::rates() const {
  std::lock_guard lock(mutex_);
  return rates_;
}

double& Calibration::field(Kind kind) {
  switch (kind) {
    case kH2d: return rates_.h2d_bytes_per_s;
    case kD2h: return rates_.d2h_bytes_per_s;
    case kCpuUpdate: return rates_.cpu_update_params_per_s;
    case kGpuUpdate: return rates_.gpu_update_params_per_s;
    case kCpuDownscale: break;
    case kKinds: break;
  }
  return rates_.cpu_downscale_params_per_s;
}

void Calibration::observe(Kind kind, const char* what, double amount, double ns) {
  require_duration(what, "ns", ns);
  const double measured = amount / ns * 1e9;
  std::lock_guard lock(mutex_);
  double& rate = field(kind);
  rate = seen_[kind] ? (1 - config_.alpha) * rate + config_.alpha * measured : measured;
  seen_[kind] = true;
}

void Calibration::observe_copy(CopyKind kind, std::size_t bytes, double ns) {
  if (kind == CopyKind::device_to_device) {
    throw InvalidArgument("Calibration::observe_copy: kind = device_to_device is not accepted: expected "
                          "host_to_device or device_to_host (the model has no device-to-device rate)");
  }
  if (bytes == 0) {
    throw InvalidArgument("Calibration::observe_copy: bytes = 0 is not accepted: expected at least 1 byte");
  }
  observe(kind == CopyKind::host_to_device ? kH2d : kD2h, "observe_copy", static_cast<double>(bytes), ns);
}

void Calibration::observe_cpu_update(std::size_t params, double ns) {
  if (params == 0) throw InvalidArgument("Calibration::observe_cpu_update: params = 0 is not accepted: expected at least 1");
  observe(kCpuUpdate, "observe_cpu_update", static_cast<double>(params), ns);
}

void Calibration::observe_gpu_update(std::size_t params, double ns) {
  if (params == 0) throw InvalidArgument("Calibration::observe_gpu_update: params = 0 is not accepted: expected at least 1");
  observe(kGpuUpdate, "observe_gpu_update", static_cast<double>(params), ns);
}

void Calibration::observe_cpu_downscale(std::size_t params, double ns) {
  if (params == 0) {
    throw InvalidArgument("Calibration::observe_cpu_downscale: params = 0 is not accepted: expected at least 1");
  }
  observe(kCpuDownscale, "observe_cpu_downscale", static_cast<double>(params), ns);
}

void Calibration::observe_pcie(const PcieObservation& o) {
  if (!(o.window_ns > 0) || !std::isfinite(o.window_ns)) {
    throw InvalidArgument("Calibration::observe_pcie: window_ns = " + std::to_string(o.window_ns) +
                          " is not accepted: expected a positive, finite time");
  }
  for (double v : {o.h2d_busy_ns, o.d2h_busy_ns, o.own_h2d_busy_ns, o.own_d2h_busy_ns}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw InvalidArgument("Calibration::observe_pcie: a busy time of " + std::to_string(v) +
                            " ns is not accepted: expected a finite time >= 0");
    }
  }
  // Never all of a link: a plan must keep some rate to be a plan at all.
  const double h2d = std::clamp((o.h2d_busy_ns - o.own_h2d_busy_ns) / o.window_ns, 0.0, 0.95);
  const double d2h = std::clamp((o.d2h_busy_ns - o.own_d2h_busy_ns) / o.window_ns, 0.0, 0.95);
  std::lock_guard lock(mutex_);
  const double a = foreign_seen_ ? config_.alpha : 1.0;
  foreign_share_[0] = (1 - a) * foreign_share_[0] + a * h2d;
  foreign_share_[1] = (1 - a) * foreign_share_[1] + a * d2h;
  foreign_seen_ = true;
}

std::pair<double, double> Calibration::foreign_pcie_share() const {
  std::lock_guard lock(mutex_);
  return {foreign_share_[0], foreign_share_[1]};
}

Rates Calibration::rates_for_planning() const {
  std::lock_guard lock(mutex_);
  Rates r = rates_;
  r.h2d_bytes_per_s *= 1 - foreign_share_[0];
  r.d2h_bytes_per_s *= 1 - foreign_share_[1];
  return r;
}

double Calibration::observe_update_phase(double predicted_ns, double measured_ns) {
  return observe_error(kUpdatePhase, "observe_update_phase", "update", predicted_ns, measured_ns);
}

double Calibration::observe_iteration(double predicted_ns, double measured_ns) {
  return observe_error(kIteration, "observe_iteration", "iteration", predicted_ns, measured_ns);
}

double Calibration::observe_error(Span span, const char* fn, const char* what, double predicted_ns,
                                  double measured_ns) {
  require_duration(fn, "predicted_ns", predicted_ns);
  require_duration(fn, "measured_ns", measured_ns);
  const double error = (measured_ns - predicted_ns) / predicted_ns;
  {
    std::lock_guard lock(mutex_);
    std::deque<double>& log = errors_[span];
    log.push_back(error);
    while (log.size() > config_.history) log.pop_front();
  }
  MEMTIDE_LOG(info, [&] {
    char pct[32];
    std::snprintf(pct, sizeof pct, "%+.1f%%", error * 100);
    return std::string(what) + ": predicted " + format_duration_ns(predicted_ns) + ", measured " +
           format_duration_ns(measured_ns) + " (" + pct + ")";
  }());
  return error;
}

std::vector<double> Calibration::recent_errors() const {
  std::lock_guard lock(mutex_);
  return {errors_[kUpdatePhase].begin(), errors_[kUpdatePhase].end()};
}

PredictionErrors Calibration::summarize(Span span) const {
  std::lock_guard lock(mutex_);
  const std::deque<double>& log = errors_[span];
  PredictionErrors s;
  s.count = log.size();
  if (log.empty()) return s;
  s.last = log.back();
  double sum = 0;
  for (double e : log) {
    sum += std::abs(e);
    s.max_abs = std::max(s.max_abs, std::abs(e));
  }
  s.mean_abs = sum / static_cast<double>(log.size());
  return s;
}

}  // namespace memtide::tiering
