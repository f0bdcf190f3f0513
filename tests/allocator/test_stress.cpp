// Deterministic multi-threaded, multi-stream stress: each thread runs a fixed pseudo-random
// sequence (its own seed) of allocations, frees and record_stream calls on shared streams, under
// a cap tight enough to exercise retries and cross-stream moves. Every block is filled with a
// byte unique to its owner and checked before it is freed, so two live blocks that overlap are
// caught. Built and run under ASan+UBSan and TSan by scripts/test.sh.

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "device_types.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/core/error.hpp"

using namespace memtide;
using memtide::test::WithDevice;

namespace {
constexpr int kThreads = 4;
constexpr int kStreams = 3;
constexpr int kOpsPerThread = 2500;
constexpr std::size_t kCap = 96ULL << 20;

struct Live {
  void* ptr;
  std::size_t size;
  unsigned char byte;
  Stream stream;
};
}  // namespace

template <typename B>
class Stress : public WithDevice<B> {};
TYPED_TEST_SUITE(Stress, memtide::test::DeviceBackends, memtide::test::BackendNames);

TYPED_TEST(Stress, ThreadsAndStreamsNeverShareLiveMemory) {
  Device& dev = this->device();
  AllocatorConfig config;
  config.max_bytes = kCap;
  config.record_history = true;
  config.history_entries = 4096;  // exercises the ring buffer wrapping
  CachingAllocator alloc(dev, config);
  std::array<Stream, kStreams> streams{};
  for (Stream& s : streams) s = dev.create_stream();

  std::atomic<int> corrupt{0};
  std::atomic<int> ooms{0};
  std::atomic<bool> done{false};

  auto worker = [&](int tid) {
    std::mt19937 rng(static_cast<unsigned>(1000 + tid));
    std::vector<Live> live;
    std::vector<unsigned char> probe(64);
    auto check_and_free = [&](std::size_t i) {
      const Live& l = live[i];
      const std::size_t n = std::min<std::size_t>(probe.size(), l.size);
      for (std::size_t off : {std::size_t{0}, l.size - n}) {
        dev.copy_async(probe.data(), static_cast<char*>(l.ptr) + off, n, CopyKind::device_to_host, l.stream);
        dev.stream_synchronize(l.stream);
        for (std::size_t k = 0; k < n; ++k) {
          if (probe[k] != l.byte) {
            ++corrupt;
            break;
          }
        }
      }
      alloc.deallocate(l.ptr, l.stream);
      live[i] = live.back();
      live.pop_back();
    };
    for (int op = 0; op < kOpsPerThread; ++op) {
      const bool grow = live.empty() || (rng() % 100 < 52 && live.size() < 24);
      if (grow) {
        const std::size_t size = rng() % 8 == 0 ? 1 + rng() % (12 << 20) : 1 + rng() % (300 << 10);
        const Stream s = streams[rng() % kStreams];
        try {
          void* p = alloc.allocate(size, s);
          const auto byte = static_cast<unsigned char>(1 + (tid * 61 + op) % 255);
          dev.memset_async(p, byte, size, s);
          live.push_back({p, size, byte, s});
          if (rng() % 10 == 0) alloc.record_stream(p, streams[rng() % kStreams]);
        } catch (const OutOfMemory&) {
          ++ooms;
          while (live.size() > 2) check_and_free(rng() % live.size());
        }
      } else {
        check_and_free(rng() % live.size());
      }
    }
    while (!live.empty()) check_and_free(live.size() - 1);
  };

  // A reader thread does what a training loop's other threads do: phases, stats, snapshots.
  std::thread observer([&] {
    int i = 0;
    while (!done.load()) {
      alloc.mark_phase(static_cast<Phase>(i++ % 3));
      (void)alloc.headroom(Phase::forward);
      (void)alloc.stats();
      if (i % 50 == 0) {
        const std::string err = validate_snapshot(alloc.snapshot());
        if (!err.empty()) ADD_FAILURE() << err;
      }
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  done = true;
  observer.join();

  dev.synchronize();
  alloc.empty_cache();
  const AllocatorStats s = alloc.stats();
  EXPECT_EQ(corrupt.load(), 0) << "a live block was overwritten by another allocation";
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.active_bytes[0].current, 0);
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.num_invalid_frees, 0);
  EXPECT_LE(s.reserved_bytes[0].peak, static_cast<std::int64_t>(kCap));
  EXPECT_GT(s.allocation[0].allocated, kThreads * kOpsPerThread / 4);
  EXPECT_EQ(validate_snapshot(alloc.snapshot()), "");
  this->RecordProperty("ooms", ooms.load());
  this->RecordProperty("retries", static_cast<int>(s.num_alloc_retries));
  this->RecordProperty("cross_stream_moves", static_cast<int>(s.num_cross_stream_reuse));
  for (Stream st : streams) dev.destroy_stream(st);
}
