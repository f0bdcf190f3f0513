// ParamLayout: an optimizer's params cut into the segments of a step, and their step counts.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/tiering/engine/param_layout.hpp"

namespace memtide::tiering {
namespace {

StepParams hyper(double lr) {
  StepParams p;
  p.lr = lr;
  return p;
}

// Params of 3, 4, 5 and 2 elements (groups 0, 0, 1, 0; the third in low precision) over
// subgroups of 6: [0, 6), [6, 12), [12, 14).
ParamLayout four_params() {
  return ParamLayout({{0, 3, 0, false}, {3, 7, 0, false}, {7, 12, 1, true}, {12, 14, 0, false}},
                     {{0, 6}, {6, 12}, {12, 14}});
}

TEST(ParamLayout, RunsOfOneGroupStepAndPrecisionMergeInsideASubgroup) {
  const ParamLayout layout = four_params();
  const auto segs = layout.segments({hyper(1e-3), hyper(2e-3)}, {1, 1, 1, 1});
  ASSERT_EQ(segs.size(), 4U);
  // Subgroup 0: params 0 and 1 (group 0) as one run.
  EXPECT_EQ(segs[0].subgroup, 0U);
  EXPECT_EQ(segs[0].start, 0U);
  EXPECT_EQ(segs[0].end, 6U);
  EXPECT_EQ(segs[0].params.lr, 1e-3);
  EXPECT_EQ(segs[0].params.step, 1);
  // Subgroup 1: the rest of param 1, then param 2 (another group, low precision).
  EXPECT_EQ(segs[1].subgroup, 1U);
  EXPECT_EQ(segs[1].start, 6U);
  EXPECT_EQ(segs[1].end, 7U);
  EXPECT_EQ(segs[2].start, 7U);
  EXPECT_EQ(segs[2].end, 12U);
  EXPECT_EQ(segs[2].params.lr, 2e-3);
  EXPECT_TRUE(segs[2].low_precision);
  EXPECT_EQ(segs[3].subgroup, 2U);
  EXPECT_EQ(segs[3].start, 12U);
  EXPECT_EQ(segs[3].end, 14U);
}

TEST(ParamLayout, AParamWithoutGradientOrAtAnotherStepBreaksARun) {
  ParamLayout layout = four_params();
  auto segs = layout.segments({hyper(1e-3), hyper(2e-3)}, {1, 0, 1, 1});
  ASSERT_EQ(segs.size(), 3U);  // param 1 left out
  EXPECT_EQ(segs[0].end, 3U);
  EXPECT_EQ(segs[1].start, 7U);

  layout.advance({1, 0, 0, 0});  // param 0 at step 1, param 1 at 0
  segs = layout.segments({hyper(1e-3), hyper(2e-3)}, {1, 1, 0, 0});
  ASSERT_EQ(segs.size(), 3U);
  EXPECT_EQ(segs[0].params.step, 2);
  EXPECT_EQ(segs[0].end, 3U);
  EXPECT_EQ(segs[1].params.step, 1);
  EXPECT_EQ(segs[1].start, 3U);
  EXPECT_EQ(segs[1].end, 6U);
  EXPECT_EQ(layout.steps()[0], 1.0F);
  EXPECT_EQ(layout.steps()[1], 0.0F);
}

TEST(ParamLayout, OneSubgroupOnly) {
  const ParamLayout layout = four_params();
  const auto segs = layout.segments({hyper(1e-3), hyper(2e-3)}, {1, 1, 1, 1}, 1);
  ASSERT_EQ(segs.size(), 2U);
  EXPECT_EQ(segs[0].subgroup, 1U);
  EXPECT_EQ(segs[1].subgroup, 1U);
}

TEST(ParamLayout, SaysWhichSubgroupsEachParamSpans) {
  const ParamLayout layout = four_params();
  EXPECT_EQ(layout.subgroups_of(0), (std::pair<std::size_t, std::size_t>{0, 1}));
  EXPECT_EQ(layout.subgroups_of(1), (std::pair<std::size_t, std::size_t>{0, 2}));  // [3, 7) crosses 6
  EXPECT_EQ(layout.subgroups_of(3), (std::pair<std::size_t, std::size_t>{2, 3}));
  const ParamLayout empty_one({{0, 4, 0, false}, {4, 4, 0, false}}, {{0, 4}});
  EXPECT_EQ(empty_one.subgroups_of(1).first, empty_one.subgroups_of(1).second);  // no elements, no subgroup
}

TEST(ParamLayout, ZeroSizeParamsTakeNoSegment) {
  const ParamLayout layout({{0, 4, 0, false}, {4, 4, 0, false}, {4, 8, 0, false}}, {{0, 8}});
  const auto segs = layout.segments({hyper(1e-3)}, {1, 1, 1});
  ASSERT_EQ(segs.size(), 1U);
  EXPECT_EQ(segs[0].end, 8U);
}

TEST(ParamLayout, BadInputIsNamed) {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { ParamLayout({{0, 3, 0, false}, {4, 6, 0, false}}, {{0, 6}}); }).find("param 1"),
            std::string::npos);
  EXPECT_NE(message([] { ParamLayout({{0, 3, 0, false}}, {{0, 6}}); }).find("cover 3 elements"), std::string::npos);
  const ParamLayout layout = four_params();
  EXPECT_NE(message([&] { (void)layout.segments({hyper(1e-3), hyper(1e-3)}, {1, 1}); }).find("2 gradient flags"),
            std::string::npos);
  EXPECT_NE(message([&] { (void)layout.segments({hyper(1e-3)}, {1, 1, 1, 1}); }).find("group 1"), std::string::npos);
  EXPECT_NE(message([&] { (void)layout.segments({hyper(1e-3), hyper(1e-3)}, {1, 1, 1, 1}, 3); }).find("subgroup 3"),
            std::string::npos);
}

// The one cut every front end uses: whole subgroups then the rest, and a count beyond the bound
// refused with the smallest size that fits (named as the caller's user knows it).
TEST(CutSubgroups, CutsWholeSubgroupsThenTheRest) {
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  EXPECT_EQ(cut_subgroups(10, 4), (Ranges{{0, 4}, {4, 8}, {8, 10}}));
  EXPECT_EQ(cut_subgroups(8, 4), (Ranges{{0, 4}, {4, 8}}));
  EXPECT_EQ(cut_subgroups(3, 100), (Ranges{{0, 3}}));
  EXPECT_TRUE(cut_subgroups(0, 4).empty());
  EXPECT_EQ(cut_subgroups(kMaxSubgroups, 1).size(), kMaxSubgroups);
  try {
    (void)cut_subgroups(kMaxSubgroups * 3 + 1, 2, "--subgroup-size");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--subgroup-size 2 cuts"), std::string::npos) << m;
    EXPECT_NE(m.find("use --subgroup-size >= 4"), std::string::npos) << m;
  }
  EXPECT_THROW((void)cut_subgroups(10, 0), InvalidArgument);
}

}  // namespace
}  // namespace memtide::tiering
