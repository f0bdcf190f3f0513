// The os layer's cache-size reading: the one figure the CPU step uses to choose between cached
// and non-temporal stores (tiering/kernels/adamw_cpu.cpp).

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "memtide/core/os.hpp"

using namespace memtide;

TEST(Os, CacheSizesReadAsSysfsWritesThem) {
  EXPECT_EQ(os::parse_cache_size("32768K\n"), std::size_t{32} << 20);
  EXPECT_EQ(os::parse_cache_size("1M"), std::size_t{1} << 20);
  EXPECT_EQ(os::parse_cache_size("2G"), std::size_t{2} << 30);
  EXPECT_EQ(os::parse_cache_size("512"), std::size_t{512});
  for (const char* bad : {"", "K", "-1K", "12Q", "1.5M", "32768K junk", "99999999999999999999999K"}) {
    EXPECT_EQ(os::parse_cache_size(bad), 0u) << bad;
  }
  EXPECT_EQ(os::parse_cache_size(nullptr), 0u);
}

TEST(Os, LastLevelCacheIsAtLeastTheSecondLevelAndAtMostTheSocket) {
  const std::size_t llc = os::last_level_cache_bytes();
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  const long socket = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc == 0) GTEST_SKIP() << "neither sysfs nor sysconf knows this machine's caches";
  if (l2 > 0) {
    EXPECT_GE(llc, static_cast<std::size_t>(l2));
  }
  // sysconf reports the whole socket's L3 (CPUID); the slice the first core shares is never larger.
  if (socket > 0) {
    EXPECT_LE(llc, static_cast<std::size_t>(socket));
  }
}
