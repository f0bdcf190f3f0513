// SimulatedSave: a checkpoint save on a SimDevice's clock, protected by the steps as StateSnapshot
// is; and simulate_iteration's iterations beside one.

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/simulator/iteration_sim.hpp"
#include "memtide/simulator/save_sim.hpp"
#include "sim_fixtures.hpp"

using namespace memtide;
using namespace memtide::tiering;

namespace {

SimConfig phantom_device() {
  SimConfig c;
  c.phantom = true;
  return c;
}

constexpr double kRate = 1e9;  // bytes/s: 12 ms per 1M-param subgroup

TEST(SimulatedSave, UntouchedItTakesTheStateOverTheRate) {
  SimDevice device(phantom_device());
  SimulatedSave save(device, {1'000'000, 1'000'000, 500'000}, kRate, 0);
  EXPECT_FALSE(save.done());
  EXPECT_NEAR(save.end_ns() - save.start_ns(), 30e6, 1);
  device.advance_host(29e6);
  EXPECT_FALSE(save.done());
  device.advance_host(2e6);
  EXPECT_TRUE(save.done());
  EXPECT_EQ(save.waited_ns(), 0);
}

TEST(SimulatedSave, AStepCopiesWhileTheBufferHasRoomThenWaitsForTheWriter) {
  SimDevice device(phantom_device());
  // Four subgroups, a buffer of one: the writer starts on the last (3).
  SimulatedSave save(device, std::vector<std::size_t>(4, 1'000'000), kRate, 12'000'000);
  save.protect(0, nullptr, nullptr, nullptr);  // copied aside: the step goes on
  EXPECT_EQ(save.copied_bytes(), 12'000'000U);
  EXPECT_EQ(save.waited_ns(), 0);
  const double before = device.now_ns();
  save.protect(1, nullptr, nullptr, nullptr);  // no room: the writer takes it after the one it writes
  EXPECT_GT(save.waited_ns(), 12e6);  // at least its own write
  EXPECT_NEAR(device.now_ns() - before, save.waited_ns(), 1);
  save.protect(1, nullptr, nullptr, nullptr);  // written now: no wait
  save.protect(0, nullptr, nullptr, nullptr);  // copied: no wait
  const double waited = save.waited_ns();
  save.wait();
  EXPECT_TRUE(save.done());
  EXPECT_EQ(save.waited_ns(), waited);
  EXPECT_EQ(save.peak_buffer_bytes(), 12'000'000U);
  // Four writes, whatever their order, at the rate: the save ends 48 ms after it began.
  EXPECT_NEAR(save.end_ns() - save.start_ns(), 48e6, 1e3);
}

TEST(SimulatedSave, ASubgroupTheWriterIsOnHasItsRestCopiedAsideOrIsWaitedForWhenTheBufferIsFull) {
  for (const std::uint64_t bound : {std::uint64_t{24'000'000}, std::uint64_t{5'000'000}}) {
    SimDevice device(phantom_device());
    // Two subgroups: the writer starts on the last (1), 12 ms long.
    SimulatedSave save(device, std::vector<std::size_t>(2, 1'000'000), kRate, bound);
    device.advance_host(3e6);  // a quarter of it written
    save.protect(1, nullptr, nullptr, nullptr);
    if (bound == 24'000'000) {
      EXPECT_NEAR(static_cast<double>(save.copied_bytes()), 9e6, 1) << "the three quarters not written";
      EXPECT_EQ(save.waited_ns(), 0);
    } else {  // no room for the rest: wait for the write's end
      EXPECT_EQ(save.copied_bytes(), 0U);
      EXPECT_NEAR(save.waited_ns(), 9e6, 1e3);
    }
    save.wait();
    EXPECT_TRUE(save.done());
    EXPECT_NEAR(save.end_ns() - save.start_ns(), 24e6, 1e3) << "the writer's pace is the same from the copy";
  }
}

TEST(SimulatedSave, ABadRateIsRefused) {
  SimDevice device(phantom_device());
  EXPECT_THROW(SimulatedSave(device, {10}, 0, 0), InvalidArgument);
  EXPECT_THROW(SimulatedSave(device, {10}, -1, 0), InvalidArgument);
}

// Through the real engine and scheduler: a fast disk costs the iterations nothing, a slow one
// with a small buffer makes the steps wait, and the save's time is the state over the rate
// plus at most the copies' effect. ZeRO-3 offload's updates are all on the CPU (the small model
// fits memtide's on the GPU, whose residents' host state no step writes during the save).
TEST(SimulatedSave, IterationsBesideASaveAreSlowedOnlyWhenTheStepsOutrunTheWriter) {
  const ModelShape model = test::small_model();
  const NodeSpec node = test::small_node();
  SimulationOptions options;
  options.save = true;
  options.save_write_bytes_per_s = 1e15;
  const IterationResult fast = simulate_iteration(model, node, Contender::zero3_offload, options);
  ASSERT_TRUE(fast.save.ran);
  ASSERT_FALSE(fast.save.iteration_s.empty());
  EXPECT_EQ(std::accumulate(fast.save.waited_s.begin(), fast.save.waited_s.end(), 0.0), 0.0);
  EXPECT_NEAR(fast.save.iteration_s.front(), fast.simulated.iteration_s, 0.01 * fast.simulated.iteration_s);

  // A disk that needs about two iterations for the state, a buffer of one subgroup.
  options.save_write_bytes_per_s = fast.save.state_bytes / (2 * fast.simulated.iteration_s);
  options.save_buffer_bytes = 12 * node.subgroup_params;
  const IterationResult slow = simulate_iteration(model, node, Contender::zero3_offload, options);
  const double waited = std::accumulate(slow.save.waited_s.begin(), slow.save.waited_s.end(), 0.0);
  std::size_t cpu = 0;
  for (Placement p : slow.plan.placement) cpu += p == Placement::cpu;
  ASSERT_GT(cpu, slow.plan.placement.size() / 2);
  EXPECT_GT(waited, 0);
  EXPECT_GT(slow.save.iteration_s.front(), slow.simulated.iteration_s);
  EXPECT_GE(slow.save.save_s, slow.save.state_bytes / options.save_write_bytes_per_s * (1 - 1e-9));
  // The steps that wait for the writer pace it: the save ends within the iterations beside it.
  EXPECT_LE(slow.save.save_s, std::accumulate(slow.save.iteration_s.begin(), slow.save.iteration_s.end(), 0.0));
}

}  // namespace
