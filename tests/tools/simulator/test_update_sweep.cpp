// The update-phase sweep: the plan against the swept strides on the phantom H100 node.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/simulator/update_sweep.hpp"

using namespace memtide;
using namespace memtide::tiering;

TEST(UpdateSweep, OneModelGivesEveryPolicyAndAVerdictPerGradientPlacement) {
  UpdateSweepSetup setup;
  setup.models = {"7B"};
  const UpdateSweep sweep = simulate_update_sweep(setup);
  ASSERT_EQ(sweep.verdicts.size(), 2u);
  const auto count = [&](const std::string& policy) {
    return std::count_if(sweep.rows.begin(), sweep.rows.end(), [&](const UpdateSweepRow& r) { return r.policy == policy; });
  };
  EXPECT_EQ(count("cpu"), 1);
  EXPECT_EQ(count("static20"), 1);
  EXPECT_EQ(count("auto"), 2);
  EXPECT_GE(count("interleaved"), 2 * 25);
  const UpdateSweepRow& cpu = sweep.rows.front();
  EXPECT_EQ(cpu.policy, "cpu");
  EXPECT_DOUBLE_EQ(cpu.params, 7e9);
  EXPECT_EQ(cpu.shard_params, 1'750'000'000u);
  EXPECT_EQ(cpu.subgroups, 18u);
  EXPECT_EQ(cpu.gpu_fraction, 0.0);
  for (const UpdateSweepVerdict& v : sweep.verdicts) {
    // Interleaving beats the CPU alone and the static split; the plan lands near the best stride.
    EXPECT_LT(v.best_s, v.static20_s);
    EXPECT_LT(v.static20_s, v.cpu_s);
    EXPECT_GT(v.plan_k, 1.0);
    EXPECT_LT(v.plan_s, v.best_s * 1.10) << "grads on " << (v.grads_on_gpu ? "gpu" : "host");
  }
}

TEST(UpdateSweep, LessDramPerGpuSlowsTheCpuSide) {
  UpdateSweepSetup setup;
  setup.models = {"7B"};
  const double full = simulate_update_sweep(setup).verdicts[0].cpu_s;
  setup.host_dram_bytes_per_s = 20e9;
  EXPECT_GT(simulate_update_sweep(setup).verdicts[0].cpu_s, full);
}

TEST(UpdateSweep, ABadSetupIsRefusedNamingTheField) {
  const auto refused = [](UpdateSweepSetup s, const std::string& word) {
    try {
      (void)simulate_update_sweep(s);
    } catch (const InvalidArgument& e) {
      return std::string(e.what()).find(word) != std::string::npos;
    }
    return false;
  };
  UpdateSweepSetup s;
  s.gpus = 0;
  EXPECT_TRUE(refused(s, "gpus"));
  s = {};
  s.host_dram_bytes_per_s = 0;
  EXPECT_TRUE(refused(s, "host_dram_bytes_per_s"));
  s = {};
  s.gpu_slots = 0;
  EXPECT_TRUE(refused(s, "gpu_slots"));
  s = {};
  s.models = {"3B"};
  EXPECT_TRUE(refused(s, "3B"));
}
