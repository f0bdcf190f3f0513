// The iteration simulator: whole ZeRO-3 iterations on a phantom SimDevice through the real
// allocator, phase tracker, gradient path and scheduler. Small shapes, except where the paper's
// 20B model is the point.

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/simulator/iteration_sim.hpp"
#include "sim_fixtures.hpp"

using namespace memtide;
using namespace memtide::tiering;

namespace {

ModelShape small() { return test::small_model(); }
using test::small_node;

double op_bytes(const IterationResult& r, const char* engine, double from_s, double to_s) {
  double bytes = 0;
  for (const SimOp& op : r.ops) {
    if (std::string(op.engine) == engine && op.start_ns >= from_s * 1e9 && op.end_ns <= to_s * 1e9 * (1 + 1e-12)) {
      bytes += op.bytes;
    }
  }
  return bytes;
}

double all_bytes(const IterationResult& r, const char* engine) {
  double bytes = 0;
  for (const SimOp& op : r.ops) {
    if (std::string(op.engine) == engine) bytes += op.bytes;
  }
  return bytes;
}

}  // namespace

TEST(IterationSim, PhasesComeInOrderAndAddUp) {
  for (Contender c : kContenders) {
    const IterationResult r = simulate_iteration(small(), small_node(), c, SimulationOptions{3, true});
    EXPECT_LT(r.phase_start_s[0], r.phase_start_s[1]) << to_string(c);
    EXPECT_LT(r.phase_start_s[1], r.phase_start_s[2]) << to_string(c);
    EXPECT_LT(r.phase_start_s[2], r.end_s) << to_string(c);
    EXPECT_NEAR(r.simulated.forward_s + r.simulated.backward_s + r.simulated.update_s, r.simulated.iteration_s,
                1e-9 * r.simulated.iteration_s);
    // Nothing of this iteration runs before its forward or after its update.
    for (const SimOp& op : r.ops) {
      EXPECT_GE(op.start_ns, r.phase_start_s[0] * 1e9 - 1) << to_string(c) << " " << op.engine;
      EXPECT_LE(op.end_ns, r.end_s * 1e9 + 1) << to_string(c) << " " << op.engine;
    }
  }
}

TEST(IterationSim, GradientFlushesFallInsideBackwardAndUploadsInsideTheUpdate) {
  // A GPU too small to keep the optimizer state: gradients must go to the host.
  NodeSpec tight = small_node();
  tight.device.capacity = 1ULL << 30;
  const IterationResult r = simulate_iteration(small(), tight, Contender::memtide, SimulationOptions{3, true});
  const double t0 = r.phase_start_s[0], t1 = r.phase_start_s[1], t2 = r.phase_start_s[2];
  // The gradient path's D2H copies run while backward computes, and are done when it ends (the
  // rest is the 4-byte readback of its non-finite counter).
  EXPECT_EQ(op_bytes(r, "d2h", t0, t1), 0.0);
  EXPECT_GT(r.grad_bytes_to_host, 0.0);
  EXPECT_NEAR(op_bytes(r, "d2h", t1, t2), r.grad_bytes_to_host, 1024.0);
  // No H2D before the update phase but the gradient path's 4-byte check counter: params are
  // gathered over the GPU links, not uploaded.
  EXPECT_LT(op_bytes(r, "h2d", t0, t2), 1024.0);
  // The 16-bit params the CPU updated go up inside the update phase (ZeRO-3 updates all on the
  // CPU; this small model's state would fit the GPU whole under memtide).
  const IterationResult zero = simulate_iteration(small(), small_node(), Contender::zero3_offload, SimulationOptions{3, true});
  const double shard = small().params() / small_node().gpus;
  EXPECT_NEAR(op_bytes(zero, "h2d", zero.phase_start_s[2], zero.end_s), 2 * shard, 0.01 * shard);
  EXPECT_DOUBLE_EQ(op_bytes(zero, "h2d", zero.phase_start_s[2], zero.end_s), all_bytes(zero, "h2d"));
  // The all-gathers and reduce-scatters ran on the links in forward and backward.
  EXPECT_GT(op_bytes(r, "link", t0, t1), 0.0);
  EXPECT_GT(op_bytes(r, "link", t1, t2), 0.0);
}

TEST(IterationSim, Zero3FlushesStallBackwardAndMemtidesDoNot) {
  const ModelShape m = small();
  const NodeSpec n = small_node();
  const IterationResult zero = simulate_iteration(m, n, Contender::zero3_offload);
  const IterationResult mt = simulate_iteration(m, n, Contender::memtide);
  // ZeRO-3 sends fp16 through pageable staging (2 B/param of the rank's shard) and waits for it.
  const double shard = m.params() / n.gpus;
  EXPECT_NEAR(zero.grad_bytes_to_host, 2 * shard, 0.01 * shard);
  EXPECT_GT(zero.simulated.backward_s, zero.simulated.forward_s * 2 + 2 * shard / n.pageable_flush_bytes_per_s * 0.99);
  EXPECT_LT(mt.simulated.backward_s, zero.simulated.backward_s);
  EXPECT_LE(mt.grad_bytes_to_host, 4 * shard * 1.01);  // fp32, minus what stayed on the GPU
  EXPECT_LT(mt.simulated.iteration_s, zero.simulated.iteration_s);
  EXPECT_EQ(zero.plan.gpu_streamed + zero.plan.static_residents, 0U);  // every update on the CPU
}

TEST(IterationSim, CapacityIsNeverExceeded) {
  for (const char* name : {"7B", "20B"}) {
    for (Contender c : kContenders) {
      const IterationResult r = simulate_iteration(ModelShape::table2(name), NodeSpec{}, c);
      for (int p = 0; p < kPhaseCount; ++p) {
        EXPECT_LE(r.peak_bytes[p], r.peak_reserved_bytes[p]) << name << " " << to_string(c);
        EXPECT_LE(r.peak_reserved_bytes[p], r.capacity_bytes) << name << " " << to_string(c) << " phase " << p;
      }
      EXPECT_GT(r.peak_bytes[static_cast<int>(Phase::backward)], 0U);
    }
  }
}

TEST(IterationSim, TheSameInputsGiveTheSameResult) {
  for (Contender c : kContenders) {
    const IterationResult a = simulate_iteration(small(), small_node(), c);
    const IterationResult b = simulate_iteration(small(), small_node(), c);
    EXPECT_EQ(a.simulated.iteration_s, b.simulated.iteration_s) << to_string(c);
    EXPECT_EQ(a.simulated.backward_s, b.simulated.backward_s) << to_string(c);
    EXPECT_EQ(a.predicted.iteration_s, b.predicted.iteration_s) << to_string(c);
    EXPECT_EQ(a.plan.placement, b.plan.placement) << to_string(c);
    for (int p = 0; p < kPhaseCount; ++p) EXPECT_EQ(a.peak_bytes[p], b.peak_bytes[p]) << to_string(c);
  }
}

// The paper's structure on its 20B model and node: memtide at least 2x ZeRO-3 offload over whole
// iterations, its update phase within 90% of the resource bound, the prediction within 10%.
TEST(IterationSim, Table2TwentyBillionOnFourH100s) {
  const ModelShape m = ModelShape::table2("20B");
  const IterationResult zero = simulate_iteration(m, NodeSpec{}, Contender::zero3_offload);
  const IterationResult twin = simulate_iteration(m, NodeSpec{}, Contender::twinflow);
  const IterationResult mt = simulate_iteration(m, NodeSpec{}, Contender::memtide);
  EXPECT_GT(zero.simulated.iteration_s / mt.simulated.iteration_s, 2.0);
  EXPECT_LT(twin.simulated.iteration_s, zero.simulated.iteration_s);
  EXPECT_GT(twin.simulated.iteration_s, mt.simulated.iteration_s);
  EXPECT_GE(mt.update_bound_s / mt.simulated.update_s, 0.9);
  for (const IterationResult* r : {&zero, &twin, &mt}) {
    EXPECT_NEAR(r->predicted.iteration_s, r->simulated.iteration_s, 0.1 * r->simulated.iteration_s)
        << to_string(r->contender);
  }
}

TEST(IterationSim, AModelThatDoesNotFitIsAnOutOfMemoryErrorNamingThePhase) {
  NodeSpec n = small_node();
  n.device.capacity = 1ULL << 30;
  ModelShape m = small();
  m.hidden = 4096;
  m.heads = 32;
  try {
    (void)simulate_iteration(m, n, Contender::memtide);
    FAIL() << "a model of " << m.params() << " params fit in 1 GiB";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("phase"), std::string::npos) << e.what();
  }
}

// Out of memory in the middle of a pass (a window too large for the activations), or while the
// window's buffers are made, leaves nothing allocated behind: the allocator is destroyed without
// live allocations to warn about.
TEST(IterationSim, OutOfMemoryLeavesNothingAllocated) {
  ModelShape m = ModelShape::table2("40B");
  NodeSpec n;
  n.gpus = 1;
  n.device.capacity = 32ULL << 30;
  for (int window : {16, 24}) {
    n.window_blocks = window;
    testing::internal::CaptureStderr();
    EXPECT_THROW((void)simulate_iteration(m, n, Contender::memtide), OutOfMemory) << window;
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_EQ(log.find("live allocation"), std::string::npos) << window << ": " << log;
  }
}

// Memory pressure is counted: a window that leaves the passes little room makes the allocator
// release its cache and retry, one that leaves plenty does not.
TEST(IterationSim, AllocatorRetriesCountMemoryPressure) {
  ModelShape m = ModelShape::table2("40B");
  NodeSpec n;
  n.gpus = 1;
  n.device.capacity = 32ULL << 30;
  n.window_blocks = 1;
  EXPECT_EQ(simulate_iteration(m, n, Contender::memtide).alloc_retries, 0);
  n.window_blocks = 12;
  EXPECT_GT(simulate_iteration(m, n, Contender::memtide).alloc_retries, 0);
}

TEST(IterationSim, BadInputsAreNamed) {
  auto expect_named = [](const auto& call, const std::string& word) {
    try {
      call();
      FAIL() << "accepted; expected an error naming " << word;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  expect_named([] { (void)ModelShape::table2("30B"); }, "7B, 8.3B, 10B, 13B, 20B");
  ModelShape m = small();
  m.layers = 0;
  expect_named([&] { (void)simulate_iteration(m, small_node(), Contender::memtide); }, "layers");
  m = small();
  m.heads = 7;
  expect_named([&] { (void)simulate_iteration(m, small_node(), Contender::memtide); }, "heads 7");
  NodeSpec n = small_node();
  n.gpus = 0;
  expect_named([&] { (void)simulate_iteration(small(), n, Contender::memtide); }, "gpus");
  n = small_node();
  n.gpu_flops = -1;
  expect_named([&] { (void)simulate_iteration(small(), n, Contender::memtide); }, "gpu_flops");
  n = small_node();
  n.subgroup_params = 1;
  expect_named([&] { (void)simulate_iteration(small(), n, Contender::memtide); }, "subgroups");
  expect_named([&] { (void)simulate_iteration(small(), small_node(), Contender::memtide, SimulationOptions{0, false}); },
               "iterations");
}

TEST(PerfModel, PredictIterationAddsThePassesAndTheUpdate) {
  PassWork fwd;
  fwd.compute_ns = 100;
  fwd.comm_ns = 60;
  fwd.lead_ns = 5;
  PassWork bwd;
  bwd.compute_ns = 200;
  bwd.comm_ns = 150;
  bwd.async_ns = 260;  // the asynchronous flushes outlast the kernels
  bwd.tail_ns = 10;
  Prediction upd;
  upd.total_ns = 50;
  const IterationPrediction p = PerfModel{}.predict_iteration(fwd, bwd, upd);
  EXPECT_DOUBLE_EQ(p.forward_ns, 105);
  EXPECT_DOUBLE_EQ(p.backward_ns, 260);
  EXPECT_DOUBLE_EQ(p.update_ns, 50);
  EXPECT_DOUBLE_EQ(p.total_ns, 415);
  bwd.stall_ns = 100;  // a blocking flush adds to the kernels
  EXPECT_DOUBLE_EQ(PerfModel{}.predict_iteration(fwd, bwd, upd).backward_ns, 310);
  bwd.compute_ns = -1;
  EXPECT_THROW((void)PerfModel{}.predict_iteration(fwd, bwd, upd), InvalidArgument);
}

TEST(IterationSim, TheUpdatePhasesOperationsNameTheirSubgroupsAndFallInsideIt) {
  NodeSpec tight = small_node();
  tight.device.capacity = 1ULL << 30;  // too small for every subgroup to stay: some are streamed
  const IterationResult mt = simulate_iteration(small(), tight, Contender::memtide, SimulationOptions{3, true});
  const IterationResult zero = simulate_iteration(small(), tight, Contender::zero3_offload, SimulationOptions{3, true});
  const std::size_t n = mt.plan.placement.size();
  for (const IterationResult* r : {&mt, &zero}) {
    ASSERT_FALSE(r->tiering.empty()) << to_string(r->contender);
    for (const TieringOp& op : r->tiering) {
      EXPECT_LT(op.subgroup, n) << op.what;
      EXPECT_GE(op.start_ns, r->phase_start_s[2] * 1e9 - 1) << op.what;
      EXPECT_LE(op.end_ns, r->end_s * 1e9 + 1) << op.what;
      EXPECT_LE(op.start_ns, op.end_ns) << op.what;
    }
  }
  std::map<std::string, std::size_t> zero_ops, mt_ops;
  for (const TieringOp& op : zero.tiering) ++zero_ops[op.what];
  for (const TieringOp& op : mt.tiering) ++mt_ops[op.what];
  // ZeRO-3: every subgroup updated on the CPU and its 16-bit params uploaded, nothing else.
  EXPECT_EQ(zero_ops["cpu update"], n);
  EXPECT_EQ(zero_ops["param upload"], n);
  EXPECT_EQ(zero_ops.size(), 2U);
  // memtide: one update per subgroup, wherever it ran; a streamed one is prefetched and flushed.
  EXPECT_EQ(mt_ops["cpu update"] + mt_ops["gpu update"], n);
  EXPECT_GT(mt.plan.gpu_streamed, 0U);
  EXPECT_EQ(mt_ops["prefetch"], mt.plan.gpu_streamed);
  EXPECT_EQ(mt_ops["flush"], mt.plan.gpu_streamed);
}

TEST(IterationSim, TheWindowHoldsFewerParamsAndCopiesEachBlockInTwiceLessTheTurn) {
  ModelShape m = small();
  NodeSpec n = small_node();
  n.gpus = 1;
  const IterationResult whole = simulate_iteration(m, n, Contender::memtide);
  n.window_blocks = 2;
  const IterationResult windowed = simulate_iteration(m, n, Contender::memtide);
  EXPECT_EQ(whole.window_blocks, 0);
  EXPECT_EQ(windowed.window_blocks, 2);
  // Forward copies in blocks 2..5 (0 and 1 came in during the last update), backward 3..0 (the
  // turn kept 5 and 4), and the update phase 0 and 1 for the next forward: 2 L - m shards.
  const double shard = m.layer_params() * 2;
  EXPECT_NEAR(windowed.window_h2d_bytes, 10 * shard, shard * 0.01);
  EXPECT_LT(windowed.peak_bytes[static_cast<int>(Phase::forward)], whole.peak_bytes[static_cast<int>(Phase::forward)]);
  n.window_blocks = 6;  // every block: no window
  EXPECT_EQ(simulate_iteration(m, n, Contender::memtide).window_blocks, 0);
  n.window_blocks = -2;
  EXPECT_THROW(simulate_iteration(m, n, Contender::memtide), InvalidArgument);
}

TEST(IterationSim, UpdatesDuringBackwardShortenTheUpdateAndOnlyForMemtide) {
  const ModelShape m = ModelShape::table2("20B");
  NodeSpec n;
  const IterationResult base = simulate_iteration(m, n, Contender::memtide);
  n.updates_during_backward = true;
  const IterationResult eager = simulate_iteration(m, n, Contender::memtide);
  EXPECT_EQ(base.backward_update_params, 0);
  EXPECT_GT(eager.backward_update_params, 0);
  EXPECT_LT(eager.simulated.update_s, base.simulated.update_s);
  EXPECT_LT(eager.simulated.iteration_s, base.simulated.iteration_s);
  EXPECT_EQ(simulate_iteration(m, n, Contender::zero3_offload).backward_update_params, 0);
}

// The simulator chooses by training's rule (choose_backward_updates): while any subgroup spills to
// NVMe, the engine updates none during backward, so the simulated memtide does not either.
TEST(IterationSim, UpdatesDuringBackwardFollowTheEngineWhenStateSpills) {
  const ModelShape m = ModelShape::table2("20B");
  NodeSpec n;
  n.updates_during_backward = true;
  n.host_budget_bytes = std::uint64_t{64} << 30;
  const IterationResult spilled = simulate_iteration(m, n, Contender::memtide);
  EXPECT_GT(spilled.nvme_subgroups, 0u);
  EXPECT_EQ(spilled.backward_update_params, 0);
}
