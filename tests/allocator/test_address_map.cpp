#include <gtest/gtest.h>

#include <random>
#include <unordered_map>

#include "memtide/allocator/detail/address_map.hpp"

using memtide::detail::AddressMap;

TEST(AddressMap, AgreesWithUnorderedMapUnderRandomChurn) {
  AddressMap<int> map(16);
  std::unordered_map<std::uintptr_t, int> ref;
  std::mt19937_64 rng(42);
  // Few distinct addresses so inserts, erases and probe-run collisions all happen often.
  auto key = [&] { return (1 + rng() % 4000) * 512; };
  for (int step = 0; step < 200000; ++step) {
    const std::uintptr_t k = key();
    switch (rng() % 3) {
      case 0:
        if (!ref.count(k)) {
          map.insert(k, step);
          ref[k] = step;
        }
        break;
      case 1:
        EXPECT_EQ(map.erase(k), ref.erase(k) == 1);
        break;
      default: {
        const int* v = map.find(k);
        auto it = ref.find(k);
        ASSERT_EQ(v != nullptr, it != ref.end()) << "key " << k << " at step " << step;
        if (v != nullptr) {
          EXPECT_EQ(*v, it->second);
        }
      }
    }
    ASSERT_EQ(map.size(), ref.size());
  }
  std::size_t seen = 0;
  map.for_each([&](std::uintptr_t k, int v) {
    ++seen;
    EXPECT_EQ(ref.at(k), v);
  });
  EXPECT_EQ(seen, ref.size());
}

TEST(AddressMap, GrowsAndKeepsEverything) {
  AddressMap<std::uintptr_t> map(16);
  for (std::uintptr_t i = 1; i <= 100000; ++i) map.insert(i << 12, i);
  EXPECT_EQ(map.size(), 100000u);
  for (std::uintptr_t i = 1; i <= 100000; ++i) ASSERT_EQ(*map.find(i << 12), i);
  EXPECT_EQ(map.find(12345), nullptr);
  EXPECT_FALSE(map.erase(512));
}
