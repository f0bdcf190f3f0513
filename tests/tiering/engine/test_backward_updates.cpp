// BackwardUpdates: subgroups updated on a worker while "backward" goes on give the sequential
// step's bits when the step takes them, and are put back exactly when it does not.

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/tiering/engine/backward_updates.hpp"
#include "sim_engine.hpp"

namespace memtide::tiering {
namespace {

constexpr std::size_t kN = test::SimEngine::kParams;
constexpr std::size_t kPer = 3'000;  // 4 subgroups; params of 2,000 elements: 6 params

struct Rig : test::SimEngine {
  StepRequest request;

  explicit Rig(unsigned seed) {
    std::vector<ParamSlot> slots;
    for (std::size_t s = 0; s < kN; s += 2'000) slots.push_back({s, s + 2'000, 0, false});
    engine.set_layout(ParamLayout(slots, engine.subgroups()));
    engine.set_policy(PolicyChoice{Policy::cpu, 0, {}});
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    for (std::size_t i = 0; i < kN; ++i) {
      engine.param()[i] = normal(rng);
      engine.grad()[i] = normal(rng);
    }
    request.groups = {StepParams{}};
    request.has_grad.assign(slots.size(), 1);
  }
  [[nodiscard]] std::vector<float> state() const {
    std::vector<float> out(engine.param(), engine.param() + kN);
    out.insert(out.end(), engine.exp_avg(), engine.exp_avg() + kN);
    out.insert(out.end(), engine.exp_avg_sq(), engine.exp_avg_sq() + kN);
    return out;
  }
};

// Backward finishes the params from the last to the first; returns the subgroups submitted.
std::vector<std::size_t> backward(BackwardUpdates& b, Rig& rig) {
  std::vector<std::size_t> submitted;
  b.backward_started();
  for (std::size_t i = rig.engine.layout().size(); i-- > 0;) {
    for (std::size_t g : b.grad_ready(i)) {
      b.submit(g, rig.request);
      submitted.push_back(g);
    }
  }
  b.backward_ended();
  return submitted;
}

// One step through the engine, taking what the updates during backward did.
void step(BackwardUpdates& b, Rig& rig, double clip = 1.0) {
  b.settle();
  StepRequest r = rig.request;
  r.clip = clip;
  r.done = b.accept(r, {}, false);
  (void)rig.engine.step(r);
  b.publish();
  b.finish();
}

TEST(BackwardUpdates, TakenUpdatesGiveTheSequentialStepsBits) {
  Rig plain(3), eager(3);
  BackwardUpdates b(eager.engine, 2);
  b.rebuild(std::vector<bool>(6, true));
  EXPECT_EQ(b.last_choice().rule, "count");
  EXPECT_EQ(b.chosen(), (std::set<std::size_t>{2, 3}));  // backward completes the last ones first
  for (int s = 0; s < 3; ++s) {
    (void)plain.engine.step(plain.request);
    const std::vector<std::size_t> submitted = backward(b, eager);
    // Untimed, the chosen ones; timed, those the worker finishes before backward ends (here
    // backward takes no time at all: none, which the step then updates itself).
    if (s == 0) {
      EXPECT_EQ(submitted, (std::vector<std::size_t>{3, 2}));
    }
    step(b, eager);
  }
  EXPECT_EQ(plain.state(), eager.state());
  EXPECT_GE(b.stats().speculated, 2U);
  EXPECT_EQ(b.stats().kept, b.stats().speculated);
  EXPECT_EQ(b.last_choice().rule, "time");  // a backward and the worker were timed
  EXPECT_GT(b.last_choice().ns_per_param, 0.0);
  EXPECT_EQ(eager.engine.layout().steps()[0], 3.0F);
}

TEST(BackwardUpdates, UpdatesTheStepCannotTakeArePutBackAndRedone) {
  Rig plain(5), eager(5);
  BackwardUpdates b(eager.engine, 4);
  b.rebuild(std::vector<bool>(6, true));
  StepRequest clipped = plain.request;
  clipped.clip = 0.5;  // the global norm bit: the updates used clip 1
  (void)plain.engine.step(clipped);
  EXPECT_EQ(backward(b, eager).size(), 4U);
  step(b, eager, 0.5);
  EXPECT_EQ(plain.state(), eager.state());
  EXPECT_EQ(b.stats().redone, 4U);
  EXPECT_EQ(b.stats().kept, 0U);
}

TEST(BackwardUpdates, RollbackRestoresEverythingAndASecondGradientInvalidates) {
  Rig rig(7);
  const std::vector<float> before = rig.state();
  BackwardUpdates b(rig.engine, 4);
  b.rebuild(std::vector<bool>(6, true));
  (void)backward(b, rig);
  b.settle();
  EXPECT_NE(rig.state(), before);  // moments updated in place
  b.rollback();
  EXPECT_EQ(rig.state(), before);
  EXPECT_EQ(b.stats().rolled_back, 4U);
  EXPECT_FALSE(b.pending());

  b.rebuild(std::vector<bool>(6, true));  // forgets the timing: the count rule again
  (void)backward(b, rig);
  (void)b.grad_ready(5);  // a second backward before the step: subgroup 3's update read the first
  b.settle();
  const std::vector<bool> done = b.accept(rig.request, {}, false);
  EXPECT_EQ(done, (std::vector<bool>{true, true, true, false}));
  EXPECT_THROW(BackwardUpdates(rig.engine, 0), InvalidArgument);
}

}  // namespace
}  // namespace memtide::tiering
