// The GPU optimizer kernels against the CPU step, bit for bit. Runs where a GPU answers; skipped
// with the reason elsewhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/device/device.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"
#include "memtide/tiering/kernels/cuda_kernels.hpp"

namespace {

using memtide::tiering::AdamwArgs;
using memtide::tiering::CpuIsa;
using memtide::tiering::DType;
namespace tc = memtide::tiering::cuda;

class AdamwCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    const memtide::CudaStatus s = memtide::cuda_status();
    if (!s.usable) GTEST_SKIP() << "no usable GPU: " << s.reason;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    for (void* p : owned_) cudaFree(p);
  }
  // Device copy of `bytes` bytes at a byte offset `skew` from a 256-byte aligned base.
  void* upload(const void* host, std::size_t bytes, std::size_t skew) {
    void* base = nullptr;
    EXPECT_EQ(cudaMalloc(&base, bytes + skew + 16), cudaSuccess);
    owned_.push_back(base);
    void* p = static_cast<unsigned char*>(base) + skew;
    EXPECT_EQ(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    return p;
  }
  static void download(void* host, const void* dev, std::size_t bytes) {
    ASSERT_EQ(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  cudaStream_t stream_ = nullptr;
  std::vector<void*> owned_;
};

std::size_t esize(DType d) { return d == DType::fp32 ? 4 : 2; }

std::vector<unsigned char> random_grads(DType d, std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0F, 1e-2F);
  std::vector<unsigned char> out(n * esize(d));
  for (std::size_t i = 0; i < n; ++i) {
    const float g = dist(rng);
    if (d == DType::fp32) {
      std::memcpy(out.data() + 4 * i, &g, 4);
    } else {
      const std::uint16_t h = d == DType::fp16 ? memtide::tiering::fp32_to_fp16(g) : memtide::tiering::fp32_to_bf16(g);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

struct Case {
  DType grad;
  DType out;
  bool l2;
  std::size_t n;
  std::size_t skew;  // elements added to every device pointer (0 = 16-byte aligned)
};

TEST_F(AdamwCuda, MatchesCpuBitwiseForEveryDtypeSizeAndAlignment) {
  std::mt19937 rng(7);
  std::vector<Case> cases;
  for (DType g : {DType::fp32, DType::fp16, DType::bf16}) {
    for (DType o : {DType::none, DType::fp16, DType::bf16}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{65537}}) {
        for (std::size_t skew : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{3}}) {
          cases.push_back({g, o, n % 2 == 1 && skew == 1, n, skew});
        }
      }
    }
  }
  for (const Case& c : cases) {
    SCOPED_TRACE("grad " + std::to_string(int(c.grad)) + " out " + std::to_string(int(c.out)) + " n " +
                 std::to_string(c.n) + " skew " + std::to_string(c.skew) + " l2 " + std::to_string(c.l2));
    std::uniform_real_distribution<float> u(-1.0F, 1.0F);
    std::vector<float> p(c.n), m(c.n), v(c.n);
    for (std::size_t i = 0; i < c.n; ++i) {
      p[i] = u(rng);
      m[i] = u(rng) * 1e-3F;
      v[i] = std::fabs(u(rng)) * 1e-5F;
    }
    const std::vector<unsigned char> g = random_grads(c.grad, c.n, rng);
    // Device copies first (the CPU step below updates p, m, v in place). A skew is in elements:
    // a GPU load must be aligned to its element, and an array at a torch tensor's address is.
    auto* dp = static_cast<float*>(upload(p.data(), 4 * c.n, 4 * c.skew));
    auto* dm = static_cast<float*>(upload(m.data(), 4 * c.n, 4 * c.skew));
    auto* dv = static_cast<float*>(upload(v.data(), 4 * c.n, 4 * c.skew));
    void* dg = upload(g.data(), g.size(), esize(c.grad) * c.skew);
    std::vector<std::uint16_t> out_cpu(c.n), out_gpu(c.n);
    void* dout = c.out == DType::none ? nullptr : upload(out_cpu.data(), 2 * c.n, 2 * c.skew);

    AdamwArgs a;
    a.n = c.n;
    a.grad_dtype = c.grad;
    a.param_out_dtype = c.out;
    a.lr = 1e-3;
    a.weight_decay = 0.01;
    a.step = 3;
    a.grad_scale = 0.5;
    a.clip = 0.75;
    a.l2 = c.l2;
    AdamwArgs cpu = a;
    cpu.param = p.data();
    cpu.exp_avg = m.data();
    cpu.exp_avg_sq = v.data();
    cpu.grad = g.data();
    cpu.param_out = c.out == DType::none ? nullptr : out_cpu.data();
    ASSERT_FALSE(memtide::tiering::adamw_step(cpu, nullptr, CpuIsa::scalar));

    AdamwArgs gpu = a;
    gpu.param = dp;
    gpu.exp_avg = dm;
    gpu.exp_avg_sq = dv;
    gpu.grad = dg;
    gpu.param_out = dout;
    tc::adamw_step(stream_, gpu);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);

    std::vector<float> p2(c.n), m2(c.n), v2(c.n);
    download(p2.data(), dp, 4 * c.n);
    download(m2.data(), dm, 4 * c.n);
    download(v2.data(), dv, 4 * c.n);
    EXPECT_EQ(std::memcmp(p.data(), p2.data(), 4 * c.n), 0);
    EXPECT_EQ(std::memcmp(m.data(), m2.data(), 4 * c.n), 0);
    EXPECT_EQ(std::memcmp(v.data(), v2.data(), 4 * c.n), 0);
    if (c.out != DType::none) {
      download(out_gpu.data(), dout, 2 * c.n);
      EXPECT_EQ(out_cpu, out_gpu);
    }
  }
}

TEST_F(AdamwCuda, NonFiniteGradientSetsTheFlagAndSkipFlagLeavesStateUntouched) {
  const std::size_t n = 4099;
  std::vector<float> p(n, 1.0F), m(n, 0.0F), v(n, 0.0F), g(n, 0.01F);
  g[n - 2] = std::numeric_limits<float>::infinity();
  auto* dp = static_cast<float*>(upload(p.data(), 4 * n, 0));
  auto* dm = static_cast<float*>(upload(m.data(), 4 * n, 0));
  auto* dv = static_cast<float*>(upload(v.data(), 4 * n, 0));
  void* dg = upload(g.data(), 4 * n, 0);
  const unsigned zero = 0;
  auto* flag = static_cast<unsigned*>(upload(&zero, sizeof zero, 0));

  tc::grads_nonfinite(stream_, dg, DType::fp32, n, 1.0, 1.0, flag);
  AdamwArgs a;
  a.param = dp;
  a.exp_avg = dm;
  a.exp_avg_sq = dv;
  a.grad = dg;
  a.n = n;
  tc::adamw_step(stream_, a, nullptr, flag);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  unsigned seen = 0;
  download(&seen, flag, sizeof seen);
  EXPECT_EQ(seen, 1U);
  std::vector<float> p2(n);
  download(p2.data(), dp, 4 * n);
  EXPECT_EQ(p, p2);

  // Finite gradients: the flag stays clear and the step runs.
  g[n - 2] = 0.01F;
  ASSERT_EQ(cudaMemcpy(dg, g.data(), 4 * n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(flag, &zero, sizeof zero, cudaMemcpyHostToDevice), cudaSuccess);
  tc::grads_nonfinite(stream_, dg, DType::fp32, n, 1.0, 1.0, flag);
  tc::adamw_step(stream_, a, nullptr, flag);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  download(&seen, flag, sizeof seen);
  EXPECT_EQ(seen, 0U);
  download(p2.data(), dp, 4 * n);
  EXPECT_NE(p, p2);
}

TEST_F(AdamwCuda, ConvertRoundsLikeTheCpuReference) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-70000.0F, 70000.0F);
  for (std::size_t n : {std::size_t{5}, std::size_t{4096}, std::size_t{10001}}) {
    for (std::size_t skew : {std::size_t{0}, std::size_t{2}}) {
      std::vector<float> x(n);
      for (float& f : x) f = u(rng) * (rng() % 2 == 0 ? 1e-6F : 1.0F);
      x[0] = std::numeric_limits<float>::quiet_NaN();
      const float* dx = static_cast<const float*>(upload(x.data(), 4 * n, skew * 2));
      for (DType d : {DType::fp16, DType::bf16}) {
        std::vector<std::uint16_t> want(n), got(n);
        for (std::size_t i = 0; i < n; ++i) {
          want[i] = d == DType::fp16 ? memtide::tiering::fp32_to_fp16(x[i]) : memtide::tiering::fp32_to_bf16(x[i]);
        }
        void* dh = upload(got.data(), 2 * n, skew);
        tc::convert(stream_, dh, d, dx, DType::fp32, n);
        // And back up, unscaled by 0.25: exact conversion followed by one rounding multiply.
        auto* dback = static_cast<float*>(upload(x.data(), 4 * n, skew * 2));
        tc::convert(stream_, dback, DType::fp32, dh, d, n, 0.25);
        ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
        download(got.data(), dh, 2 * n);
        EXPECT_EQ(want, got);
        std::vector<float> back(n);
        download(back.data(), dback, 4 * n);
        for (std::size_t i = 1; i < n; ++i) {
          const float up = d == DType::fp16 ? memtide::tiering::fp16_to_fp32(want[i]) : memtide::tiering::bf16_to_fp32(want[i]);
          ASSERT_EQ(back[i], up * 0.25F) << "element " << i;
        }
        EXPECT_TRUE(std::isnan(back[0]));
      }
    }
  }
}

// Arguments are checked before any CUDA call, so this runs without a GPU too.
TEST(AdamwCudaArgs, RejectsBadArgumentsBeforeTouchingTheGpu) {
  AdamwArgs a;
  a.n = 10;  // null pointers
  EXPECT_THROW(tc::adamw_step(nullptr, a), memtide::InvalidArgument);
  float x = 0;
  a.param = a.exp_avg = a.exp_avg_sq = &x;
  a.grad = &x;
  a.skip_if_nonfinite = true;  // needs a device flag instead
  EXPECT_THROW(tc::adamw_step(nullptr, a), memtide::InvalidArgument);
  EXPECT_THROW(tc::convert(nullptr, nullptr, DType::fp32, &x, DType::fp16, 4), memtide::InvalidArgument);
  EXPECT_THROW(tc::convert(nullptr, &x, DType::none, &x, DType::fp16, 4), memtide::InvalidArgument);
  EXPECT_THROW(tc::grads_nonfinite(nullptr, &x, DType::fp32, 4, 1.0, 1.0, nullptr), memtide::InvalidArgument);
  // An element off its alignment is refused, naming the array, before it reaches a kernel.
  alignas(16) unsigned char raw[64] = {};
  a.skip_if_nonfinite = false;
  a.param = reinterpret_cast<float*>(raw + 2);
  try {
    tc::adamw_step(nullptr, a);
    ADD_FAILURE() << "a param 2 bytes off its float alignment was accepted";
  } catch (const memtide::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("param is not aligned"), std::string::npos) << e.what();
  }
  a.param = &x;
  a.grad = raw + 1;
  a.grad_dtype = DType::bf16;
  EXPECT_THROW(tc::adamw_step(nullptr, a), memtide::InvalidArgument);
  EXPECT_THROW(tc::grads_nonfinite(nullptr, raw + 1, DType::fp16, 4, 1.0, 1.0, reinterpret_cast<unsigned*>(raw + 16)), memtide::InvalidArgument);
  EXPECT_THROW(tc::convert(nullptr, raw + 2, DType::fp32, raw, DType::fp16, 4), memtide::InvalidArgument);
}

}  // namespace
