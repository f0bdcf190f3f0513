// StepProtocol: the verdict comes from the kernels' flags, the norm and the clip factor from the
// gradients where they lie, what must agree across ranks through the Collective; a step it runs
// gives the bits of the engine's own step with the same clip factor, and a step it skips changes
// nothing.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/tiering/engine/backward_updates.hpp"
#include "memtide/tiering/engine/grad_entry.h"
#include "memtide/tiering/engine/step_protocol.hpp"
#include "sim_engine.hpp"

namespace memtide::tiering {
namespace {

constexpr std::size_t kN = test::SimEngine::kParams;
constexpr std::size_t kParam = 2'000;  // 6 params over 4 subgroups of 3,000

struct Rig : test::SimEngine {
  std::vector<float> grads;  // the model's gradients, one param after the other
  StepRequest request;

  Rig() : grads(kN) {
    std::vector<ParamSlot> slots;
    for (std::size_t s = 0; s < kN; s += kParam) slots.push_back({s, s + kParam, 0, false});
    engine.set_layout(ParamLayout(slots, engine.subgroups()));
    engine.set_policy(PolicyChoice{Policy::cpu, 0, {}});
    std::mt19937 rng(5);  // every rig alike: reference() steps a twin
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (std::size_t i = 0; i < kN; ++i) {
      engine.param()[i] = normal(rng);
      grads[i] = normal(rng);
    }
    request.groups = {StepParams{}};
    request.has_grad.assign(slots.size(), 1);
  }
  [[nodiscard]] std::size_t params() const { return kN / kParam; }
  [[nodiscard]] GradArrival arrival(std::size_t i, GradRoute how = GradRoute::host_copy) const {
    return GradArrival{grads.data() + i * kParam, DType::fp32, kParam, how};
  }
  void arrive_all(StepProtocol& p, GradRoute how = GradRoute::host_copy) {
    for (std::size_t i = 0; i < params(); ++i) (void)p.grad_ready(i, arrival(i, how));
  }
  [[nodiscard]] std::vector<float> state() const {
    std::vector<float> out(engine.param(), engine.param() + kN);
    out.insert(out.end(), engine.exp_avg(), engine.exp_avg() + kN);
    out.insert(out.end(), engine.exp_avg_sq(), engine.exp_avg_sq() + kN);
    return out;
  }
  [[nodiscard]] double norm() const {
    double s = 0;
    for (float g : grads) s += static_cast<double>(g) * g;
    return std::sqrt(s);
  }
};

ProtocolOptions clipping(double max_grad_norm) {
  ProtocolOptions o;
  o.max_grad_norm = max_grad_norm;
  return o;
}

// The engine's step with an explicit clip factor, on a twin: what the protocol must reproduce.
std::vector<float> reference(double clip, double grad_scale = 1.0) {
  Rig twin;
  std::copy(twin.grads.begin(), twin.grads.end(), twin.engine.grad());
  StepRequest r = twin.request;
  r.clip = clip;
  r.grad_scale = grad_scale;
  (void)twin.engine.step(r);
  return twin.state();
}

TEST(StepProtocol, ClipsByTheNormOfTheGradientsAsTheyArrived) {
  Rig rig;
  const double max_norm = rig.norm() / 4;
  StepProtocol p(rig.engine, clipping(max_norm));
  rig.arrive_all(p);
  p.collect({});
  const StepOutcome out = p.step(rig.request, {});
  ASSERT_TRUE(out.grad_norm.has_value());
  EXPECT_NEAR(*out.grad_norm, rig.norm(), rig.norm() * 1e-12);
  EXPECT_EQ(out.clip, max_norm / (*out.grad_norm + 1e-6));
  EXPECT_TRUE(out.ran);
  EXPECT_FALSE(out.skipped);
  EXPECT_EQ(out.verdict, std::optional<bool>(true)) << "every copy gave its flag";
  EXPECT_EQ(rig.state(), reference(out.clip));
}

TEST(StepProtocol, TheNormIsUnscaledAndAFactorAboveTheLimitDoesNotClip) {
  Rig rig;
  StepProtocol p(rig.engine, clipping(rig.norm() * 10));
  rig.arrive_all(p);
  p.collect({});
  StepRequest r = rig.request;
  r.grad_scale = -0.5;  // maximize=True with a loss scale of 2
  const StepOutcome out = p.step(r, {});
  EXPECT_NEAR(*out.grad_norm, rig.norm() * 0.5, rig.norm() * 1e-12);
  EXPECT_EQ(out.clip, 1.0);
  EXPECT_EQ(rig.state(), reference(1.0, -0.5));
}

TEST(StepProtocol, ALossScalerSkipsOnTheCopysOwnFlagAndChangesNothing) {
  Rig rig;
  rig.grads[kParam * 3 + 7] = std::numeric_limits<float>::infinity();
  const std::vector<float> before = rig.state();
  ProtocolOptions o;
  o.loss_scaler = true;
  StepProtocol p(rig.engine, o);
  rig.arrive_all(p);
  p.collect({});
  const StepOutcome out = p.step(rig.request, {});
  EXPECT_EQ(out.verdict, std::optional<bool>(false));
  EXPECT_TRUE(out.nonfinite);
  EXPECT_TRUE(out.skipped);
  EXPECT_FALSE(out.ran);
  EXPECT_EQ(rig.state(), before);
  EXPECT_EQ(rig.engine.layout().steps()[0], 0.0F) << "a skipped step is not counted";
}

TEST(StepProtocol, AGradientWrittenByTheFrontEndHasNoVerdictAndIsScanned) {
  Rig rig;
  ProtocolOptions o;
  o.loss_scaler = true;
  StepProtocol p(rig.engine, o);
  rig.arrive_all(p);
  // Param 2 changed after its hook: the front end writes it into the array itself, with a NaN.
  p.collect({false, false, true, false, false, false});
  rig.engine.grad()[2 * kParam + 5] = std::numeric_limits<float>::quiet_NaN();
  p.grad_written(2);
  const std::vector<float> before = rig.state();
  const StepOutcome out = p.step(rig.request, {false, false, true, false, false, false});
  EXPECT_FALSE(out.verdict.has_value());
  EXPECT_TRUE(out.skipped) << "the engine's scan found the NaN";
  EXPECT_EQ(rig.state(), before);
}

TEST(StepProtocol, InPlaceGradientsAreReadWhereTheyLie) {
  Rig rig;
  StepProtocol p(rig.engine, ProtocolOptions{});
  rig.arrive_all(p, GradRoute::in_place);
  EXPECT_EQ(p.in_place_count(), rig.params());
  p.collect({});
  const StepOutcome out = p.step(rig.request, {});
  EXPECT_TRUE(out.ran);
  EXPECT_FALSE(out.verdict.has_value()) << "without a loss scaler nothing scans them before the step";
  for (std::size_t i = 0; i < kN; ++i) ASSERT_EQ(rig.engine.grad()[i], 0.0F) << "copied into the array at " << i;
  EXPECT_EQ(rig.state(), reference(1.0));
  EXPECT_EQ(p.in_place_count(), 0U) << "the step forgets its arrivals";
}

TEST(StepProtocol, InPlaceGradientsGoIntoTheArrayWhenTheStepMustScan) {
  Rig rig;
  ProtocolOptions o;
  o.loss_scaler = true;
  StepProtocol p(rig.engine, o);
  rig.arrive_all(p, GradRoute::in_place);
  p.collect({});
  StepRequest r = rig.request;
  r.grad_scale = 4.0;  // a factor above 1 may overflow a finite gradient: the step scans
  const StepOutcome out = p.step(r, {});
  EXPECT_TRUE(out.ran);
  EXPECT_EQ(rig.engine.grad()[kN - 1], rig.grads[kN - 1]);
  EXPECT_EQ(rig.state(), reference(1.0, 4.0));
}

TEST(StepProtocol, ShardedSquaresAndVerdictsGoThroughTheCollective) {
  Rig rig;
  ProtocolOptions o;
  o.max_grad_norm = 1.0;
  o.sharded = {true, true, false, false, true, false};
  std::vector<double> summed;
  o.collective.sum_sharded = [&](double v) {
    summed.push_back(v);
    return v * 3;  // three ranks holding the same squares
  };
  o.collective.any = [](bool flag) { return flag; };
  StepProtocol p(rig.engine, o);
  rig.arrive_all(p);
  p.collect({});
  const StepOutcome out = p.step(rig.request, {});
  double sharded = 0, replicated = 0;
  for (std::size_t i = 0; i < kN; ++i) {
    const double g = rig.grads[i];
    (o.sharded[i / kParam] ? sharded : replicated) += g * g;
  }
  ASSERT_EQ(summed.size(), 1U);
  EXPECT_NEAR(summed[0], sharded, sharded * 1e-12);
  EXPECT_NEAR(*out.grad_norm, std::sqrt(replicated + 3 * sharded), 1e-9);

  // With a loss scaler and no clipping, another rank's overflow skips the step here too.
  Rig other;
  ProtocolOptions s;
  s.loss_scaler = true;
  s.sharded = o.sharded;
  int asked = 0;
  s.collective.sum_sharded = [](double v) { return v; };
  s.collective.any = [&](bool flag) {
    ++asked;
    EXPECT_FALSE(flag) << "this rank's gradients are finite";
    return true;
  };
  StepProtocol q(other.engine, s);
  other.arrive_all(q);
  q.collect({});
  const std::vector<float> before = other.state();
  EXPECT_TRUE(q.step(other.request, {}).skipped);
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(other.state(), before);
}

TEST(StepProtocol, RefusesWhatItCannotDecide) {
  Rig rig;
  ProtocolOptions o;
  o.sharded = {true, false, false, false, false, false};
  EXPECT_THROW(StepProtocol(rig.engine, o), InvalidArgument) << "sharded params need a collective";
  EXPECT_THROW(StepProtocol(rig.engine, clipping(0.0)), InvalidArgument);
  EXPECT_THROW(StepProtocol(rig.engine, clipping(std::nan(""))), InvalidArgument);
  ProtocolOptions wrong;
  wrong.sharded = {true};
  EXPECT_THROW(StepProtocol(rig.engine, wrong), InvalidArgument);

  StepProtocol p(rig.engine, ProtocolOptions{});
  EXPECT_THROW((void)p.grad_ready(6, rig.arrival(0)), InvalidArgument);
  GradArrival short_one = rig.arrival(0);
  short_one.n = kParam - 1;
  EXPECT_THROW((void)p.grad_ready(0, short_one), InvalidArgument);
  GradArrival bad_dtype = rig.arrival(0);
  bad_dtype.dtype = DType::none;
  EXPECT_THROW((void)p.grad_ready(0, bad_dtype), InvalidArgument);
  EXPECT_THROW(p.grad_written(9), InvalidArgument);
  for (std::size_t i = 0; i < 5; ++i) (void)p.grad_ready(i, rig.arrival(i));
  p.collect({});
  EXPECT_THROW((void)p.step(rig.request, {}), InvalidArgument) << "param 5 has a gradient that never arrived";
  StepRequest few = rig.request;
  few.has_grad.pop_back();
  EXPECT_THROW((void)p.step(few, {}), InvalidArgument);
}

// The C entry the torch hooks call (grad_entry.h): the same arrivals, and every refusal a message,
// never an exception (it is called across a library boundary, from autograd's threads).
TEST(StepProtocol, TheCEntryIsGradReadyWithRefusalsAsMessages) {
  Rig rig;
  StepProtocol p(rig.engine, ProtocolOptions{});
  char error[64] = {};
  for (std::size_t i = 0; i < rig.params(); ++i) {
    ASSERT_EQ(memtide_step_protocol_grad_ready(&p, i, rig.grads.data() + i * kParam, MEMTIDE_GRAD_FP32, kParam,
                                               MEMTIDE_GRAD_IN_PLACE, nullptr, error, sizeof error),
              0);
  }
  EXPECT_EQ(p.in_place_count(), rig.params());
  p.collect({});
  EXPECT_EQ(p.step(rig.request, {}).ran, true);
  EXPECT_EQ(rig.state(), reference(1.0));

  const float* g = rig.grads.data();
  EXPECT_EQ(memtide_step_protocol_grad_ready(&p, 0, g, MEMTIDE_GRAD_FP32, kParam - 1, MEMTIDE_GRAD_HOST_COPY, nullptr,
                                             error, sizeof error),
            -1);
  EXPECT_NE(std::string(error).find("param 0 has 2000 elements"), std::string::npos) << error;
  EXPECT_EQ(std::string(error).size(), sizeof error - 1) << "cut to the buffer, NUL-terminated";
  EXPECT_EQ(memtide_step_protocol_grad_ready(&p, 6, g, MEMTIDE_GRAD_FP32, kParam, MEMTIDE_GRAD_HOST_COPY, nullptr,
                                             error, sizeof error),
            -1);
  EXPECT_EQ(memtide_step_protocol_grad_ready(&p, 0, g, 7, kParam, MEMTIDE_GRAD_HOST_COPY, nullptr, error, sizeof error),
            -1);
  EXPECT_STREQ(error, "grad_ready: unknown gradient dtype code 7");
  EXPECT_EQ(memtide_step_protocol_grad_ready(&p, 0, g, MEMTIDE_GRAD_FP32, kParam, 3, nullptr, nullptr, 0), -1)
      << "no buffer for the message: refused all the same";
  EXPECT_EQ(p.in_place_count(), 0U) << "nothing refused arrived";
}

TEST(StepProtocol, NoGradientDecidesNothing) {
  Rig rig;
  StepProtocol p(rig.engine, clipping(1.0));
  const std::vector<float> before = rig.state();
  StepRequest r = rig.request;
  r.has_grad.assign(rig.params(), 0);
  p.collect({});
  const StepOutcome out = p.step(r, {});
  EXPECT_FALSE(out.any_gradient);
  EXPECT_FALSE(out.ran);
  EXPECT_FALSE(out.grad_norm.has_value());
  EXPECT_EQ(rig.state(), before);
}

// Updates during backward: kept when the step's inputs are theirs (no clipping), redone when the
// norm clips; either way the bits of the sequential step.
TEST(StepProtocol, TakesOrRedoesTheUpdatesMadeDuringBackward) {
  for (const bool clipping : {false, true}) {
    SCOPED_TRACE(clipping ? "clipping" : "no clipping");
    Rig rig;
    BackwardUpdates backward(rig.engine, 4);
    backward.rebuild(std::vector<bool>(rig.params(), true));
    ProtocolOptions o;
    if (clipping) o.max_grad_norm = rig.norm() / 2;
    StepProtocol p(rig.engine, o, &backward);
    backward.backward_started();
    std::size_t submitted = 0;
    for (std::size_t i = rig.params(); i-- > 0;) {
      for (std::size_t g : p.grad_ready(i, rig.arrival(i), /*speculate=*/true)) {
        backward.submit(g, rig.request);
        ++submitted;
      }
    }
    backward.backward_ended();
    ASSERT_GT(submitted, 0U);
    p.collect({});
    const StepOutcome out = p.step(rig.request, {});
    EXPECT_TRUE(out.ran);
    if (clipping) {
      EXPECT_EQ(out.kept_from_backward, 0U) << "an update without the clip factor cannot stand";
      EXPECT_EQ(backward.stats().redone, submitted);
    } else {
      EXPECT_EQ(out.kept_from_backward, submitted);
    }
    EXPECT_EQ(rig.state(), reference(out.clip));
    EXPECT_FALSE(backward.pending());
  }
}

}  // namespace
}  // namespace memtide::tiering
