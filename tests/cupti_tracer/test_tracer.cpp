// The CUPTI tracer without a GPU: synthetic activity records decoded the way CUPTI hands them over
// (as Kineto tests its CUPTI code), and every status through a fake CUPTI: active, partial, busy,
// no_gpu, no_cupti; the process's tracer on the steady clock; plus the real loader on this machine.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "memtide/cupti_tracer/tracer.hpp"

#if MEMTIDE_HAVE_CUPTI_H
#include <cupti_activity.h>
#include <cupti_result.h>
#endif

using namespace memtide::cupti;

#if MEMTIDE_HAVE_CUPTI_H
namespace {

// ---- synthetic records and a fake CUPTI ----------------------------------------------------

std::size_t record_size(const CUpti_Activity* r) {
  switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    case CUPTI_ACTIVITY_KIND_MEMSET: return sizeof(CUpti_ActivityMemset4);
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return sizeof(CUpti_ActivityKernel10);
    default: return sizeof(CUpti_ActivityMarker2);
  }
}

// CUPTI's contract: *record null asks for the first record, else for the one after it;
// CUPTI_ERROR_MAX_LIMIT_REACHED past the last valid byte.
int fake_next(std::uint8_t* buffer, std::size_t valid, void** record) {
  std::uint8_t* next = *record == nullptr ? buffer
                                          : static_cast<std::uint8_t*>(*record) +
                                                record_size(static_cast<const CUpti_Activity*>(*record));
  if (next >= buffer + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
  *record = next;
  return CUPTI_SUCCESS;
}

struct Buffer {
  std::vector<std::uint8_t> bytes;
  template <class R>
  void add(const R& r) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&r);
    bytes.insert(bytes.end(), p, p + sizeof r);
  }
};

CUpti_ActivityMemcpy6 copy(CUpti_ActivityMemcpyKind kind, CUpti_ActivityMemoryKind host, std::uint64_t start,
                           std::uint64_t end, std::uint64_t bytes) {
  CUpti_ActivityMemcpy6 r{};
  r.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
  r.copyKind = static_cast<std::uint8_t>(kind);
  r.srcKind = static_cast<std::uint8_t>(kind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD ? host : CUPTI_ACTIVITY_MEMORY_KIND_DEVICE);
  r.dstKind = static_cast<std::uint8_t>(kind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? host : CUPTI_ACTIVITY_MEMORY_KIND_DEVICE);
  r.start = start;
  r.end = end;
  r.bytes = bytes;
  r.deviceId = 0;
  r.streamId = 7;
  return r;
}

struct Fake {
  static inline int enable_rc[3] = {0, 0, 0};  // MEMCPY, MEMSET, CONCURRENT_KERNEL
  static inline int calls = 0;
  static inline void (*completed)(void*, std::uint32_t, std::uint8_t*, std::size_t, std::size_t) = nullptr;
  static inline void (*requested)(std::uint8_t**, std::size_t*, std::size_t*) = nullptr;
  static int index(int kind) {
    return kind == CUPTI_ACTIVITY_KIND_MEMCPY ? 0 : kind == CUPTI_ACTIVITY_KIND_MEMSET ? 1 : 2;
  }
  static Api api(int devices = 1) {
    calls = 0;
    Api a;
    a.devices = devices;
    a.activity_enable = [](int kind) { ++calls; return enable_rc[index(kind)]; };
    a.activity_disable = [](int) { ++calls; return 0; };
    a.register_callbacks = [](void (*req)(std::uint8_t**, std::size_t*, std::size_t*),
                              void (*done)(void*, std::uint32_t, std::uint8_t*, std::size_t, std::size_t)) {
      ++calls;
      requested = req;
      completed = done;
      return 0;
    };
    a.flush_all = [](std::uint32_t) { ++calls; return 0; };
    a.get_next_record = &fake_next;
    a.get_num_dropped = [](void*, std::uint32_t, std::size_t* n) { *n = 0; return 0; };
    a.get_timestamp = [](std::uint64_t* t) { *t = 42; return 0; };
    return a;
  }
  static void reset() { enable_rc[0] = enable_rc[1] = enable_rc[2] = 0; }
};

}  // namespace

TEST(CuptiDecode, CopiesMemsetsAndKernelsFromSyntheticRecords) {
  const auto h2d = copy(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, CUPTI_ACTIVITY_MEMORY_KIND_PINNED, 100, 300, 4096);
  auto a = decode(&h2d);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->kind, Activity::Kind::h2d);
  EXPECT_TRUE(a->pinned);
  EXPECT_EQ(a->bytes, 4096U);
  EXPECT_EQ(a->start_ns, 100U);
  EXPECT_EQ(a->end_ns, 300U);
  EXPECT_EQ(a->stream, 7U);
  const auto d2h = copy(CUPTI_ACTIVITY_MEMCPY_KIND_DTOH, CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE, 0, 10, 8);
  a = decode(&d2h);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->kind, Activity::Kind::d2h);
  EXPECT_FALSE(a->pinned);  // pageable staging: what DeepSpeed's gradient flush does
  CUpti_ActivityMemset4 set{};
  set.kind = CUPTI_ACTIVITY_KIND_MEMSET;
  set.bytes = 64;
  set.start = 5;
  set.end = 6;
  a = decode(&set);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->kind, Activity::Kind::memset);
  CUpti_ActivityKernel10 k{};
  k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k.start = 1;
  k.end = 9;
  a = decode(&k);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->kind, Activity::Kind::kernel);
  CUpti_ActivityMarker2 other{};
  other.kind = CUPTI_ACTIVITY_KIND_MARKER;
  EXPECT_FALSE(decode(&other));
}

TEST(CuptiTracer, ActiveTracerWalksCuptisBuffersAndDropsBeyondItsCapacity) {
  Fake::reset();
  Tracer t(Fake::api(), 3);
  ASSERT_EQ(t.start(), Status::active) << t.detail();
  EXPECT_EQ(t.now_ns(), 42U);
  Buffer b;
  for (std::uint64_t i = 0; i < 4; ++i) {
    b.add(copy(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, CUPTI_ACTIVITY_MEMORY_KIND_PINNED, i * 10, i * 10 + 5, 100 + i));
  }
  CUpti_ActivityMarker2 skip{};
  skip.kind = CUPTI_ACTIVITY_KIND_MARKER;
  b.add(skip);
  // Through CUPTI's own callbacks, with a buffer the tracer handed out (it frees it).
  ASSERT_NE(Fake::requested, nullptr);
  std::uint8_t* buffer = nullptr;
  std::size_t size = 0, max_records = 0;
  Fake::requested(&buffer, &size, &max_records);
  ASSERT_NE(buffer, nullptr);
  ASSERT_GE(size, b.bytes.size());
  std::memcpy(buffer, b.bytes.data(), b.bytes.size());
  Fake::completed(nullptr, 0, buffer, size, b.bytes.size());
  // The PCIe use over what is held, without taking it: copies 1..3 at 10-15, 20-25, 30-35 ns.
  const PcieUse held = t.pcie_between(0, 100);
  EXPECT_DOUBLE_EQ(held.h2d.bytes, 101 + 102 + 103);
  EXPECT_DOUBLE_EQ(held.h2d.busy_ns, 15);
  const std::vector<Activity> got = t.take();
  ASSERT_EQ(got.size(), 3U);  // capacity 3: the oldest of the 4 copies went
  EXPECT_EQ(got.front().bytes, 101U);
  EXPECT_EQ(t.dropped(), 1U);
  EXPECT_TRUE(t.take().empty());
  t.stop();
  EXPECT_EQ(t.status(), Status::off);
}

TEST(CuptiTracer, AnotherSubscriberMakesItBusyAndNothingStaysEnabled) {
  Fake::reset();
  Fake::enable_rc[0] = Fake::enable_rc[1] = Fake::enable_rc[2] = CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
  Tracer t(Fake::api());
  EXPECT_EQ(t.start(), Status::busy);
  EXPECT_NE(t.detail().find("another subscriber"), std::string::npos) << t.detail();
  Fake::reset();
  Tracer other(Fake::api());  // the busy one let go of the process's slot
  EXPECT_EQ(other.start(), Status::active) << other.detail();
}

TEST(CuptiTracer, ARefusedKindIsPartialAndNamed) {
  Fake::reset();
  Fake::enable_rc[2] = CUPTI_ERROR_NOT_COMPATIBLE;
  Tracer t(Fake::api());
  EXPECT_EQ(t.start(), Status::partial);
  EXPECT_NE(t.detail().find("CONCURRENT_KERNEL refused"), std::string::npos) << t.detail();
  Fake::reset();
}

TEST(CuptiTracer, NoGpuAndNoCuptiNeverCallCupti) {
  Fake::reset();
  Tracer none(Fake::api(0));
  EXPECT_EQ(none.start(), Status::no_gpu);
  EXPECT_EQ(Fake::calls, 0);
  Api missing = Fake::api(1);
  missing.problem = "libcupti could not be loaded";
  Tracer t(missing);
  EXPECT_EQ(t.start(), Status::no_cupti);
  EXPECT_EQ(t.detail(), "libcupti could not be loaded");
  EXPECT_EQ(Fake::calls, 0);
  t.stop();  // harmless
}

double steady_now_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// The process's tracer puts CUPTI's times on the steady clock: the fake's clock reads 42 at start,
// so a copy at CUPTI's 42 + 1 s ran 1 s after start on the steady clock.
TEST(CuptiProcessTrace, RecordsAndPcieUseAreOnTheSteadyClock) {
  Fake::reset();
  const double before = steady_now_ns();
  const ProcessTrace::Started started = ProcessTrace::start(Fake::api());
  const double after = steady_now_ns();
  ASSERT_EQ(started.status, Status::active) << started.detail;
  Buffer b;
  constexpr std::uint64_t kSecond = 1'000'000'000;
  b.add(copy(CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, CUPTI_ACTIVITY_MEMORY_KIND_PINNED, 42 + kSecond, 47 + kSecond, 1000));
  b.add(copy(CUPTI_ACTIVITY_MEMCPY_KIND_DTOH, CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE, 52 + kSecond, 62 + kSecond, 10));
  std::uint8_t* buffer = nullptr;
  std::size_t size = 0, max_records = 0;
  Fake::requested(&buffer, &size, &max_records);
  std::memcpy(buffer, b.bytes.data(), b.bytes.size());
  Fake::completed(nullptr, 0, buffer, size, b.bytes.size());

  const auto use = ProcessTrace::pcie(after, after + 2 * kSecond);
  ASSERT_TRUE(use.has_value());
  EXPECT_DOUBLE_EQ(use->h2d.bytes, 1000);
  EXPECT_DOUBLE_EQ(use->d2h.bytes, 10);
  EXPECT_DOUBLE_EQ(ProcessTrace::pcie(after, after + 0.5 * kSecond)->h2d.bytes, 0) << "before the copies";
  EXPECT_FALSE(ProcessTrace::pcie(after + kSecond, after).has_value()) << "an empty window";
  EXPECT_FALSE(ProcessTrace::pcie(before - kSecond, after).has_value()) << "a window from before the trace";

  const std::vector<ProcessTrace::Timed> got = ProcessTrace::stop();
  ASSERT_EQ(got.size(), 2U);
  EXPECT_EQ(got[0].activity.kind, Activity::Kind::h2d);
  EXPECT_GE(got[0].start_ns, before + kSecond);
  EXPECT_LE(got[0].start_ns, after + kSecond);
  EXPECT_DOUBLE_EQ(got[0].end_ns - got[0].start_ns, 5);
  EXPECT_FALSE(got[1].activity.pinned);
  EXPECT_FALSE(ProcessTrace::pcie(after, after + 2 * kSecond).has_value()) << "stopped: nothing traces";
  EXPECT_TRUE(ProcessTrace::stop().empty()) << "taken once";

  const ProcessTrace::Started none = ProcessTrace::start(Fake::api(0));
  EXPECT_EQ(none.status, Status::no_gpu);
  EXPECT_FALSE(none.detail.empty());
  EXPECT_FALSE(ProcessTrace::pcie(before, after).has_value());
  EXPECT_TRUE(ProcessTrace::stop().empty());
}

TEST(CuptiTracer, TheRealLoaderReportsAStatusNotAnError) {
  Tracer t(Api::load());
  const Status s = t.start();
  // Here: no_gpu without a GPU; on a GPU machine active (or busy under a profiler).
  EXPECT_TRUE(s == Status::active || s == Status::partial || s == Status::busy || s == Status::no_gpu ||
              s == Status::no_cupti)
      << to_string(s);
  if (s != Status::active) {
    EXPECT_FALSE(t.detail().empty());
  }
  t.stop();
}
#endif

TEST(CuptiPcie, BytesBusyTimeAndBandwidthPerDirectionInAWindow) {
  std::vector<Activity> acts;
  auto add = [&](Activity::Kind k, std::uint64_t s, std::uint64_t e, std::uint64_t bytes) {
    Activity a;
    a.kind = k;
    a.start_ns = s;
    a.end_ns = e;
    a.bytes = bytes;
    acts.push_back(a);
  };
  add(Activity::Kind::h2d, 0, 100, 1000);
  add(Activity::Kind::h2d, 50, 150, 1000);  // overlaps the first: busy time is the union
  add(Activity::Kind::d2h, 200, 300, 500);
  add(Activity::Kind::kernel, 0, 1000, 0);
  PcieUse u = pcie_use(acts, 0, 1000);
  EXPECT_DOUBLE_EQ(u.h2d.bytes, 2000);
  EXPECT_DOUBLE_EQ(u.h2d.busy_ns, 150);
  EXPECT_DOUBLE_EQ(u.d2h.bytes, 500);
  EXPECT_NEAR(u.h2d.bytes_per_s(), 2000 / 150e-9, 1);
  u = pcie_use(acts, 100, 250);  // a window cuts copies: their bytes count pro rata
  EXPECT_DOUBLE_EQ(u.h2d.bytes, 500);
  EXPECT_DOUBLE_EQ(u.h2d.busy_ns, 50);
  EXPECT_DOUBLE_EQ(u.d2h.bytes, 250);
  EXPECT_EQ(to_string(Status::busy), std::string("busy"));
}
