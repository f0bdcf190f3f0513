// CopyBuffers: the copy-on-write memory of checkpoint saves, kept from one save to the next.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "memtide/core/detail/os_testing.hpp"
#include "memtide/tiering/checkpoint/copy_buffers.hpp"

namespace {

using memtide::tiering::CopyBuffers;
constexpr std::size_t MiB = std::size_t{1} << 20;

TEST(CopyBuffers, ARegionGivenBackIsTakenAgainInsteadOfANewMapping) {
  CopyBuffers pool;
  CopyBuffers::Region a = pool.take(5 * MiB + 3);
  ASSERT_TRUE(a);
  EXPECT_GE(a.bytes(), 5 * MiB + 3);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % (2 * MiB), 0U) << "block-aligned for O_DIRECT, and more";
  std::memset(a.data(), 7, a.bytes());
  unsigned char* const at = a.data();
  pool.give(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved from, as documented
  EXPECT_EQ(pool.kept_bytes(), 6 * MiB);
  memtide::os::testing::reset();
  CopyBuffers::Region b = pool.take(4 * MiB);
  EXPECT_EQ(b.data(), at) << "the kept region that holds the bytes";
  EXPECT_EQ(memtide::os::testing::count(memtide::os::testing::Call::map), 0U) << "no new mapping";
  EXPECT_EQ(pool.kept_bytes(), 0U);
}

TEST(CopyBuffers, KeptRegionsTooSmallAreLetGoAndIdleKeepsWithinItsBound) {
  CopyBuffers pool;
  CopyBuffers::Region a = pool.take(2 * MiB), b = pool.take(2 * MiB);
  pool.give(std::move(a));
  pool.give(std::move(b));
  EXPECT_EQ(pool.kept_bytes(), 4 * MiB);
  CopyBuffers::Region big = pool.take(8 * MiB);  // neither fits: both go, one mapping comes
  ASSERT_TRUE(big);
  EXPECT_EQ(pool.kept_bytes(), 0U);
  CopyBuffers::Region small = pool.take(2 * MiB);
  pool.give(std::move(big));
  pool.give(std::move(small));
  EXPECT_EQ(pool.kept_bytes(), 10 * MiB);
  CopyBuffers::Region fit = pool.take(MiB);  // the smallest that holds it
  EXPECT_EQ(fit.bytes(), 2 * MiB);
  pool.give(std::move(fit));
  pool.idle(9 * MiB);  // the largest go first
  EXPECT_EQ(pool.kept_bytes(), 2 * MiB);
  pool.idle(0);
  EXPECT_EQ(pool.kept_bytes(), 0U);
}

TEST(CopyBuffers, ARefusedMappingGivesAnEmptyRegion) {
  CopyBuffers pool;
  memtide::os::testing::reset();
  memtide::os::testing::fail_nth(memtide::os::testing::Call::map, 0, ENOMEM);
  EXPECT_FALSE(pool.take(3 * MiB));
  memtide::os::testing::reset();
  EXPECT_TRUE(pool.take(3 * MiB));
  EXPECT_EQ(memtide::os::testing::count(memtide::os::testing::Call::advise), 1U) << "populated in one call";
  // Populating refused (a kernel before 5.14): the region is given anyway, to fault in on use.
  memtide::os::testing::fail_nth(memtide::os::testing::Call::advise, 0, EINVAL);
  CopyBuffers::Region r = pool.take(3 * MiB);
  ASSERT_TRUE(r);
  std::memset(r.data(), 1, r.bytes());
}

}  // namespace
