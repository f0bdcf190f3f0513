// The layer window's size (STRONGHOLD's P1/P2 and memory) and its modelled pass time.

#include <gtest/gtest.h>

#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/tiering/window/layer_window.hpp"

using namespace memtide;
using namespace memtide::tiering;

namespace {
constexpr std::uint64_t MiB = 1ULL << 20;

// n equal blocks: forward 10 ms, backward 20 ms, each copy 25 ms, 100 MiB each.
std::vector<BlockProfile> uniform(int n, double h2d_ms = 25, double d2h_ms = 25) {
  BlockProfile b;
  b.forward_ns = 10e6;
  b.backward_ns = 20e6;
  b.h2d_ns = h2d_ms * 1e6;
  b.d2h_ns = d2h_ms * 1e6;
  b.bytes = 100 * MiB;
  return std::vector<BlockProfile>(static_cast<std::size_t>(n), b);
}
}  // namespace

// Blocks alternating a heavy copy (18 ms) and a light one (2 ms), 10 ms of forward each: one
// block of compute cannot cover a heavy copy (P1 fails at m = 1), two can, and on average the
// copy engine keeps up.
std::vector<BlockProfile> alternating(int n) {
  auto blocks = uniform(n, 0, 8);
  for (int i = 0; i < n; ++i) blocks[static_cast<std::size_t>(i)].h2d_ns = (i % 2 == 0 ? 18 : 2) * 1e6;
  return blocks;
}

TEST(LayerWindow, PicksTheSmallestWindowWhoseComputeCoversEveryCopy) {
  const WindowSize w = choose_window(alternating(12), 1000 * MiB);
  EXPECT_EQ(w.blocks, 2);
  EXPECT_TRUE(w.hides_transfers) << w.why;
  EXPECT_EQ(w.peak_bytes, 300 * MiB);  // two blocks and the one coming in
  EXPECT_NE(w.why.find("smallest window"), std::string::npos) << w.why;
  EXPECT_GT(window_pass_ns(alternating(12), 1), window_pass_ns(alternating(12), 2));
  // With 5 ms of hook overhead per call, one block's forward (20 ms) covers the heavy copy.
  EXPECT_EQ(choose_window(alternating(12), 1000 * MiB, 5e6).blocks, 1);
}

TEST(LayerWindow, CopiesSlowerThanComputeCannotBeHiddenByAnyWindow) {
  // 25 ms copies behind 10 ms blocks: the copy engine falls behind whatever the window, which
  // STRONGHOLD's per-layer P1 alone would not see (it holds from m = 3 on).
  const WindowSize w = choose_window(uniform(12), 1000 * MiB);
  EXPECT_FALSE(w.hides_transfers);
  EXPECT_NE(w.why.find("stall"), std::string::npos) << w.why;
}

TEST(LayerWindow, MemoryBoundWindowSaysCopiesStall) {
  const WindowSize w = choose_window(uniform(12), 300 * MiB);  // room for 2 + 1
  EXPECT_EQ(w.blocks, 2);
  EXPECT_FALSE(w.hides_transfers);
  EXPECT_EQ(w.peak_bytes, 300 * MiB);
  EXPECT_NE(w.why.find("stall"), std::string::npos) << w.why;
}

TEST(LayerWindow, EverythingFittingNeedsNoWindow) {
  const WindowSize w = choose_window(uniform(4), 400 * MiB);
  EXPECT_EQ(w.blocks, 4);
  EXPECT_TRUE(w.hides_transfers);
}

TEST(LayerWindow, OneBlockAndItsPrefetchMustFitOrTheErrorSaysSo) {
  try {
    (void)choose_window(uniform(12), 150 * MiB);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("200.00 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("150.00 MiB"), std::string::npos) << what;
  }
  try {
    (void)choose_window(uniform(1), 50 * MiB);  // one block: nothing to prefetch, it must fit alone
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the one block needs 100.00 MiB"), std::string::npos) << what;
  }
  EXPECT_EQ(choose_window(uniform(1), 100 * MiB).blocks, 1);
  EXPECT_THROW((void)choose_window({}, 1), InvalidArgument);
  auto bad = uniform(3);
  bad[1].h2d_ns = -1;
  EXPECT_THROW((void)choose_window(bad, 1000 * MiB), InvalidArgument);
  EXPECT_THROW((void)window_pass_ns(uniform(3), 0), InvalidArgument);
}

TEST(LayerWindow, PassTimePlateausAtTheChosenWindow) {
  const auto blocks = alternating(24);
  const double compute = 24 * 30e6;
  std::vector<double> t;
  for (int m = 1; m <= 23; ++m) t.push_back(window_pass_ns(blocks, m));
  for (std::size_t i = 1; i < t.size(); ++i) EXPECT_LE(t[i], t[i - 1] + 1) << "m = " << i + 1;
  // m = 1 stalls on every heavy copy; m = 2 (the knee) hides them all: compute plus block 0's
  // gradients on their way out; larger windows buy nothing.
  EXPECT_GT(t[0], compute + 8e6);
  EXPECT_DOUBLE_EQ(t[1], compute + 8e6);
  EXPECT_DOUBLE_EQ(t[10], t[1]);
  EXPECT_EQ(choose_window(blocks, 1000 * MiB).blocks, 2);
  EXPECT_DOUBLE_EQ(window_pass_ns(blocks, 24), compute);  // all resident: no copies at all
}
