#include "memtide/tiering/kernels/adamw_cpu.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/core/options.hpp"
#include "memtide/core/thread_pool.hpp"

using namespace memtide::tiering;

namespace {

std::vector<CpuIsa> available_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::scalar, CpuIsa::avx2, CpuIsa::avx512}) {
    if (cpu_isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

// One optimizer subgroup with `pad` leading elements, so data can start misaligned.
struct State {
  std::vector<float> p, m, v, g32;
  std::vector<std::uint16_t> g16, out;
  std::size_t pad = 0;

  State(std::size_t n, std::size_t pad_, std::uint32_t seed) : pad(pad_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    std::uniform_real_distribution<float> uni(0.0F, 1.0F);
    p.resize(n + pad);
    m.resize(n + pad);
    v.resize(n + pad);
    g32.resize(n + pad);
    g16.resize(n + pad);
    out.assign(n + pad, 0);
    for (std::size_t i = 0; i < n + pad; ++i) {
      p[i] = normal(rng);
      m[i] = 0.1F * normal(rng);
      v[i] = 0.01F * uni(rng);
      g32[i] = normal(rng) * 64.0F;  // scaled, as with a loss scale
    }
  }

  AdamwArgs args(std::size_t n, DType grad, DType out_dtype, bool l2) {
    AdamwArgs a;
    a.param = p.data() + pad;
    a.exp_avg = m.data() + pad;
    a.exp_avg_sq = v.data() + pad;
    a.grad_dtype = grad;
    if (grad == DType::fp32) {
      a.grad = g32.data() + pad;
    } else {
      for (std::size_t i = 0; i < g16.size(); ++i) g16[i] = grad == DType::fp16 ? fp32_to_fp16(g32[i]) : fp32_to_bf16(g32[i]);
      a.grad = g16.data() + pad;
    }
    a.param_out_dtype = out_dtype;
    a.param_out = out_dtype == DType::none ? nullptr : out.data() + pad;
    a.n = n;
    a.lr = 1e-3;
    a.weight_decay = 0.05;
    a.step = 7;
    a.grad_scale = 1.0 / 64.0;
    a.clip = 0.75;
    a.l2 = l2;
    return a;
  }

  bool operator==(const State& o) const {
    auto same = [](const auto& x, const auto& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
    };
    return same(p, o.p) && same(m, o.m) && same(v, o.v) && same(out, o.out);
  }
};

// The formula of adamw_cpu.hpp written out plainly, element by element.
void reference_step(const AdamwArgs& a, std::vector<float>& p, std::vector<float>& m, std::vector<float>& v,
                    const float* grad, std::size_t off) {
  const double bc1 = 1.0 - std::pow(a.beta1, static_cast<double>(a.step));
  const double bc2 = 1.0 - std::pow(a.beta2, static_cast<double>(a.step));
  const float neg_step = static_cast<float>(-(a.lr / bc1));
  const float inv_bc2s = static_cast<float>(1.0 / std::sqrt(bc2));
  for (std::size_t i = 0; i < a.n; ++i) {
    float g = grad[i] * static_cast<float>(a.grad_scale);
    g = g * static_cast<float>(a.clip);
    float& pp = p[off + i];
    if (a.l2) {
      g = std::fma(static_cast<float>(a.weight_decay), pp, g);
    } else {
      pp = pp * static_cast<float>(1.0 - a.lr * a.weight_decay);
    }
    float& mm = m[off + i];
    float& vv = v[off + i];
    mm = std::fma(static_cast<float>(1.0 - a.beta1), g - mm, mm);
    vv = vv * static_cast<float>(a.beta2);
    vv = vv + (static_cast<float>(1.0 - a.beta2) * g) * g;
    const float denom = std::sqrt(vv) * inv_bc2s + static_cast<float>(a.eps);
    pp = pp + (neg_step * mm) / denom;
  }
}

}  // namespace

TEST(AdamwCpu, ReportsIsa) {
  const std::string isa = adamw_isa();
  EXPECT_TRUE(isa == "scalar" || isa == "avx2" || isa == "avx512") << isa;
  std::printf("adamw_isa() = %s\n", isa.c_str());
}

TEST(AdamwCpu, EveryCombinationEveryPathBitwiseEqualToScalar) {
  ThreadPool pool(2);
  for (std::size_t n : {1U, 7U, 33U, 1000U, 3U * 16384U + 5U}) {
    for (std::size_t pad : {0U, 1U}) {
      for (DType g : {DType::fp32, DType::fp16, DType::bf16}) {
        for (DType o : {DType::none, DType::fp16, DType::bf16}) {
          for (bool l2 : {false, true}) {
            SCOPED_TRACE(std::to_string(n) + " pad " + std::to_string(pad) + " grad " + dtype_name(g) + " out " +
                         dtype_name(o) + (l2 ? " l2" : " adamw"));
            State ref(n, pad, 42);
            const AdamwArgs ra = ref.args(n, g, o, l2);
            // The plain formula, for the gradient as the kernel sees it.
            State plain(n, pad, 42);
            std::vector<float> gin(n);
            for (std::size_t i = 0; i < n; ++i) {
              gin[i] = g == DType::fp32   ? ref.g32[pad + i]
                       : g == DType::fp16 ? fp16_to_fp32(fp32_to_fp16(ref.g32[pad + i]))
                                          : bf16_to_fp32(fp32_to_bf16(ref.g32[pad + i]));
            }
            EXPECT_FALSE(adamw_step(ra, nullptr, CpuIsa::scalar));
            reference_step(ra, plain.p, plain.m, plain.v, gin.data(), pad);
            for (std::size_t i = 0; i < n; ++i) {
              ASSERT_EQ(std::bit_cast<std::uint32_t>(ref.p[pad + i]), std::bit_cast<std::uint32_t>(plain.p[pad + i])) << i;
              ASSERT_EQ(std::bit_cast<std::uint32_t>(ref.m[pad + i]), std::bit_cast<std::uint32_t>(plain.m[pad + i])) << i;
              ASSERT_EQ(std::bit_cast<std::uint32_t>(ref.v[pad + i]), std::bit_cast<std::uint32_t>(plain.v[pad + i])) << i;
              if (o == DType::fp16) {
                ASSERT_EQ(ref.out[pad + i], fp32_to_fp16(ref.p[pad + i])) << i;
              }
              if (o == DType::bf16) {
                ASSERT_EQ(ref.out[pad + i], fp32_to_bf16(ref.p[pad + i])) << i;
              }
            }
            if (pad == 1) {  // nothing before the first element was touched
              EXPECT_EQ(ref.out[0], 0);
            }
            for (CpuIsa isa : available_isas()) {
              State s(n, pad, 42);
              EXPECT_FALSE(adamw_step(s.args(n, g, o, l2), &pool, isa));
              EXPECT_TRUE(s == ref) << cpu_isa_name(isa);
            }
          }
        }
      }
    }
  }
}

TEST(AdamwCpu, LargeOddSize) {
  const std::size_t n = 1000003;
  ThreadPool pool(2);
  State ref(n, 1, 7);
  adamw_step(ref.args(n, DType::bf16, DType::fp16, false), nullptr, CpuIsa::scalar);
  for (CpuIsa isa : available_isas()) {
    State s(n, 1, 7);
    adamw_step(s.args(n, DType::bf16, DType::fp16, false), &pool, isa);
    EXPECT_TRUE(s == ref) << cpu_isa_name(isa);
  }
}

// Streaming (non-temporal) stores of the low-precision copy write the same bits as plain ones on
// every path, whatever the copy's alignment (the vector stores start after an unaligned head) and
// with a tail shorter than a vector.
TEST(AdamwCpu, StreamedCopyGivesTheSameBitsOnEveryPathAndAlignment) {
  ThreadPool pool(2);
  for (std::size_t pad : {0, 1, 3, 17}) {
    for (std::size_t n : {std::size_t{1}, std::size_t{37}, std::size_t{255}, 2 * kAdamwTile + 101}) {
      for (DType o : {DType::fp16, DType::bf16}) {
        State ref(n, pad, 11);
        auto ra = ref.args(n, DType::bf16, o, false);
        ra.out_stores = OutStores::cached;
        adamw_step(ra, nullptr, CpuIsa::scalar);
        for (CpuIsa isa : available_isas()) {
          SCOPED_TRACE(std::string(cpu_isa_name(isa)) + " " + dtype_name(o) + " n " + std::to_string(n) + " pad " +
                       std::to_string(pad));
          State s(n, pad, 11);
          auto sa = s.args(n, DType::bf16, o, false);
          sa.out_stores = OutStores::streaming;
          adamw_step(sa, &pool, isa);
          EXPECT_TRUE(s == ref);
        }
      }
    }
  }
}

TEST(AdamwCpu, OutStoresResolve) {
  EXPECT_EQ(resolve_out_stores(OutStores::cached, std::size_t{1} << 30), OutStores::cached);
  EXPECT_EQ(resolve_out_stores(OutStores::streaming, 1), OutStores::streaming);
  EXPECT_EQ(resolve_out_stores(OutStores::automatic, 1), OutStores::cached);  // in cache: keep it there
  EXPECT_EQ(resolve_out_stores(OutStores::automatic, std::size_t{1} << 30), OutStores::streaming);
  State s(8, 0, 1);
  auto a = s.args(8, DType::fp32, DType::fp16, false);
  a.out_stores = static_cast<OutStores>(7);
  EXPECT_THROW(adamw_step(a, nullptr), memtide::InvalidArgument);
}

// The gradient copy upcasts exactly (the reference conversions), on every path, either store
// kind and any alignment, and its verdict is the NaN/Inf scan's.
TEST(AdamwCpu, CopyGradUpcastsExactlyAndChecksFiniteness) {
  ThreadPool pool(2);
  const std::size_t n = 3 * kAdamwTile + 77;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  std::vector<float> g32(n + 4);
  for (float& x : g32) x = normal(rng);
  for (DType dt : {DType::fp32, DType::fp16, DType::bf16}) {
    std::vector<std::uint16_t> g16(n + 4);
    std::vector<float> want(n + 4);
    for (std::size_t i = 0; i < g32.size(); ++i) {
      g16[i] = dt == DType::fp16 ? fp32_to_fp16(g32[i]) : fp32_to_bf16(g32[i]);
      want[i] = dt == DType::fp32 ? g32[i] : dt == DType::fp16 ? fp16_to_fp32(g16[i]) : bf16_to_fp32(g16[i]);
    }
    for (CpuIsa isa : available_isas()) {
      for (OutStores st : {OutStores::cached, OutStores::streaming}) {
        for (std::size_t pad : {0, 1, 3}) {
          SCOPED_TRACE(std::string(cpu_isa_name(isa)) + " " + dtype_name(dt) + " pad " + std::to_string(pad) +
                       (st == OutStores::streaming ? " streaming" : " cached"));
          const void* src = dt == DType::fp32 ? static_cast<const void*>(g32.data() + pad) : g16.data() + pad;
          std::vector<float> dst(n + 4, -1.0F);
          EXPECT_TRUE(copy_grad(dst.data() + pad, src, dt, n, &pool, st, isa));
          EXPECT_EQ(std::memcmp(dst.data() + pad, want.data() + pad, n * 4), 0);
          EXPECT_EQ(dst[pad + n], -1.0F) << "wrote past the end";
          if (pad > 0) {
            EXPECT_EQ(dst[pad - 1], -1.0F) << "wrote before the start";
          }
        }
      }
      for (std::size_t where : {std::size_t{0}, n / 2, n - 1}) {
        std::vector<float> bad32(g32.begin(), g32.begin() + n);
        std::vector<std::uint16_t> bad16(g16.begin(), g16.begin() + n);
        bad32[where] = std::numeric_limits<float>::infinity();
        bad16[where] = dt == DType::fp16 ? 0x7E00 : 0x7FC0;  // NaN
        std::vector<float> dst(n);
        const void* src = dt == DType::fp32 ? static_cast<const void*>(bad32.data()) : bad16.data();
        for (OutStores st : {OutStores::cached, OutStores::streaming}) {
          EXPECT_FALSE(copy_grad(dst.data(), src, dt, n, &pool, st, isa)) << where;
          EXPECT_TRUE(std::isinf(dst[where]) || std::isnan(dst[where])) << where;
        }
      }
    }
  }
  std::vector<float> d(4);
  EXPECT_THROW(copy_grad(d.data(), nullptr, DType::fp32, 4, nullptr), memtide::InvalidArgument);
  EXPECT_THROW(copy_grad(d.data(), d.data(), DType::none, 4, nullptr), memtide::InvalidArgument);
  EXPECT_TRUE(copy_grad(nullptr, nullptr, DType::fp32, 0, nullptr));
}

// A gradient norm's square: exact upcasts summed in double, the same bits on one thread or many,
// and NaN/Inf carried through (the step protocol takes a non-finite norm as a non-finite gradient).
TEST(AdamwCpu, GradSquareSumIsExactAndThreadCountFree) {
  const std::size_t n = 3 * kAdamwTile + 77;  // several tiles and a ragged end
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0F, 3.0F);
  std::vector<float> g32(n);
  for (float& x : g32) x = normal(rng);
  ThreadPool pool(3);
  for (DType dt : {DType::fp32, DType::fp16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<std::uint16_t> g16(n);
    double want = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      g16[i] = dt == DType::fp16 ? fp32_to_fp16(g32[i]) : fp32_to_bf16(g32[i]);
      const double x = dt == DType::fp32 ? g32[i] : dt == DType::fp16 ? fp16_to_fp32(g16[i]) : bf16_to_fp32(g16[i]);
      want += x * x;
    }
    const void* src = dt == DType::fp32 ? static_cast<const void*>(g32.data()) : g16.data();
    const double one = grad_square_sum(src, dt, n, nullptr);
    EXPECT_NEAR(one, want, want * 1e-12);
    EXPECT_EQ(grad_square_sum(src, dt, n, &pool), one) << "the thread count changed the bits";
    std::vector<std::uint16_t> bad16 = g16;
    std::vector<float> bad32 = g32;
    bad32[n - 1] = std::numeric_limits<float>::infinity();
    bad16[n - 1] = dt == DType::fp16 ? 0x7E00 : 0x7FC0;  // NaN
    const void* bad = dt == DType::fp32 ? static_cast<const void*>(bad32.data()) : bad16.data();
    EXPECT_FALSE(std::isfinite(grad_square_sum(bad, dt, n, &pool)));
  }
  EXPECT_EQ(grad_square_sum(nullptr, DType::fp32, 0), 0.0);
  EXPECT_THROW((void)grad_square_sum(nullptr, DType::fp32, 4), memtide::InvalidArgument);
  EXPECT_THROW((void)grad_square_sum(g32.data(), DType::none, 4), memtide::InvalidArgument);
}

// Every tile is stepped exactly once whoever takes it (a share's owner or a thief): a tile run
// twice or never would change the bits. Pools larger than the tile count included.
TEST(AdamwCpu, ThreadCountsGiveIdenticalBits) {
  ThreadPool one(1), two(2), three(3), five(5);
  for (std::size_t n : {5 * kAdamwTile + 3, 2 * kAdamwTile + 1, 37 * kAdamwTile}) {
    SCOPED_TRACE(n);
    State a(n, 0, 3), b(n, 0, 3), c(n, 0, 3), d(n, 0, 3);
    for (int step = 1; step <= 3; ++step) {
      auto aa = a.args(n, DType::fp16, DType::bf16, false);
      auto ba = b.args(n, DType::fp16, DType::bf16, false);
      auto ca = c.args(n, DType::fp16, DType::bf16, false);
      auto da = d.args(n, DType::fp16, DType::bf16, false);
      aa.step = ba.step = ca.step = da.step = step;
      adamw_step(aa, &one);
      adamw_step(ba, &two);
      adamw_step(ca, &three);
      adamw_step(da, &five);
    }
    EXPECT_TRUE(a == b);
    EXPECT_TRUE(a == c);
    EXPECT_TRUE(a == d);
  }
}

// The step's tiles handed to another team of threads (torch's, through the bridge) give the
// bits the pool's own workers give, with that team narrower or wider than the pool.
namespace {
std::atomic<int> g_executor_jobs{0};
std::size_t g_executor_width = 2;
void executor_run(std::size_t n, void (*body)(void*, std::size_t), void* ctx) {
  g_executor_jobs.fetch_add(1);
  std::vector<std::thread> threads;
  for (std::size_t i = 1; i < n; ++i) threads.emplace_back([=] { body(ctx, i); });
  body(ctx, 0);
  for (std::thread& t : threads) t.join();
}
std::size_t executor_threads() { return g_executor_width; }
constexpr memtide::ParallelExecutor kExecutor{&executor_run, &executor_threads, "test"};
}  // namespace

TEST(AdamwCpu, ExecutorGivesIdenticalBits) {
  ThreadPool own(2), wide(5);
  const std::size_t n = 9 * kAdamwTile + 5;
  for (CpuIsa isa : available_isas()) {
    for (std::size_t width : {2U, 3U, 7U}) {
      SCOPED_TRACE(std::string(cpu_isa_name(isa)) + " width " + std::to_string(width));
      State a(n, 1, 5), b(n, 1, 5), c(n, 1, 5);
      for (int step = 1; step <= 3; ++step) {
        auto aa = a.args(n, DType::bf16, DType::bf16, false);
        aa.step = step;
        EXPECT_FALSE(adamw_step(aa, &own, isa));
        g_executor_width = width;
        g_executor_jobs = 0;
        const memtide::ParallelExecutor* before = memtide::set_parallel_executor(&kExecutor);
        auto ba = b.args(n, DType::bf16, DType::bf16, false);
        auto ca = c.args(n, DType::bf16, DType::bf16, false);
        ba.step = ca.step = step;
        EXPECT_FALSE(adamw_step(ba, &own, isa));
        EXPECT_FALSE(adamw_step(ca, &wide, isa));
        memtide::set_parallel_executor(before);
        EXPECT_EQ(g_executor_jobs.load(), 2) << "the step ran on the executor";
      }
      EXPECT_TRUE(a == b);
      EXPECT_TRUE(a == c);
    }
  }
}

TEST(AdamwCpu, NonFiniteGradientsAreReportedAndSkipped) {
  ThreadPool pool(2);
  const std::size_t n = 2 * kAdamwTile + 77;
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
  for (CpuIsa isa : available_isas()) {
    for (DType g : {DType::fp32, DType::fp16, DType::bf16}) {
      for (float bad : bad_values) {
        for (std::size_t where : {std::size_t{0}, n / 2, n - 1}) {
          SCOPED_TRACE(std::string(cpu_isa_name(isa)) + " " + dtype_name(g) + " at " + std::to_string(where));
          State s(n, 1, 9);
          s.g32[1 + where] = bad;
          const State before = s;
          AdamwArgs a = s.args(n, g, DType::fp16, false);
          EXPECT_FALSE(grads_finite(a.grad, g, n, a.grad_scale, a.clip, &pool, isa));
          a.skip_if_nonfinite = true;
          EXPECT_TRUE(adamw_step(a, &pool, isa));
          EXPECT_TRUE(s == before) << "skip must leave every buffer untouched";
          a.skip_if_nonfinite = false;
          EXPECT_TRUE(adamw_step(a, &pool, isa)) << "an unchecked step still reports the overflow";
        }
      }
      // Finite gradients that overflow only once scaled.
      State s(100, 0, 1);
      s.g32[50] = 60000.0F;
      AdamwArgs a = s.args(100, g, DType::none, false);
      EXPECT_TRUE(grads_finite(a.grad, g, 100, 1.0, 1.0, nullptr, isa));
      EXPECT_FALSE(grads_finite(a.grad, g, 100, 1e35, 1.0, nullptr, isa));
      a.grad_scale = 1e35;
      a.skip_if_nonfinite = true;
      EXPECT_TRUE(adamw_step(a, nullptr, isa));
    }
  }
}

TEST(AdamwCpu, Fp16AndBf16Conversions) {
  // Every fp16 / bf16 value converts to fp32 and back unchanged (NaNs stay NaN).
  for (std::uint32_t h = 0; h < 0x10000U; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const float f = fp16_to_fp32(x);
    if (std::isnan(f)) {
      EXPECT_EQ(fp32_to_fp16(f) & 0x7C00U, 0x7C00U);
      EXPECT_NE(fp32_to_fp16(f) & 0x03FFU, 0U);
    } else {
      ASSERT_EQ(fp32_to_fp16(f), x) << h;
    }
    const float b = bf16_to_fp32(x);
    if (!std::isnan(b)) {
      ASSERT_EQ(fp32_to_bf16(b), x) << h;
    }
  }
  EXPECT_EQ(fp16_to_fp32(0x3C00), 1.0F);
  EXPECT_EQ(fp16_to_fp32(0x0001), std::ldexp(1.0F, -24));
  EXPECT_EQ(fp16_to_fp32(0x7BFF), 65504.0F);
  // Round to nearest even, at the top of the range and below.
  EXPECT_EQ(fp32_to_fp16(65504.0F), 0x7BFF);
  EXPECT_EQ(fp32_to_fp16(65519.0F), 0x7BFF);
  EXPECT_EQ(fp32_to_fp16(65520.0F), 0x7C00);  // halfway to 65536: even is inf
  EXPECT_EQ(fp32_to_fp16(1e6F), 0x7C00);
  EXPECT_EQ(fp32_to_fp16(-1e6F), 0xFC00);
  EXPECT_EQ(fp32_to_fp16(1.0F + std::ldexp(1.0F, -11)), 0x3C00);  // tie -> even (down)
  EXPECT_EQ(fp32_to_fp16(1.0F + 3 * std::ldexp(1.0F, -11)), 0x3C02);  // tie -> even (up)
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.0F, -25)), 0x0000);  // tie between 0 and the smallest subnormal
  EXPECT_EQ(fp32_to_fp16(std::ldexp(1.5F, -25)), 0x0001);
  EXPECT_EQ(fp32_to_fp16(std::ldexp(3.0F, -25)), 0x0002);  // 1.5 subnormal ulps -> even
  EXPECT_EQ(fp32_to_fp16(-0.0F), 0x8000);
  EXPECT_EQ(fp32_to_bf16(1.0F + std::ldexp(1.0F, -8)), 0x3F80);  // tie -> even (down)
  EXPECT_EQ(fp32_to_bf16(1.0F + 3 * std::ldexp(1.0F, -8)), 0x3F82);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to inf
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
}

TEST(AdamwCpu, VectorConversionsMatchTheReferenceOnASweepOfBitPatterns) {
  // lr = 0 and no weight decay leave params unchanged, so param_out is just the conversion.
  std::vector<float> p;
  for (std::uint64_t u = 0; u < (1ULL << 32); u += 1021) p.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  for (float f : {65504.0F, 65519.0F, 65520.0F, 65536.0F, std::ldexp(1.0F, -25), std::ldexp(1.5F, -25), 0.0F, -0.0F}) {
    p.push_back(f);
    p.push_back(-f);
  }
  const std::size_t n = p.size();
  std::vector<float> m(n, 0.0F), v(n, 1.0F), g(n, 0.0F);
  for (CpuIsa isa : available_isas()) {
    for (DType o : {DType::fp16, DType::bf16}) {
      std::vector<float> pp = p, mm = m, vv = v;
      std::vector<std::uint16_t> out(n);
      AdamwArgs a;
      a.param = pp.data();
      a.exp_avg = mm.data();
      a.exp_avg_sq = vv.data();
      a.grad = g.data();
      a.param_out = out.data();
      a.param_out_dtype = o;
      a.n = n;
      a.lr = 0.0;
      a.weight_decay = 0.0;
      adamw_step(a, nullptr, isa);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t want = o == DType::fp16 ? fp32_to_fp16(p[i]) : fp32_to_bf16(p[i]);
        ASSERT_EQ(out[i], want) << cpu_isa_name(isa) << " " << dtype_name(o) << " bits 0x" << std::hex
                                << std::bit_cast<std::uint32_t>(p[i]);
      }
    }
  }
}

TEST(AdamwCpu, ValidatesArguments) {
  State s(10, 0, 1);
  AdamwArgs a = s.args(10, DType::fp32, DType::none, false);
  a.step = 0;
  EXPECT_THROW(adamw_step(a, nullptr), memtide::InvalidArgument);
  a = s.args(10, DType::fp32, DType::none, false);
  a.grad = nullptr;
  EXPECT_THROW(adamw_step(a, nullptr), memtide::InvalidArgument);
  a = s.args(10, DType::fp32, DType::none, false);
  a.param_out_dtype = DType::fp16;  // without a buffer
  EXPECT_THROW(adamw_step(a, nullptr), memtide::InvalidArgument);
  a = s.args(0, DType::fp32, DType::none, false);
  EXPECT_FALSE(adamw_step(a, nullptr));
  if (!cpu_isa_supported(CpuIsa::avx512)) {
    EXPECT_THROW(adamw_step(s.args(10, DType::fp32, DType::none, false), nullptr, CpuIsa::avx512), memtide::InvalidArgument);
  }
}

TEST(AdamwCpu, IsaOption) {
  const memtide::Options saved = memtide::options();
  memtide::Options o = saved;
  o.set("cpu_isa", "scalar");
  memtide::set_options(o);
  EXPECT_STREQ(adamw_isa(), "scalar");
  EXPECT_THROW(o.set("cpu_isa", "sse9"), memtide::ConfigError);
  memtide::set_options(saved);
}
