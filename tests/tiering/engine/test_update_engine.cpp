// UpdateEngine: host state in the HostArena, plans sized from the phase tracker, every policy
// bit-identical to the CPU kernel run directly. Typed over SimDevice (data mode) and CudaDevice.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "device_types.hpp"
#include "failing_device.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/engine/update_engine.hpp"

namespace memtide::tiering {
namespace {

using test::WithDevice;

constexpr std::size_t kN = 50'000;
constexpr std::size_t kSubgroup = 8'000;  // 7 subgroups, the last one partial

std::vector<std::pair<std::size_t, std::size_t>> cut(std::size_t n, std::size_t per) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t s = 0; s < n; s += per) out.emplace_back(s, std::min(n, s + per));
  return out;
}

// One segment per subgroup, the whole state stepped with one set of hyper-parameters.
std::vector<Segment> all_segments(const UpdateEngine& e, std::int64_t step = 1) {
  std::vector<Segment> out;
  for (std::size_t g = 0; g < e.subgroups().size(); ++g) {
    Segment s;
    s.subgroup = g;
    s.start = e.subgroups()[g].first;
    s.end = e.subgroups()[g].second;
    s.params.lr = 1e-3;
    s.params.weight_decay = 0.01;
    s.params.step = step;
    out.push_back(s);
  }
  return out;
}

// The yardstick: one segment stepped by the CPU kernel directly, over the given arrays.
void reference_step(const Segment& s, float* param, float* exp_avg, float* exp_avg_sq, const float* grad) {
  AdamwArgs a;
  a.param = param + s.start;
  a.exp_avg = exp_avg + s.start;
  a.exp_avg_sq = exp_avg_sq + s.start;
  a.grad = grad + s.start;
  a.n = s.end - s.start;
  a.lr = s.params.lr;
  a.beta1 = s.params.beta1;
  a.beta2 = s.params.beta2;
  a.eps = s.params.eps;
  a.weight_decay = s.params.weight_decay;
  a.step = s.params.step;
  adamw_step(a, nullptr);
}

AllocatorConfig small_margin() {
  AllocatorConfig c;
  c.headroom_margin = 1 << 20;
  return c;
}

HostArenaConfig arena_for(Device& d) {
  HostArenaConfig c;
  c.device = &d;
  c.slab_bytes = 4 << 20;
  return c;
}

template <typename Backend>
class UpdateEngineTest : public WithDevice<Backend> {
 protected:
  void SetUp() override {
    WithDevice<Backend>::SetUp();
    if (this->IsSkipped()) return;
    allocator_ = std::make_unique<CachingAllocator>(this->device(), small_margin());
    arena_ = std::make_unique<HostArena>(arena_for(this->device()));
  }
  void TearDown() override {
    allocator_.reset();
    arena_.reset();
  }
  std::unique_ptr<UpdateEngine> make(std::size_t n = kN, std::size_t per = kSubgroup) {
    return std::make_unique<UpdateEngine>(*allocator_, *arena_, n, cut(n, per), nullptr);
  }
  // Fills the engine's state and gradients with the same random numbers every time.
  static void fill(UpdateEngine& e, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (std::size_t i = 0; i < e.size(); ++i) {
      e.param()[i] = normal(rng);
      e.exp_avg()[i] = normal(rng) * 0.1F;
      e.exp_avg_sq()[i] = std::abs(normal(rng)) * 0.01F;
      e.grad()[i] = normal(rng);
    }
  }
  static std::vector<Segment> whole(const UpdateEngine& e, std::int64_t step) { return all_segments(e, step); }
  std::unique_ptr<CachingAllocator> allocator_;
  std::unique_ptr<HostArena> arena_;
};
TYPED_TEST_SUITE(UpdateEngineTest, test::DeviceBackends, test::BackendNames);

TYPED_TEST(UpdateEngineTest, HostStateIsZeroedExactlySizedArenaMemory) {
  auto e = this->make();
  const std::vector<float*> arrays{e->param(), e->exp_avg(), e->exp_avg_sq(), e->grad()};
  for (float* a : arrays) {
    for (std::size_t i = 0; i < kN; i += 997) ASSERT_EQ(a[i], 0.0F);
  }
  // The step streams all four at once: they start at other offsets within a page (other cache
  // sets), though the arena aligns its blocks to pages or more.
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(arrays[i]) % 64, 0U);
    for (std::size_t j = 0; j < i; ++j) {
      EXPECT_NE(reinterpret_cast<std::uintptr_t>(arrays[i]) % 4096, reinterpret_cast<std::uintptr_t>(arrays[j]) % 4096)
          << i << " and " << j << " share their cache sets";
    }
  }
  EXPECT_GE(e->host_bytes(), 16 * kN);
  EXPECT_LT(e->host_bytes(), 16 * kN + 4 * (this->arena_->config().alignment + 3 * 4160));
  const HostArenaStats s = this->arena_->stats();
  EXPECT_EQ(s.registered_slabs, s.slabs);  // pinned
  e.reset();
  EXPECT_EQ(this->arena_->stats().allocated_bytes, 0U);  // given back
}

TYPED_TEST(UpdateEngineTest, BadSubgroupsAreNamed) {
  auto& a = *this->allocator_;
  auto& h = *this->arena_;
  auto expect_invalid = [&](std::vector<std::pair<std::size_t, std::size_t>> sg, const std::string& what) {
    try {
      UpdateEngine e(a, h, 100, sg, nullptr);
      ADD_FAILURE() << "accepted " << what;
    } catch (const InvalidArgument& ex) {
      EXPECT_NE(std::string(ex.what()).find(what), std::string::npos) << ex.what();
    }
  };
  expect_invalid({}, "subgroups is empty");
  expect_invalid({{0, 50}, {60, 100}}, "[60, 100)");
  expect_invalid({{0, 50}, {50, 50}, {50, 100}}, "[50, 50)");
  expect_invalid({{0, 50}}, "end at 50");
  expect_invalid({{0, 150}}, "[0, 150)");
  EXPECT_THROW(UpdateEngine(a, h, 0, {}, nullptr), InvalidArgument);
  EngineConfig c;
  c.low_precision_bytes = 3;
  EXPECT_THROW(UpdateEngine(a, h, 100, {{0, 100}}, nullptr, c), InvalidArgument);
}

// Placement never changes the numbers: every policy's step equals the CPU kernel run directly.
TYPED_TEST(UpdateEngineTest, EveryPolicyGivesTheCpuKernelsBits) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  auto ref = this->make();
  this->fill(*ref, 7);
  for (std::int64_t step = 1; step <= 3; ++step) {
    for (const Segment& s : this->whole(*ref, step)) {
      reference_step(s, ref->param(), ref->exp_avg(), ref->exp_avg_sq(), ref->grad());
    }
  }
  struct Case {
    Policy policy;
    double fraction;
    std::optional<double> k;
  };
  for (const Case& c : {Case{Policy::cpu, 0, {}}, Case{Policy::static_split, 0.3, {}}, Case{Policy::interleaved, 0, 2},
                        Case{Policy::interleaved, 0.3, 1.5}, Case{Policy::automatic, 0, {}},
                        Case{Policy::automatic, 0.2, 3}}) {
    auto e = this->make();
    this->fill(*e, 7);
    for (std::int64_t step = 1; step <= 3; ++step) {
      const EnginePlan p = e->plan(c.policy, c.fraction, c.k);
      const EngineStep r = e->step(p.plan.placement, p.plan.gpu_slots, this->whole(*e, step), 1.0, 1.0, false, true,
                                   p.plan.prediction.total_ns);
      ASSERT_FALSE(r.skipped);
      EXPECT_EQ(r.total.loop_allocations, 0);
      EXPECT_EQ(r.total.params_cpu + r.total.params_gpu + r.total.params_gpu_static, kN);
    }
    e->sync_host();  // residents hold the newest state until someone asks for it
    EXPECT_EQ(std::memcmp(e->param(), ref->param(), kN * 4), 0) << "policy " << static_cast<int>(c.policy);
    EXPECT_EQ(std::memcmp(e->exp_avg(), ref->exp_avg(), kN * 4), 0);
    EXPECT_EQ(std::memcmp(e->exp_avg_sq(), ref->exp_avg_sq(), kN * 4), 0);
  }
}

// Subgroups updated before the phase (on the CPU during backward) are marked done: the step
// leaves them exactly as they are and updates the rest as usual.
TYPED_TEST(UpdateEngineTest, DoneSubgroupsAreLeftAsTheyAre) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  auto ref = this->make();
  this->fill(*ref, 11);
  auto e = this->make();
  this->fill(*e, 11);
  const std::size_t groups = e->subgroups().size();
  for (std::int64_t step = 1; step <= 2; ++step) {
    const EnginePlan p = e->plan(Policy::interleaved, 0.0, 2.0);
    std::vector<Placement> placement = p.plan.placement;
    std::size_t done_params = 0;
    for (std::size_t i = 0; i < groups; i += 3) {
      placement[i] = Placement::done;
      done_params += e->subgroups()[i].second - e->subgroups()[i].first;
    }
    const std::vector<Segment> segments = this->whole(*e, step);
    for (const Segment& s : segments) {
      if (placement[s.subgroup] != Placement::done) {
        reference_step(s, ref->param(), ref->exp_avg(), ref->exp_avg_sq(), ref->grad());
      }
    }
    const EngineStep r = e->step(placement, p.plan.gpu_slots, segments, 1.0, 1.0, false, true,
                                 p.plan.prediction.total_ns);
    ASSERT_FALSE(r.skipped);
    EXPECT_EQ(r.total.params_cpu + r.total.params_gpu + r.total.params_gpu_static, kN - done_params);
  }
  e->sync_host();
  EXPECT_EQ(std::memcmp(e->param(), ref->param(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(e->exp_avg(), ref->exp_avg(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(e->exp_avg_sq(), ref->exp_avg_sq(), kN * 4), 0);
}

// The optimizer's step through the engine's own planning: from a layout of params in two
// groups, under each policy, the same bits as the CPU kernel run directly over the segments the
// layout gives; subgroups marked done stay as they are, and a skipped step counts no step.
TYPED_TEST(UpdateEngineTest, TheEnginesOwnStepPlansRunsAndCounts) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  // Params of 7,000 elements (the last shorter), alternating between two groups.
  std::vector<ParamSlot> slots;
  for (std::size_t s = 0; s < kN; s += 7'000) slots.push_back({s, std::min(kN, s + 7'000), slots.size() % 2, false});
  StepParams g0, g1;
  g0.lr = 1e-3;
  g1.lr = 3e-4;
  g1.weight_decay = 0;
  StepRequest request;
  request.groups = {g0, g1};
  request.has_grad.assign(slots.size(), 1);
  request.has_grad[2] = 0;  // no gradient: neither stepped nor counted
  for (const PolicyChoice& choice : {PolicyChoice{Policy::cpu, 0, {}}, PolicyChoice{Policy::interleaved, 0.3, 2.0},
                                     PolicyChoice{Policy::automatic, 0, {}}}) {
    auto ref = this->make();
    this->fill(*ref, 5);
    auto e = this->make();
    this->fill(*e, 5);
    e->set_layout(ParamLayout(slots, e->subgroups()));
    e->set_policy(choice);
    e->set_sync_after_step(true);
    ParamLayout counted(slots, ref->subgroups());
    for (int step = 1; step <= 2; ++step) {
      request.done.assign(e->subgroups().size(), false);
      // Updated during backward (here: by the reference below). Not under auto, which may keep
      // every subgroup resident on the device (updates during backward take host-held ones only).
      if (step == 2 && choice.policy != Policy::automatic) request.done[1] = true;
      for (const Segment& s : counted.segments(request.groups, request.has_grad)) {
        reference_step(s, ref->param(), ref->exp_avg(), ref->exp_avg_sq(), ref->grad());
        if (request.done[s.subgroup]) reference_step(s, e->param(), e->exp_avg(), e->exp_avg_sq(), e->grad());
      }
      counted.advance(request.has_grad);
      const EngineStep r = e->step(request);
      ASSERT_FALSE(r.skipped);
      EXPECT_EQ(r.runs, 2U);  // one scheduler run per group
      EXPECT_EQ(r.predicted_ns, e->current_plan().plan.prediction.total_ns);
      EXPECT_EQ(r.placement[1], request.done[1] ? Placement::done : e->current_plan().plan.placement[1]);
    }
    EXPECT_EQ(std::memcmp(e->param(), ref->param(), kN * 4), 0) << "policy " << static_cast<int>(choice.policy);
    EXPECT_EQ(std::memcmp(e->exp_avg(), ref->exp_avg(), kN * 4), 0);
    EXPECT_EQ(std::memcmp(e->exp_avg_sq(), ref->exp_avg_sq(), kN * 4), 0);
    EXPECT_EQ(e->layout().steps()[0], 2.0F);
    EXPECT_EQ(e->layout().steps()[2], 0.0F);
    EXPECT_EQ(e->prediction_errors().count, 2U);  // each step measured against its own plan

    // A non-finite gradient under skip_if_nonfinite changes nothing and counts no step.
    const std::vector<float> before(e->param(), e->param() + kN);
    e->grad()[0] = std::numeric_limits<float>::quiet_NaN();
    StepRequest skipped = request;
    skipped.done.clear();
    skipped.skip_if_nonfinite = true;
    EXPECT_TRUE(e->step(skipped).skipped);
    EXPECT_EQ(std::memcmp(before.data(), e->param(), kN * 4), 0);
    EXPECT_EQ(e->layout().steps()[0], 2.0F);
  }
}

TYPED_TEST(UpdateEngineTest, TheEnginesOwnStepNamesBadRequests) {
  auto e = this->make();
  StepRequest early;
  early.groups = {StepParams{}};
  early.has_grad = {1};
  EXPECT_THROW((void)e->step(early), InvalidArgument);  // no layout yet
  EXPECT_THROW(e->set_layout(ParamLayout({{0, 10, 0, false}}, {{0, 10}})), InvalidArgument);  // not kN
  e->set_layout(ParamLayout({{0, kN, 0, false}}, e->subgroups()));
  EXPECT_THROW(e->set_policy(PolicyChoice{Policy::interleaved, 1.5, 2.0}), InvalidArgument);
  EXPECT_THROW(e->set_policy(PolicyChoice{Policy::interleaved, 0, 0.5}), InvalidArgument);
  StepRequest r;
  r.groups = {StepParams{}};
  r.has_grad = {1};
  r.done = {true};  // one flag, seven subgroups
  EXPECT_THROW((void)e->step(r), InvalidArgument);
  r.done.clear();
  r.has_grad = {1, 1};
  EXPECT_THROW((void)e->step(r), InvalidArgument);
}

TYPED_TEST(UpdateEngineTest, NonFiniteGradientSkipsEverythingWhenAsked) {
  auto e = this->make();
  this->fill(*e, 3);
  e->grad()[kN - 1] = std::numeric_limits<float>::infinity();
  const std::vector<float> before(e->param(), e->param() + kN);
  const EnginePlan p = e->plan(Policy::cpu);
  EngineStep r = e->step(p.plan.placement, 0, this->whole(*e, 1), 1.0, 1.0, false, true);
  EXPECT_TRUE(r.nonfinite);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.runs, 0U);
  EXPECT_EQ(std::memcmp(before.data(), e->param(), kN * 4), 0);
  e->grad()[kN - 1] = 1.0F;
  r = e->step(p.plan.placement, 0, this->whole(*e, 1), 1.0, 1.0, false, true);
  EXPECT_FALSE(r.nonfinite);
  EXPECT_EQ(r.runs, 1U);
  EXPECT_NE(std::memcmp(before.data(), e->param(), kN * 4), 0);
}

// Without skip_if_nonfinite an all-CPU step learns of a NaN/Inf from the fused kernel's own flag
// (no separate scan): it still reports it, in any subgroup, scaled into overflow or not.
TYPED_TEST(UpdateEngineTest, NonFiniteGradientIsReportedWithoutSkipping) {
  auto e = this->make();
  const EnginePlan p = e->plan(Policy::cpu);
  for (std::size_t where : {std::size_t{0}, kN / 2, kN - 1}) {
    this->fill(*e, 3);
    e->grad()[where] = std::numeric_limits<float>::quiet_NaN();
    EngineStep r = e->step(p.plan.placement, 0, this->whole(*e, 1), 1.0, 1.0, false, false);
    EXPECT_TRUE(r.nonfinite) << where;
    EXPECT_FALSE(r.skipped);
    EXPECT_TRUE(std::isnan(e->param()[where])) << "the step ran and took the NaN in";
  }
  this->fill(*e, 4);
  e->grad()[7] = 3e38F;  // finite, but not once scaled by 10
  EXPECT_TRUE(e->step(p.plan.placement, 0, this->whole(*e, 1), 10.0, 1.0, false, false).nonfinite);
  this->fill(*e, 5);
  EXPECT_FALSE(e->step(p.plan.placement, 0, this->whole(*e, 1), 1.0, 1.0, false, false).nonfinite);
}

// Gradients read where they lie (GradSource: fp32 and bf16, across subgroup bounds, with host
// array runs between them) give the same bits as the same values copied into the gradient array.
TYPED_TEST(UpdateEngineTest, GradientsReadWhereTheyLieGiveTheSameBits) {
  auto a = this->make();
  auto b = this->make();
  this->fill(*a, 6);
  this->fill(*b, 6);
  const std::size_t sg = a->subgroups()[0].second;  // the first subgroup's end: a source crosses it
  std::vector<float> g32(sg + 5);
  std::vector<std::uint16_t> g16(kN / 4);
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (float& x : g32) x = normal(rng);
  for (std::uint16_t& x : g16) x = fp32_to_bf16(normal(rng));
  std::vector<GradSource> sources{{3, g32.size(), g32.data(), DType::fp32},
                                  {kN / 2, g16.size(), g16.data(), DType::bf16}};
  for (std::size_t i = 0; i < g32.size(); ++i) b->grad()[3 + i] = g32[i];
  for (std::size_t i = 0; i < g16.size(); ++i) b->grad()[kN / 2 + i] = bf16_to_fp32(g16[i]);
  const EnginePlan p = a->plan(Policy::cpu);
  for (std::int64_t step = 1; step <= 2; ++step) {
    const EngineStep ra = a->step(p.plan.placement, 0, this->whole(*a, step), 1.0, 0.5, false, false, 0, std::nullopt, sources);
    const EngineStep rb = b->step(p.plan.placement, 0, this->whole(*b, step), 1.0, 0.5, false, false);
    EXPECT_FALSE(ra.nonfinite);
    EXPECT_FALSE(rb.nonfinite);
  }
  EXPECT_EQ(std::memcmp(a->param(), b->param(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(a->exp_avg(), b->exp_avg(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(a->exp_avg_sq(), b->exp_avg_sq(), kN * 4), 0);
  // A NaN in a source is the kernel's to report (no scan of the gradient array would see it).
  g16[7] = 0x7FC0;
  EXPECT_TRUE(a->step(p.plan.placement, 0, this->whole(*a, 3), 1.0, 1.0, false, false, 0, std::nullopt, sources).nonfinite);
  // What the engine cannot honour is named.
  const std::vector<GradSource> overlapping{{0, 10, g32.data(), DType::fp32}, {5, 10, g32.data(), DType::fp32}};
  EXPECT_THROW(a->step(p.plan.placement, 0, this->whole(*a, 4), 1.0, 1.0, false, false, 0, std::nullopt, overlapping),
               InvalidArgument);
  const std::vector<GradSource> past{{kN - 2, 10, g32.data(), DType::fp32}};
  EXPECT_THROW(a->step(p.plan.placement, 0, this->whole(*a, 4), 1.0, 1.0, false, false, 0, std::nullopt, past),
               InvalidArgument);
  // skip_if_nonfinite without the path's verdict would need a scan of gradients it does not hold.
  EXPECT_THROW(a->step(p.plan.placement, 0, this->whole(*a, 4), 1.0, 1.0, false, true, 0, std::nullopt, sources),
               InvalidArgument);
}

TYPED_TEST(UpdateEngineTest, SegmentsWithOtherHyperParametersRunSeparately) {
  auto e = this->make();
  this->fill(*e, 5);
  auto segs = this->whole(*e, 1);
  segs[2].params.lr = 5e-4;  // another param group
  segs[4].params.step = 9;   // a param that joined later
  const EnginePlan p = e->plan(Policy::cpu);
  const EngineStep r = e->step(p.plan.placement, 0, segs, 1.0, 1.0, false, false);
  EXPECT_EQ(r.runs, 3U);
  Segment bad = segs[0];
  bad.end = e->subgroups()[0].second + 1;  // crosses into subgroup 1
  EXPECT_THROW((void)e->step(p.plan.placement, 0, {bad}, 1.0, 1.0, false, false), InvalidArgument);
  EXPECT_THROW((void)e->step({Placement::cpu}, 0, segs, 1.0, 1.0, false, false), InvalidArgument);
}

// A step moves exactly the bytes its plan counts, the model's bf16 params written inside the
// phase included: no upload or download outside it, nothing the PerfModel does not see.
TEST(UpdateEngineBytes, TheDeviceMovesThePlansBytes) {
  SimDevice dev(SimConfig{});
  CachingAllocator alloc(dev, small_margin());
  HostArena arena(arena_for(dev));
  constexpr std::size_t n = 70'000, per = 10'000;
  UpdateEngine e(alloc, arena, n, cut(n, per), nullptr);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::size_t i = 0; i < n; ++i) e.param()[i] = normal(rng), e.grad()[i] = normal(rng);
  auto* model = static_cast<std::uint16_t*>(e.model_params(DType::bf16));
  EXPECT_EQ(e.model_params(DType::bf16), model);  // one buffer
  EXPECT_THROW((void)e.model_params(DType::fp16), InvalidArgument);
  for (std::int64_t step = 1; step <= 3; ++step) {
    const std::vector<Segment> segs = all_segments(e, step);
    const EnginePlan p = e.plan(Policy::interleaved, 0.3, 2);  // c, g and s subgroups
    ASSERT_GT(p.plan.static_residents, 0U);
    ASSERT_GT(p.plan.gpu_streamed, 0U);
    const SimEngineStats h2d0 = dev.h2d_stats(), d2h0 = dev.d2h_stats();
    (void)e.step(p.plan.placement, p.plan.gpu_slots, segs, 1, 1, false, false, p.plan.prediction.total_ns);
    if (step == 1) continue;  // the first step moves the residents in: a one-time cost
    EXPECT_EQ(dev.h2d_stats().bytes - h2d0.bytes, p.plan.prediction.h2d_bytes) << "step " << step;
    EXPECT_EQ(dev.d2h_stats().bytes - d2h0.bytes, p.plan.prediction.d2h_bytes) << "step " << step;
  }
  // The model's params are the masters rounded to bf16, however each subgroup was updated.
  e.sync_host();
  for (std::size_t i = 0; i < n; i += 101) ASSERT_EQ(model[i], fp32_to_bf16(e.param()[i])) << i;
}

// The gradient path of backward: bf16 gradients pushed as backward produces them land upcast in
// the host array, a later push of a range wins (accumulation), and a NaN is caught on the way.
TYPED_TEST(UpdateEngineTest, GradientsPushedDuringBackwardLandOnTheHost) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  Device& d = this->device();
  auto e = this->make();
  std::vector<std::uint16_t> host_grads(kN);
  for (std::size_t i = 0; i < kN; ++i) host_grads[i] = fp32_to_bf16(static_cast<float>(i % 977) * 0.25F - 100.0F);
  auto* grads = static_cast<std::uint16_t*>(this->allocator_->allocate(kN * 2, Stream{}));
  const Stream backward = d.create_stream();
  d.copy_async(grads, host_grads.data(), kN * 2, CopyKind::host_to_device, backward);
  // Backward produces the gradients in four pieces (not aligned with the subgroups).
  const std::size_t piece = kN / 4;
  for (std::size_t at = 0; at < kN; at += piece) {
    e->push_grad(at, grads + at, DType::bf16, std::min(piece, kN - at), backward);
  }
  EXPECT_TRUE(e->finish_grads());
  for (std::size_t i = 0; i < kN; i += 7) ASSERT_EQ(e->grad()[i], bf16_to_fp32(host_grads[i])) << i;
  EXPECT_EQ(e->grad_bytes_to_host(), 4.0 * kN);

  // Accumulation: the range pushed again after the next micro-batch holds the newer values.
  std::vector<std::uint16_t> twice(piece, fp32_to_bf16(3.0F));
  d.copy_async(grads, twice.data(), piece * 2, CopyKind::host_to_device, backward);
  e->push_grad(0, grads, DType::bf16, piece, backward);
  EXPECT_TRUE(e->finish_grads());
  EXPECT_EQ(e->grad()[0], 3.0F);
  EXPECT_EQ(e->grad()[piece - 1], 3.0F);
  EXPECT_EQ(e->grad()[piece], bf16_to_fp32(host_grads[piece]));

  // A non-finite gradient is seen by the path, and the step takes its word for it.
  twice[5] = fp32_to_bf16(std::numeric_limits<float>::infinity());
  d.copy_async(grads, twice.data(), piece * 2, CopyKind::host_to_device, backward);
  e->push_grad(0, grads, DType::bf16, piece, backward);
  const bool finite = e->finish_grads();
  EXPECT_FALSE(finite);
  const EnginePlan p = e->plan(Policy::cpu);
  const EngineStep r = e->step(p.plan.placement, 0, this->whole(*e, 1), 1, 1, false, true, 0, finite);
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(e->finish_grads());  // nothing pushed since: nothing to report
  EXPECT_THROW(e->push_grad(kN - 1, grads, DType::bf16, 2, backward), InvalidArgument);
  EXPECT_THROW(e->push_grad(0, grads, DType::none, 2, backward), InvalidArgument);
  d.synchronize();
  this->allocator_->deallocate(grads, Stream{});
  d.destroy_stream(backward);
}

// On the simulated clock the first gradient flush starts before backward ends: the whole
// backward plus its flushes take less than backward followed by the flushes.
// The plan after updates during backward is made for the rest: those marked done stay done, and
// the others are planned as a workload of their own.
TYPED_TEST(UpdateEngineTest, APlanLeavesOutWhatWasUpdatedBeforeThePhase) {
  auto e = this->make();
  const std::size_t groups = e->subgroups().size();
  std::vector<bool> done(groups, false);
  for (std::size_t i = 0; i < groups; i += 2) done[i] = true;
  e->set_done_before_phase(done);
  const EnginePlan p = e->plan(Policy::interleaved, 0.0, 1.0);  // every planned one on the GPU
  ASSERT_EQ(p.plan.placement.size(), groups);
  for (std::size_t i = 0; i < groups; ++i) {
    EXPECT_EQ(p.plan.placement[i] == Placement::done, done[i]) << i;
  }
  e->set_done_before_phase(std::vector<bool>(groups, true));
  const EnginePlan none = e->plan(Policy::automatic);
  EXPECT_EQ(std::count(none.plan.placement.begin(), none.plan.placement.end(), Placement::done),
            static_cast<std::ptrdiff_t>(groups));
  e->set_done_before_phase({});
  const EnginePlan all = e->plan(Policy::cpu);
  EXPECT_EQ(std::count(all.plan.placement.begin(), all.plan.placement.end(), Placement::cpu),
            static_cast<std::ptrdiff_t>(groups));
  EXPECT_THROW(e->set_done_before_phase(std::vector<bool>(groups + 1)), InvalidArgument);
  EXPECT_THROW(e->set_host_gradients(std::vector<bool>(1 + groups)), InvalidArgument);
}

// An update during backward reads one subgroup's host gradient before the pass ends: after
// wait_grads_pushed() everything pushed so far is in the host array, and the pass goes on.
TYPED_TEST(UpdateEngineTest, PushedGradientsCanBeAwaitedBeforeThePassEnds) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  Device& d = this->device();
  auto e = this->make();
  e->wait_grads_pushed();  // nothing pushed: returns at once
  std::vector<std::uint16_t> host_grads(kN);
  for (std::size_t i = 0; i < kN; ++i) host_grads[i] = fp32_to_bf16(static_cast<float>(i % 501) * 0.5F - 7.0F);
  auto* grads = static_cast<std::uint16_t*>(this->allocator_->allocate(kN * 2, Stream{}));
  const Stream backward = d.create_stream();
  d.copy_async(grads, host_grads.data(), kN * 2, CopyKind::host_to_device, backward);
  const std::size_t half = kN / 2;
  e->push_grad(half, grads + half, DType::bf16, kN - half, backward);  // backward: the last params first
  std::thread waiter([&] { e->wait_grads_pushed(); });  // from another thread, as TieredAdamW's worker
  waiter.join();
  for (std::size_t i = half; i < kN; i += 5) ASSERT_EQ(e->grad()[i], bf16_to_fp32(host_grads[i])) << i;
  e->push_grad(0, grads, DType::bf16, half, backward);
  EXPECT_TRUE(e->finish_grads());
  for (std::size_t i = 0; i < half; i += 5) ASSERT_EQ(e->grad()[i], bf16_to_fp32(host_grads[i])) << i;
  d.synchronize();
  this->allocator_->deallocate(grads, Stream{});
  d.destroy_stream(backward);
}

TEST(UpdateEngineGradients, FlushesOverlapBackward) {
  SimDevice dev(SimConfig{});
  CachingAllocator alloc(dev, small_margin());
  HostArena arena(arena_for(dev));
  constexpr std::size_t n = 4'000'000, piece = 1'000'000;
  UpdateEngine e(alloc, arena, n, cut(n, 1'500'000), nullptr);
  auto* grads = static_cast<std::uint16_t*>(alloc.allocate(n * 2, Stream{}));
  dev.memset_async(grads, 0, n * 2, Stream{});  // finite gradients (fresh memory may hold NaN bits)
  constexpr std::size_t kLayerBytes = 256ULL << 20;  // a layer's backward moves this through HBM
  void* scratch = alloc.allocate(kLayerBytes, Stream{});
  const Stream backward = dev.create_stream();
  const double t0 = dev.now_ns();
  for (std::size_t at = 0; at < n; at += piece) {
    dev.memset_async(scratch, 0, kLayerBytes, backward);  // a layer's backward (longer than its flush)
    e.push_grad(at, grads + at, DType::bf16, piece, backward);
  }
  const double backward_end = dev.stream_ready_ns(backward);
  EXPECT_TRUE(e.finish_grads());
  const double flush_ns = static_cast<double>(n) * 4 / SimConfig{}.d2h_bytes_per_s * 1e9;
  const double serial = backward_end - t0 + flush_ns;
  EXPECT_LT(dev.now_ns() - t0, serial - 0.5 * flush_ns)
      << "backward " << (backward_end - t0) << " ns, flushes " << flush_ns << " ns";
  alloc.deallocate(scratch, Stream{});
  alloc.deallocate(grads, Stream{});
  dev.destroy_stream(backward);
}

// Plans repeat: the engine's own residents and slots do not shrink the memory the next plan sees.
TYPED_TEST(UpdateEngineTest, OwnLoansDoNotShrinkTheNextPlan) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  auto e = this->make();
  this->fill(*e, 11);
  const EnginePlan first = e->plan(Policy::static_split, 0.5);
  ASSERT_GT(first.plan.static_residents, 0U);
  (void)e->step(first.plan.placement, first.plan.gpu_slots, this->whole(*e, 1), 1, 1, false, false);
  EXPECT_GT(e->resident_bytes(), 0U);
  const EnginePlan second = e->plan(Policy::static_split, 0.5);
  EXPECT_EQ(second.plan.placement, first.plan.placement);
  EXPECT_EQ(second.budget.budget.resident_bytes, first.budget.budget.resident_bytes) << first.budget.source << " / " << second.budget.source << " resident " << e->resident_bytes() << " alloc " << this->allocator_->stats().allocated_bytes[0].current << " devfree " << this->device().mem_info().free;
  e->host_changed();
  EXPECT_LT(e->resident_bytes(), gpu_slot_bytes(kSubgroup));  // the residents went; a counter stays
}

// Static residents live through forward and backward: over many iterations of a
// transformer-shaped workload, residents plus a forward's activations never exceed the device,
// because residents are sized from the lowest free memory of the whole iteration. Sizing them
// from the update phase's headroom (as before) does not survive the same test.
TEST(UpdateEngineResidency, ResidentsAndActivationsNeverExceedTheDevice) {
  SimConfig sc;
  sc.capacity = 64ULL << 20;
  SimDevice dev(sc);
  // The margin covers what watermarks of allocated bytes do not see: segment rounding (the
  // default, 256 MiB, is sized for a real GPU's workspaces too).
  AllocatorConfig ac;
  ac.headroom_margin = 4 << 20;
  CachingAllocator alloc(dev, ac);
  HostArena arena(arena_for(dev));
  constexpr std::size_t n = 1'500'000, per = 250'000;  // 6 subgroups of 4 MB slots
  UpdateEngine engine(alloc, arena, n, cut(n, per), nullptr);
  const std::size_t activations = 40ULL << 20;
  auto iteration = [&](std::int64_t step) {
    alloc.mark_phase(Phase::forward);
    std::vector<void*> acts;
    for (std::size_t b = 0; b < 10; ++b) acts.push_back(alloc.allocate(activations / 10, Stream{}));
    alloc.mark_phase(Phase::backward);
    for (auto it = acts.rbegin(); it != acts.rend(); ++it) alloc.deallocate(*it, Stream{});
    alloc.mark_phase(Phase::update);
    const EnginePlan p = engine.plan(Policy::static_split, 1.0);  // as many residents as fit
    (void)engine.step(p.plan.placement, p.plan.gpu_slots, all_segments(engine, step), 1, 1, false, false);
    return p;
  };
  std::size_t most = 0;
  for (std::int64_t step = 1; step <= 8; ++step) {
    const EnginePlan p = iteration(step);  // throws OutOfMemory if residents crowd out activations
    most = std::max(most, p.plan.static_residents);
    EXPECT_LE(p.budget.residents_taken + activations, sc.capacity) << "step " << step;
  }
  EXPECT_GT(most, 0U);  // residents were used where they fit
  // The old sizing (update-phase headroom): what the update phase leaves, ignoring forward.
  const Headroom update_only = alloc.headroom(Phase::forward);
  const std::uint64_t old_residents = (update_only.bytes + engine.resident_bytes()) / gpu_slot_bytes(per);
  EXPECT_GT(old_residents * gpu_slot_bytes(per) + activations, sc.capacity)
      << "the update-phase sizing would have fit too: the test cannot tell the two apart";
}

// A phase entered with no allocation seen has no low water yet: it must not read as "no memory"
// (its "none yet" maximum plus the engine's loans once wrapped around to almost nothing).
TEST(UpdateEngineResidency, APhaseWithNothingObservedDoesNotZeroTheBudget) {
  SimDevice dev(SimConfig{});
  CachingAllocator alloc(dev, small_margin());
  HostArena arena(arena_for(dev));
  UpdateEngine engine(alloc, arena, 40'000, cut(40'000, 10'000), nullptr);
  const std::vector<Segment> segs = all_segments(engine);
  // The first iteration starts in "other" with nothing allocated: its low water stays unknown.
  alloc.mark_phase(Phase::forward);
  alloc.mark_phase(Phase::backward);
  alloc.mark_phase(Phase::update);
  EnginePlan p = engine.plan(Policy::static_split, 0.5);
  (void)engine.step(p.plan.placement, p.plan.gpu_slots, segs, 1, 1, false, false);  // loans held now
  alloc.mark_phase(Phase::forward);  // closes the iteration: "other" unknown is in the history
  ASSERT_EQ(alloc.phase_report().history.size(), 1U);
  p = engine.plan(Policy::static_split, 0.5);
  EXPECT_GT(p.budget.budget.update_bytes, 1ULL << 30) << p.budget.source;
  EXPECT_EQ(p.plan.static_residents, 2U);
}

// Gradients of GPU-placed subgroups stay on the device when backward and the update phase leave
// room: the step reads them there (no 4 B/param down and up again) and gives the same bits.
TEST(UpdateEngineGradients, GpuPlacedGradientsStayOnTheDevice) {
  SimDevice dev(SimConfig{});
  CachingAllocator alloc(dev, small_margin());
  HostArena arena(arena_for(dev));
  constexpr std::size_t n = 40'000, per = 10'000;
  UpdateEngine e(alloc, arena, n, cut(n, per), nullptr);
  std::vector<float> p0(n), m0(n), v0(n);
  std::vector<std::uint16_t> g16(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::size_t i = 0; i < n; ++i) {
    p0[i] = e.param()[i] = normal(rng);
    m0[i] = e.exp_avg()[i] = normal(rng) * 0.1F;
    v0[i] = e.exp_avg_sq()[i] = std::abs(normal(rng)) * 0.01F;
    g16[i] = fp32_to_bf16(normal(rng));
  }
  auto* grads = static_cast<std::uint16_t*>(alloc.allocate(n * 2, Stream{}));
  dev.copy_async(grads, g16.data(), n * 2, CopyKind::host_to_device, Stream{});
  (void)e.model_params(DType::bf16);  // so the step moves exactly what the plan counts
  // One iteration seen, so the engine knows what backward and the update phase leave.
  alloc.mark_phase(Phase::forward);
  alloc.mark_phase(Phase::backward);
  alloc.mark_phase(Phase::update);
  const EnginePlan first = e.plan(Policy::interleaved, 0, 2);  // c g c g
  ASSERT_EQ(first.plan.gpu_streamed, 2U);
  alloc.mark_phase(Phase::forward);
  alloc.mark_phase(Phase::backward);
  e.push_grad(0, grads, DType::bf16, n, Stream{});
  ASSERT_TRUE(e.finish_grads());
  EXPECT_EQ(e.kept_grad_bytes(), 2 * per * 4);  // the two GPU subgroups'
  alloc.mark_phase(Phase::update);
  const EnginePlan p = e.plan(Policy::interleaved, 0, 2);
  const SimEngineStats h2d0 = dev.h2d_stats();
  const EngineStep r = e.step(p.plan.placement, p.plan.gpu_slots, all_segments(e, 1), 1, 1, false, true, 0, true);
  ASSERT_FALSE(r.skipped);
  // Planned after backward, the plan knows the GPU subgroups' gradients are on the device: it
  // counts no upload for them, and the device moves exactly what it counts.
  EXPECT_EQ(dev.h2d_stats().bytes - h2d0.bytes, p.plan.prediction.h2d_bytes);
  EXPECT_EQ(p.plan.prediction.h2d_bytes, first.plan.prediction.h2d_bytes - 2.0 * per * 4);
  EXPECT_EQ(e.kept_grad_bytes(), 0U);  // given back after the step
  // The same bits as the CPU kernel on the host copies.
  std::vector<float> g32(n);
  for (std::size_t i = 0; i < n; ++i) g32[i] = bf16_to_fp32(g16[i]);
  for (const Segment& s : all_segments(e, 1)) reference_step(s, p0.data(), m0.data(), v0.data(), g32.data());
  e.sync_host();
  EXPECT_EQ(std::memcmp(e.param(), p0.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(e.exp_avg(), m0.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(e.exp_avg_sq(), v0.data(), n * 4), 0);
  alloc.deallocate(grads, Stream{});
}

// The engine's host state is four arrays: when one cannot be made, the ones made go back.
TEST(UpdateEngineFailures, AFailedConstructionGivesItsHostMemoryBack) {
  test::FailingDevice dev;
  CachingAllocator alloc(dev, small_margin());
  HostArenaConfig config = arena_for(dev);
  HostArena arena(config);
  constexpr std::size_t n = 2'000'000;  // 8 MB arrays: a slab of their own each
  for (int fail = 1; fail <= 4; ++fail) {
    dev.fail_at(fail);  // the fail-th slab registration
    EXPECT_THROW(UpdateEngine(alloc, arena, n, cut(n, 500'000), nullptr), Error) << fail;
    EXPECT_EQ(arena.stats().allocated_bytes, 0U) << fail;
    arena.release_free_slabs();  // so the next try needs new slabs again
  }
  dev.fail_at(0);
  UpdateEngine ok(alloc, arena, n, cut(n, 500'000), nullptr);
  EXPECT_GE(ok.host_bytes(), 16U * n);
}

// The engine's residents are a loan: an allocation that would fail takes them back (their state
// to the host), and training goes on with the same bits; what is still on loan, or that nothing
// is, is in the out-of-memory message.
TEST(UpdateEngineLoans, AnAllocationThatWouldFailTakesTheResidentsBack) {
  if (!device_ops_available(*std::make_unique<SimDevice>())) GTEST_SKIP() << "no device kernels in this build";
  SimConfig sc;
  sc.capacity = 96ULL << 20;
  SimDevice dev(sc), ref_dev(sc);
  CachingAllocator alloc(dev, small_margin()), ref_alloc(ref_dev, small_margin());
  HostArena arena(arena_for(dev)), ref_arena(arena_for(ref_dev));
  constexpr std::size_t n = 1'000'000, per = 125'000;
  UpdateEngine e(alloc, arena, n, cut(n, per), nullptr);
  UpdateEngine ref(ref_alloc, ref_arena, n, cut(n, per), nullptr);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::size_t i = 0; i < n; ++i) {
    e.param()[i] = ref.param()[i] = normal(rng);
    e.grad()[i] = ref.grad()[i] = normal(rng);
  }
  auto step = [&](UpdateEngine& engine, Policy policy, double fraction, std::int64_t s) {
    const EnginePlan p = engine.plan(policy, fraction, std::nullopt);
    (void)engine.step(p.plan.placement, p.plan.gpu_slots, all_segments(engine, s), 1, 1, false, false);
  };
  step(e, Policy::static_split, 0.5, 1);
  step(ref, Policy::cpu, 0, 1);
  const std::uint64_t lent = e.resident_bytes();
  ASSERT_GT(lent, 4U << 20) << "the static plan put residents on the device";

  // More than is free, less than is free with the residents back.
  const std::uint64_t free = alloc.limit() - static_cast<std::uint64_t>(alloc.stats().reserved_bytes[0].current);
  const std::size_t want = free + lent / 2;
  void* big = alloc.allocate(want, Stream{});
  EXPECT_LT(e.resident_bytes(), 4096U) << "the residents went back to the host (a counter stays)";
  alloc.deallocate(big, Stream{});

  step(e, Policy::cpu, 0, 2);
  step(ref, Policy::cpu, 0, 2);
  e.sync_host();
  EXPECT_EQ(std::memcmp(e.param(), ref.param(), n * 4), 0) << "the loan's return lost state";
  EXPECT_EQ(std::memcmp(e.exp_avg(), ref.exp_avg(), n * 4), 0);
  EXPECT_EQ(std::memcmp(e.exp_avg_sq(), ref.exp_avg_sq(), n * 4), 0);

  // With residents again, an allocation that cannot fit even after their return names the loans
  // it asked for (a counter's bytes are left) and fails cleanly; the allocator keeps working.
  step(e, Policy::static_split, 0.5, 3);
  ASSERT_GT(e.resident_bytes(), 0U);
  try {
    (void)alloc.allocate(2 * sc.capacity, Stream{});
    ADD_FAILURE() << "an allocation larger than the device succeeded";
  } catch (const OutOfMemory& err) {
    EXPECT_NE(std::string(err.what()).find("on loan to tiering after asking for it back: the update engine"),
              std::string::npos)
        << err.what();
  }
  EXPECT_LT(e.resident_bytes(), 4096U);
  void* again = alloc.allocate(1 << 20, Stream{});
  alloc.deallocate(again, Stream{});
}

// On a GPU (wall clocks everywhere) each step also checks the whole iteration: the passes as the
// last iteration ran them plus the planned update, against this iteration's. Not on a SimDevice,
// whose scheduler runs on a virtual clock.
TEST(UpdateEngineIterations, AGpuRunChecksWholeIterationsFromTheSecondOn) {
  for (const char* backend : {"sim", "cuda"}) {
    test::FailingDevice dev;
    dev.pretend_backend(backend);
    CachingAllocator alloc(dev, small_margin());
    HostArena arena(arena_for(dev));
    UpdateEngine e(alloc, arena, 4096, cut(4096, 1024), nullptr);
    for (int it = 0; it < 3; ++it) {
      alloc.mark_phase(Phase::forward);
      void* act = alloc.allocate(1 << 20, Stream{});
      alloc.mark_phase(Phase::backward);
      alloc.deallocate(act, Stream{});
      alloc.mark_phase(Phase::update);
      const EnginePlan plan = e.plan(Policy::cpu);
      (void)e.step(plan.plan.placement, plan.plan.gpu_slots, all_segments(e, it + 1), 1.0, 1.0, false, false,
                   plan.plan.prediction.total_ns);
    }
    // Iterations 2 and 3 had a finished one before them.
    EXPECT_EQ(e.iteration_errors().count, std::string(backend) == "cuda" ? 2U : 0U) << backend;
    EXPECT_EQ(e.prediction_errors().count, 3U) << backend;
  }
}

// PCIe traffic memtide did not issue (seen by CUPTI on a GPU) is planned around: every placement
// costs at least as much on links shared with others, so the best plan is predicted no faster.
TEST(UpdateEngineIterations, OthersTrafficOnThePcieLinksIsPlannedAround) {
  test::FailingDevice dev;
  CachingAllocator alloc(dev, small_margin());
  HostArena arena(arena_for(dev));
  UpdateEngine e(alloc, arena, 1 << 20, cut(1 << 20, 1 << 15), nullptr);
  const EnginePlan best_before = e.plan(Policy::automatic);
  const EnginePlan streamed_before = e.plan(Policy::interleaved, 0.0, 1.0);
  PcieObservation busy;
  busy.window_ns = 1e6;
  busy.h2d_busy_ns = 0.9e6;  // others kept both links busy 90% of the phase
  busy.d2h_busy_ns = 0.9e6;
  e.observe_pcie(busy);
  EXPECT_DOUBLE_EQ(e.foreign_pcie_share().first, 0.9);
  const EnginePlan best_after = e.plan(Policy::automatic);
  const EnginePlan streamed_after = e.plan(Policy::interleaved, 0.0, 1.0);
  ASSERT_EQ(streamed_after.plan.placement, streamed_before.plan.placement);
  // The same placement's copies take 10x as long on a tenth of the link...
  EXPECT_NEAR(streamed_after.plan.prediction.h2d_ns, 10 * streamed_before.plan.prediction.h2d_ns,
              1e-6 * streamed_after.plan.prediction.h2d_ns);
  // ...and the best plan is predicted no faster than before.
  EXPECT_GE(best_after.plan.prediction.total_ns, best_before.plan.prediction.total_ns * (1 - 1e-9));
}

// The engine asks its traffic source (the process's CUPTI tracer) about its previous update phase
// after each of its own steps, and plans around what others took; on a virtual clock it never asks.
TEST(UpdateEngineIterations, TheTrafficSourceIsAskedAboutThePreviousPhase) {
  for (const char* backend : {"sim", "cuda"}) {
    test::FailingDevice dev;
    dev.pretend_backend(backend);
    CachingAllocator alloc(dev, small_margin());
    HostArena arena(arena_for(dev));
    UpdateEngine e(alloc, arena, 4096, cut(4096, 1024), nullptr);
    e.set_layout(ParamLayout({{0, 4096, 0, false}}, e.subgroups()));
    e.set_policy(PolicyChoice{Policy::interleaved, 0, 1.0});
    std::vector<std::pair<double, double>> asked;
    e.set_traffic_source([&](double from, double to) -> std::optional<LinkTraffic> {
      asked.emplace_back(from, to);
      return LinkTraffic{0.9 * (to - from), 0.9 * (to - from)};  // others kept both links 90% busy
    });
    StepRequest r;
    r.groups = {StepParams{}};
    r.has_grad = {1};
    for (int step = 0; step < 3; ++step) (void)e.step(r);
    if (std::string(backend) == "sim") {
      EXPECT_TRUE(asked.empty());
      EXPECT_EQ(e.foreign_pcie_share().first, 0.0);
      continue;
    }
    ASSERT_EQ(asked.size(), 2U);  // the first step had no phase before it
    EXPECT_LT(asked[0].first, asked[0].second);
    EXPECT_LE(asked[0].second, asked[1].first);  // each about the phase just before
    EXPECT_GT(e.foreign_pcie_share().first, 0.0);
  }
}

}  // namespace
}  // namespace memtide::tiering
