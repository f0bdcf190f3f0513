// The C ABI as torch and C programs see it: links libmemtide.so only. The runtime is a process
// singleton configured from the environment, so main() sets MEMTIDE_* before the first call.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include "memtide/memtide.h"

namespace {
std::int64_t stat(const char* name) {
  std::int64_t v = -1;
  EXPECT_EQ(memtide_stat(0, name, &v), MEMTIDE_OK) << memtide_last_error();
  return v;
}
}  // namespace

TEST(CApi, VersionAndBackend) {
  EXPECT_STREQ(memtide_version(), MEMTIDE_VERSION_STRING);
  EXPECT_STREQ(memtide_backend(), "sim");
}

TEST(CApi, MallocFreeRoundTripAndStats) {
  void* p = memtide_malloc(3 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr) << memtide_last_error();
  EXPECT_EQ(stat("allocated_bytes.all.current"), 3 << 20);
  memtide_free(p, 3 << 20, 0, nullptr);
  EXPECT_EQ(stat("allocated_bytes.all.current"), 0);
  EXPECT_EQ(memtide_malloc(0, 0, nullptr), nullptr);
}

TEST(CApi, BadFreeIsCountedNotFatal) {
  const std::int64_t before = stat("num_invalid_frees");
  int local = 0;
  memtide_free(&local, 4, 0, nullptr);
  EXPECT_NE(std::string(memtide_last_error()).find("not allocated"), std::string::npos);
  EXPECT_EQ(stat("num_invalid_frees"), before + 1);
  void* p = memtide_malloc(1024, 0, nullptr);
  memtide_free(p, 1024, 0, nullptr);
  memtide_free(p, 1024, 0, nullptr);
  EXPECT_EQ(stat("num_invalid_frees"), before + 2);
}

// A stream the device does not know is refused where it is passed (record_stream), not in the
// free that would need it; the block, its free and the allocator stay sound.
TEST(CApi, AnUnknownStreamIsRefusedAndTheAllocatorStaysSound) {
  const std::int64_t allocated = stat("allocated_bytes.all.current");
  void* p = memtide_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  memtide_record_stream(p, reinterpret_cast<memtide_stream_t>(0xbad));
  EXPECT_NE(std::string(memtide_last_error()).find("stream"), std::string::npos) << memtide_last_error();
  memtide_free(p, 4096, 0, nullptr);
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated);
  void* q = memtide_malloc(4096, 0, nullptr);
  ASSERT_NE(q, nullptr);
  memtide_free(q, 4096, 0, nullptr);
  void* r = memtide_malloc(8192, 0, nullptr);  // splits and coalesces around the same blocks
  memtide_free(r, 8192, 0, nullptr);
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated);
}

// A free that names another size or stream than the allocation is refused, nothing freed.
TEST(CApi, AFreeWithTheWrongSizeOrStreamIsRefused) {
  void* p = memtide_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const std::int64_t allocated = stat("allocated_bytes.all.current");
  memtide_free(p, 8192, 0, nullptr);
  EXPECT_NE(std::string(memtide_last_error()).find("8192"), std::string::npos) << memtide_last_error();
  memtide_free(p, 4096, 0, reinterpret_cast<memtide_stream_t>(0x1234));
  EXPECT_NE(std::string(memtide_last_error()).find("stream"), std::string::npos) << memtide_last_error();
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated);
  memtide_free(p, 4096, 0, nullptr);
  EXPECT_EQ(stat("allocated_bytes.all.current"), allocated - 4096);
}

TEST(CApi, OutOfMemoryReturnsNullWithTheReason) {
  EXPECT_EQ(memtide_malloc(std::size_t{1} << 40, 0, nullptr), nullptr);
  const std::string msg = memtide_last_error();
  EXPECT_NE(msg.find("out of memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1.00 TiB"), std::string::npos) << msg;
}

TEST(CApi, BadArgumentsAreErrorsWithMessages) {
  EXPECT_EQ(memtide_phase_mark_name("sideways"), MEMTIDE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(memtide_last_error()).find("sideways"), std::string::npos);
  EXPECT_EQ(memtide_phase_mark(static_cast<memtide_phase_t>(std::atoi("9"))), MEMTIDE_INVALID_ARGUMENT);
  std::int64_t v = 0;
  EXPECT_EQ(memtide_stat(0, "no_such_stat", &v), MEMTIDE_INVALID_ARGUMENT);
  EXPECT_EQ(memtide_stat(7, "num_ooms", &v), MEMTIDE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(memtide_last_error()).find("out of range"), std::string::npos);
  EXPECT_EQ(memtide_dump_snapshot(""), MEMTIDE_INVALID_ARGUMENT);
  EXPECT_EQ(memtide_dump_snapshot("/nonexistent-dir/x.pickle"), MEMTIDE_IO_ERROR);
  EXPECT_NE(std::string(memtide_last_error()).find("nonexistent-dir"), std::string::npos);
}

TEST(CApi, PhasesDriveHeadroom) {
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(memtide_phase_mark_name("forward"), MEMTIDE_OK);
    void* act = memtide_malloc(64 << 20, 0, nullptr);
    ASSERT_EQ(memtide_phase_mark(MEMTIDE_PHASE_BACKWARD), MEMTIDE_OK);
    memtide_free(act, 64 << 20, 0, nullptr);
    ASSERT_EQ(memtide_phase_mark(MEMTIDE_PHASE_UPDATE), MEMTIDE_OK);
  }
  std::uint64_t until_forward = 0;
  std::uint64_t until_update = 0;
  ASSERT_EQ(memtide_headroom(0, MEMTIDE_PHASE_FORWARD, &until_forward), MEMTIDE_OK);
  ASSERT_EQ(memtide_headroom(0, MEMTIDE_PHASE_UPDATE, &until_update), MEMTIDE_OK);
  // Held through the next forward, a loan must leave room for 64 MiB of activations.
  EXPECT_EQ(until_forward - until_update, std::uint64_t{64} << 20);
  EXPECT_EQ(memtide_headroom(0, MEMTIDE_PHASE_FORWARD, nullptr), MEMTIDE_INVALID_ARGUMENT);
}

TEST(CApi, HooksForTorch) {
  memtide_init(1);
  void* p = memtide_malloc(12 << 20, 0, nullptr);
  memtide_free(p, 12 << 20, 0, nullptr);
  EXPECT_GT(stat("reserved_bytes.all.current"), 0);
  memtide_empty_cache();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0);
  memtide_set_memory_fraction(0.5, 0);
  EXPECT_EQ(memtide_malloc(std::size_t{600} << 20, 0, nullptr), nullptr);  // over half of 1 GiB
  memtide_set_memory_fraction(1.0, 0);
  void* q = memtide_malloc(600 << 20, 0, nullptr);
  EXPECT_NE(q, nullptr) << memtide_last_error();
  memtide_record_stream(q, nullptr);
  memtide_free(q, 600 << 20, 0, nullptr);
  ASSERT_EQ(memtide_reset_peak_stats(0), MEMTIDE_OK);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 0);
}

TEST(CApi, DumpSnapshotWritesAPickle) {
  ASSERT_EQ(memtide_record_history(1), MEMTIDE_OK);
  void* p = memtide_malloc(5000, 0, nullptr);
  const std::string path = ::testing::TempDir() + "memtide_capi_snapshot.pickle";
  ASSERT_EQ(memtide_dump_snapshot(path.c_str()), MEMTIDE_OK) << memtide_last_error();
  memtide_free(p, 5000, 0, nullptr);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 20u);
  EXPECT_EQ(static_cast<unsigned char>(bytes[0]), 0x80);
  EXPECT_EQ(bytes.back(), '.');
  std::remove(path.c_str());
}

TEST(CApi, AdamwStepCpuFirstStepAndSkipOnOverflow) {
  float param[3] = {1.0f, 1.0f, 1.0f};
  float m[3] = {0, 0, 0};
  float v[3] = {0, 0, 0};
  float grad[3] = {0.5f, 0.5f, 0.5f};
  memtide_adamw_args_t a{};
  a.param = param;
  a.exp_avg = m;
  a.exp_avg_sq = v;
  a.grad = grad;
  a.n = 3;
  a.grad_dtype = MEMTIDE_DTYPE_FP32;
  a.param_out_dtype = MEMTIDE_DTYPE_NONE;
  a.lr = 0.1;
  a.beta1 = 0.9;
  a.beta2 = 0.999;
  a.eps = 1e-8;
  a.step = 1;
  a.grad_scale = 1.0;
  a.clip = 1.0;
  a.skip_if_nonfinite = 1;
  int nonfinite = -1;
  ASSERT_EQ(memtide_adamw_step_cpu(&a, &nonfinite), MEMTIDE_OK) << memtide_last_error();
  EXPECT_EQ(nonfinite, 0);
  // Step 1: m_hat = g and v_hat = g*g, so the update is lr * g / (|g| + eps) = 0.1.
  EXPECT_NEAR(param[1], 0.9f, 1e-6f);
  EXPECT_NEAR(m[0], 0.05f, 1e-7f);
  EXPECT_NEAR(v[2], 0.00025f, 1e-9f);

  grad[1] = std::numeric_limits<float>::quiet_NaN();
  a.step = 2;
  const float before = param[0];
  ASSERT_EQ(memtide_adamw_step_cpu(&a, &nonfinite), MEMTIDE_OK);
  EXPECT_EQ(nonfinite, 1);
  EXPECT_EQ(param[0], before) << "a skipped step must leave the state untouched";
  int finite = -1;
  ASSERT_EQ(memtide_grads_finite_cpu(grad, MEMTIDE_DTYPE_FP32, 3, 1.0, 1.0, &finite), MEMTIDE_OK);
  EXPECT_EQ(finite, 0);

  a.param = nullptr;
  EXPECT_EQ(memtide_adamw_step_cpu(&a, &nonfinite), MEMTIDE_INVALID_ARGUMENT);
  a.param = param;
  a.grad_dtype = static_cast<memtide_dtype_t>(std::atoi("7"));
  EXPECT_EQ(memtide_adamw_step_cpu(&a, &nonfinite), MEMTIDE_INVALID_ARGUMENT);
  EXPECT_NE(memtide_cpu_isa(), nullptr);
}

TEST(CApi, PinnedHostAllocAndFree) {
  auto* p = static_cast<unsigned char*>(memtide_host_alloc(3000, 0));
  ASSERT_NE(p, nullptr) << memtide_last_error();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
  p[0] = 1;
  p[2999] = 2;
  auto* q = static_cast<unsigned char*>(memtide_host_alloc(3000, 0));
  ASSERT_NE(q, nullptr) << memtide_last_error();
  EXPECT_TRUE(q >= p + 3000 || q + 3000 <= p);
  EXPECT_EQ(memtide_host_free(p), MEMTIDE_OK) << memtide_last_error();
  EXPECT_EQ(memtide_host_free(p), MEMTIDE_INVALID_ARGUMENT);
  EXPECT_NE(std::string(memtide_last_error()).find("not a live pinned host buffer"), std::string::npos);
  EXPECT_EQ(memtide_host_free(q), MEMTIDE_OK);
  EXPECT_EQ(memtide_host_free(nullptr), MEMTIDE_OK);
  int local = 0;
  EXPECT_EQ(memtide_host_free(&local), MEMTIDE_INVALID_ARGUMENT);

  EXPECT_EQ(memtide_host_alloc(0, 0), nullptr);
  EXPECT_NE(std::string(memtide_last_error()).find("zero bytes"), std::string::npos);
  EXPECT_EQ(memtide_host_alloc(64, 5), nullptr);
  EXPECT_NE(std::string(memtide_last_error()).find("out of range"), std::string::npos);
  // MEMTIDE_HOST_MAX_BYTES (set in main) caps the arena.
  EXPECT_EQ(memtide_host_alloc(std::size_t{64} << 20, 0), nullptr);
  EXPECT_NE(std::string(memtide_last_error()).find("host_max_bytes"), std::string::npos) << memtide_last_error();
}

int main(int argc, char** argv) {
  // Before the first memtide call: the runtime reads its options once.
  setenv("MEMTIDE_DEVICE", "sim", 1);
  setenv("MEMTIDE_SIM_CAPACITY", "1GiB", 1);
  setenv("MEMTIDE_HEADROOM_MARGIN", "0", 1);
  setenv("MEMTIDE_LOG_LEVEL", "error", 1);
  setenv("MEMTIDE_HOST_SLAB_SIZE", "4MiB", 1);
  setenv("MEMTIDE_HOST_MAX_BYTES", "32MiB", 1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
