#include "memtide/tiering/model/calibration.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"

using namespace memtide::tiering;
using memtide::CopyKind;

namespace {

CalibrationConfig config(double alpha, std::size_t history = 100) {
  CalibrationConfig c;
  c.alpha = alpha;
  c.history = history;
  return c;
}

TEST(Calibration, StartsFromTheDefaults) {
  Rates defaults;
  defaults.cpu_update_params_per_s = 1.25e9;
  const Calibration cal(defaults, config(0.5));
  EXPECT_EQ(cal.rates().cpu_update_params_per_s, 1.25e9);
  EXPECT_EQ(cal.rates().h2d_bytes_per_s, defaults.h2d_bytes_per_s);
  EXPECT_EQ(cal.error_summary().count, 0U);
}

TEST(Calibration, FirstObservationReplacesTheDefaultThenSmooths) {
  const double alpha = 0.25;
  Calibration cal(Rates{}, config(alpha));
  cal.observe_copy(CopyKind::host_to_device, 1'000'000'000, 1e8);  // 10 GB/s
  EXPECT_DOUBLE_EQ(cal.rates().h2d_bytes_per_s, 10e9);
  cal.observe_copy(CopyKind::host_to_device, 2'000'000'000, 1e8);  // 20 GB/s
  EXPECT_DOUBLE_EQ(cal.rates().h2d_bytes_per_s, (1 - alpha) * 10e9 + alpha * 20e9);
  cal.observe_copy(CopyKind::host_to_device, 500'000'000, 1e8);    // 5 GB/s
  const double expected = (1 - alpha) * ((1 - alpha) * 10e9 + alpha * 20e9) + alpha * 5e9;
  EXPECT_DOUBLE_EQ(cal.rates().h2d_bytes_per_s, expected);
}

TEST(Calibration, EachKindUpdatesItsOwnRate) {
  const Rates defaults;
  Calibration cal(defaults, config(0.5));
  cal.observe_copy(CopyKind::device_to_host, 3'000'000'000, 1e8);
  cal.observe_cpu_update(400'000'000, 1e8);
  cal.observe_gpu_update(5'000'000'000, 1e8);
  cal.observe_cpu_downscale(600'000'000, 1e8);
  const Rates r = cal.rates();
  EXPECT_DOUBLE_EQ(r.d2h_bytes_per_s, 30e9);
  EXPECT_DOUBLE_EQ(r.cpu_update_params_per_s, 4e9);
  EXPECT_DOUBLE_EQ(r.gpu_update_params_per_s, 50e9);
  EXPECT_DOUBLE_EQ(r.cpu_downscale_params_per_s, 6e9);
  EXPECT_EQ(r.h2d_bytes_per_s, defaults.h2d_bytes_per_s);
  EXPECT_EQ(r.host_dram_bytes_per_s, defaults.host_dram_bytes_per_s);
}

TEST(Calibration, AlphaOneKeepsOnlyTheLast) {
  Calibration cal(Rates{}, config(1.0));
  cal.observe_gpu_update(1'000'000'000, 1e8);
  cal.observe_gpu_update(3'000'000'000, 1e8);
  EXPECT_DOUBLE_EQ(cal.rates().gpu_update_params_per_s, 30e9);
}

TEST(Calibration, RejectsBadInputs) {
  Calibration cal(Rates{}, config(0.5));
  const double bad_ns[] = {0.0, -5.0, std::nan(""), std::numeric_limits<double>::infinity()};
  for (double ns : bad_ns) {
    EXPECT_THROW(cal.observe_copy(CopyKind::host_to_device, 100, ns), memtide::InvalidArgument);
    EXPECT_THROW(cal.observe_cpu_update(100, ns), memtide::InvalidArgument);
    EXPECT_THROW(cal.observe_gpu_update(100, ns), memtide::InvalidArgument);
    EXPECT_THROW((void)cal.observe_update_phase(ns, 1e9), memtide::InvalidArgument);
    EXPECT_THROW((void)cal.observe_update_phase(1e9, ns), memtide::InvalidArgument);
  }
  EXPECT_THROW(cal.observe_copy(CopyKind::host_to_device, 0, 1e6), memtide::InvalidArgument);
  EXPECT_THROW(cal.observe_copy(CopyKind::device_to_device, 100, 1e6), memtide::InvalidArgument);
  EXPECT_THROW(cal.observe_cpu_update(0, 1e6), memtide::InvalidArgument);
  EXPECT_THROW(cal.observe_gpu_update(0, 1e6), memtide::InvalidArgument);
  EXPECT_THROW(cal.observe_cpu_downscale(0, 1e6), memtide::InvalidArgument);
  // Nothing rejected reached the rates or the history.
  EXPECT_EQ(cal.rates().h2d_bytes_per_s, Rates{}.h2d_bytes_per_s);
  EXPECT_EQ(cal.error_summary().count, 0U);

  EXPECT_THROW(Calibration(Rates{}, config(0.0)), memtide::InvalidArgument);
  EXPECT_THROW(Calibration(Rates{}, config(1.5)), memtide::InvalidArgument);
  EXPECT_THROW(Calibration(Rates{}, config(std::nan(""))), memtide::InvalidArgument);
  EXPECT_THROW(Calibration(Rates{}, config(0.5, 0)), memtide::InvalidArgument);
  try {
    cal.observe_cpu_update(10, -1);
  } catch (const memtide::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("observe_cpu_update"), std::string::npos) << e.what();
  }
}

TEST(Calibration, KeepsTheLastPredictionErrors) {
  Calibration cal(Rates{}, config(0.5, 3));
  EXPECT_DOUBLE_EQ(cal.observe_update_phase(1e9, 1.5e9), 0.5);
  EXPECT_DOUBLE_EQ(cal.observe_update_phase(2e9, 1e9), -0.5);
  EXPECT_NEAR(cal.observe_update_phase(1e9, 1.1e9), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(cal.observe_update_phase(4e9, 5e9), 0.25);
  const std::vector<double> errors = cal.recent_errors();
  ASSERT_EQ(errors.size(), 3U);  // the first one fell out
  EXPECT_DOUBLE_EQ(errors[0], -0.5);
  EXPECT_DOUBLE_EQ(errors[2], 0.25);
  const PredictionErrors s = cal.error_summary();
  EXPECT_EQ(s.count, 3U);
  EXPECT_DOUBLE_EQ(s.last, 0.25);
  EXPECT_DOUBLE_EQ(s.max_abs, 0.5);
  EXPECT_DOUBLE_EQ(s.mean_abs, (0.5 + errors[1] + 0.25) / 3);
}

TEST(Calibration, LogsPredictedAgainstMeasured) {
  Calibration cal(Rates{}, config(0.5));
  memtide::set_log_level(memtide::LogLevel::info);
  testing::internal::CaptureStderr();
  (void)cal.observe_update_phase(1.23e9, 1.31e9);
  const std::string out = testing::internal::GetCapturedStderr();
  memtide::set_log_level(memtide::LogLevel::warn);
  EXPECT_NE(out.find("update: predicted 1.23 s, measured 1.31 s (+6.5%)"), std::string::npos) << out;

  testing::internal::CaptureStderr();
  (void)cal.observe_update_phase(1.23e9, 1.31e9);  // info is off now
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(Calibration, ConfigComesFromTheOptionsTable) {
  memtide::Options o;
  o.set("calibration_alpha", "0.5");
  o.set("calibration_history", "7");
  EXPECT_EQ(o.calibration_alpha, 0.5);
  EXPECT_EQ(o.calibration_history, 7U);
  EXPECT_THROW(o.set("calibration_alpha", "0"), memtide::ConfigError);
  EXPECT_THROW(o.set("calibration_alpha", "1.01"), memtide::ConfigError);
  EXPECT_THROW(o.set("calibration_history", "0"), memtide::ConfigError);

  const memtide::Options saved = memtide::options();
  memtide::set_options(o);
  const CalibrationConfig c = CalibrationConfig::from_options();
  memtide::set_options(saved);
  EXPECT_EQ(c.alpha, 0.5);
  EXPECT_EQ(c.history, 7U);
}

TEST(Calibration, SlowerMeasuredCpuMovesThePlanToTheGpu) {
  Workload w;
  w.subgroup_params.assign(40, 100'000'000);
  const PerfModel model;
  Calibration cal(Rates{}, config(1.0));
  const Plan before = model.plan(w, cal.rates(), Policy::automatic);
  cal.observe_cpu_update(100'000'000, 2e8);  // 0.5 G params/s, a quarter of the default
  const Plan after = model.plan(w, cal.rates(), Policy::automatic);
  EXPECT_GT(after.gpu_streamed + after.static_residents, before.gpu_streamed + before.static_residents);
}

TEST(Calibration, ConcurrentObservers) {
  Calibration cal(Rates{}, config(0.5));
  auto observe = [&](double ns) {
    for (int i = 0; i < 2000; ++i) {
      cal.observe_copy(CopyKind::host_to_device, 1'000'000, ns);
      (void)cal.observe_update_phase(1e6, ns);
    }
  };
  std::thread a(observe, 1e5);  // 10 GB/s
  std::thread b(observe, 2e5);  // 5 GB/s
  a.join();
  b.join();
  const double rate = cal.rates().h2d_bytes_per_s;
  EXPECT_GE(rate, 5e9);
  EXPECT_LE(rate, 10e9);
  EXPECT_EQ(cal.error_summary().count, 100U);
}

}  // namespace

TEST(Calibration, PcieTrafficMemtideDidNotIssueLowersThePlanningRates) {
  CalibrationConfig cfg;
  cfg.alpha = 0.5;
  Calibration c(Rates{}, cfg);
  EXPECT_EQ(c.rates_for_planning().h2d_bytes_per_s, Rates{}.h2d_bytes_per_s);  // nothing seen: all of it
  PcieObservation o;
  o.window_ns = 1000;
  o.h2d_busy_ns = 700;      // the link ran 70% of the phase...
  o.own_h2d_busy_ns = 300;  // ...memtide's copies 30%: others took 40%
  o.d2h_busy_ns = 100;
  o.own_d2h_busy_ns = 100;  // all of it memtide's
  c.observe_pcie(o);
  auto [h2d, d2h] = c.foreign_pcie_share();
  EXPECT_DOUBLE_EQ(h2d, 0.4);  // the first observation replaces the default outright
  EXPECT_DOUBLE_EQ(d2h, 0.0);
  EXPECT_DOUBLE_EQ(c.rates_for_planning().h2d_bytes_per_s, 0.6 * Rates{}.h2d_bytes_per_s);
  EXPECT_DOUBLE_EQ(c.rates().h2d_bytes_per_s, Rates{}.h2d_bytes_per_s);  // the measured rate itself is kept
  o.own_h2d_busy_ns = 700;  // then nobody else: smoothed with alpha 0.5
  c.observe_pcie(o);
  EXPECT_DOUBLE_EQ(c.foreign_pcie_share().first, 0.2);
  o.h2d_busy_ns = 5000;  // more than the window (overlapping records): never all of a link
  o.own_h2d_busy_ns = 0;
  for (int i = 0; i < 60; ++i) c.observe_pcie(o);
  EXPECT_NEAR(c.foreign_pcie_share().first, 0.95, 1e-9);
  o.window_ns = 0;
  EXPECT_THROW(c.observe_pcie(o), memtide::InvalidArgument);
  o.window_ns = 10;
  o.d2h_busy_ns = -1;
  EXPECT_THROW(c.observe_pcie(o), memtide::InvalidArgument);
}
