// The one rule for which subgroups are updated during backward (training and the simulator).
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include "memtide/tiering/engine/backward_choice.hpp"

using namespace memtide::tiering;

namespace {

const std::vector<std::pair<std::size_t, std::size_t>> kGroups = {{0, 10}, {10, 20}, {20, 30}, {30, 40}};
const std::vector<Placement> kPlacement = {Placement::cpu, Placement::gpu_static, Placement::gpu, Placement::cpu};

}  // namespace

TEST(BackwardChoice, UntimedTakesTheLastCandidatesUpToTheCap) {
  const std::vector<bool> none;
  const std::map<std::size_t, double> ready;
  const BackwardChoice c = choose_backward_updates({kPlacement, none, kGroups, ready, std::nullopt, std::nullopt, 2});
  EXPECT_EQ(c.rule, "count");
  EXPECT_EQ(c.candidates, 3u);  // the static resident is no candidate
  EXPECT_EQ(c.subgroups, (std::vector<std::size_t>{2, 3}));
}

TEST(BackwardChoice, TimedTakesWhatFinishesBeforeBackwardEnds) {
  const std::vector<bool> none;
  // Backward completes the last subgroup first; 10 params at 1 ns each.
  const std::map<std::size_t, double> ready = {{0, 90}, {1, 60}, {2, 30}, {3, 0}};
  const BackwardChoice c = choose_backward_updates({kPlacement, none, kGroups, ready, 1.0, 95.0, 8});
  EXPECT_EQ(c.rule, "time");
  EXPECT_EQ(c.subgroups, (std::vector<std::size_t>{2, 3}));  // 0 would end at 100, after 95
  EXPECT_DOUBLE_EQ(c.backward_tail_s, 95e-9);
  EXPECT_DOUBLE_EQ(c.ns_per_param, 1.0);
  // A subgroup not seen in the last backward is not taken by time.
  const std::map<std::size_t, double> partial = {{3, 0}};
  EXPECT_EQ(choose_backward_updates({kPlacement, none, kGroups, partial, 1.0, 95.0, 8}).subgroups,
            (std::vector<std::size_t>{3}));
}

TEST(BackwardChoice, NoneWhileAnySubgroupSpills) {
  const std::vector<bool> spilled = {false, false, false, true};
  const std::map<std::size_t, double> ready = {{0, 0}, {2, 0}, {3, 0}};
  for (const auto& [ns, end] : {std::pair<std::optional<double>, std::optional<double>>{std::nullopt, std::nullopt},
                                {1.0, 1e9}}) {
    const BackwardChoice c = choose_backward_updates({kPlacement, spilled, kGroups, ready, ns, end, 8});
    EXPECT_EQ(c.candidates, 0u);
    EXPECT_TRUE(c.subgroups.empty());
  }
}
