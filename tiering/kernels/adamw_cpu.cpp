// Dispatch, validation and threading of the fused AdamW step; the loops are in adamw_impl.hpp.

#include "memtide/tiering/kernels/adamw_cpu.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "adamw_impl.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/options.hpp"
#include "memtide/core/os.hpp"
#include "memtide/core/thread_pool.hpp"

namespace memtide::tiering {
namespace detail {

bool adamw_range_scalar(const AdamwArgs&, const AdamwConsts&, std::size_t, std::size_t);
bool nonfinite_range_scalar(const void*, DType, float, float, std::size_t, std::size_t);
bool copy_grad_range_scalar(float*, const void*, DType, bool, std::size_t, std::size_t);
#if defined(MEMTIDE_TIERING_X86)
bool adamw_range_avx2(const AdamwArgs&, const AdamwConsts&, std::size_t, std::size_t);
bool nonfinite_range_avx2(const void*, DType, float, float, std::size_t, std::size_t);
bool adamw_range_avx512(const AdamwArgs&, const AdamwConsts&, std::size_t, std::size_t);
bool nonfinite_range_avx512(const void*, DType, float, float, std::size_t, std::size_t);
bool copy_grad_range_avx2(float*, const void*, DType, bool, std::size_t, std::size_t);
bool copy_grad_range_avx512(float*, const void*, DType, bool, std::size_t, std::size_t);
#endif

}  // namespace detail

namespace {

using RangeFn = bool (*)(const AdamwArgs&, const detail::AdamwConsts&, std::size_t, std::size_t);
using CheckFn = bool (*)(const void*, DType, float, float, std::size_t, std::size_t);
using CopyFn = bool (*)(float*, const void*, DType, bool, std::size_t, std::size_t);

struct Kernels {
  RangeFn step;
  CheckFn check;
  CopyFn copy;
};

Kernels kernels(CpuIsa isa) {
  switch (isa) {
#if defined(MEMTIDE_TIERING_X86)
    case CpuIsa::avx2:
      return {&detail::adamw_range_avx2, &detail::nonfinite_range_avx2, &detail::copy_grad_range_avx2};
    case CpuIsa::avx512:
      return {&detail::adamw_range_avx512, &detail::nonfinite_range_avx512, &detail::copy_grad_range_avx512};
#endif
    default: return {&detail::adamw_range_scalar, &detail::nonfinite_range_scalar, &detail::copy_grad_range_scalar};
  }
}

CpuIsa parse_isa(const std::string& name) {
  if (name == "scalar") return CpuIsa::scalar;
  if (name == "avx2") return CpuIsa::avx2;
  if (name == "avx512") return CpuIsa::avx512;
  return CpuIsa::automatic;
}

CpuIsa best_isa() noexcept {
  if (cpu_isa_supported(CpuIsa::avx512)) return CpuIsa::avx512;
  if (cpu_isa_supported(CpuIsa::avx2)) return CpuIsa::avx2;
  return CpuIsa::scalar;
}

std::size_t tiles(std::size_t n) { return (n + kAdamwTile - 1) / kAdamwTile; }

// One participant's tiles [front, back), packed in one word so that the owner (from the front)
// and a thief (from the back) never take the same tile.
class TileShare {
 public:
  void reset(std::size_t front, std::size_t back) noexcept {
    range_.store(pack(front, back), std::memory_order_relaxed);
  }
  bool take_front(std::size_t& tile) noexcept { return take(tile, true); }
  bool take_back(std::size_t& tile) noexcept { return take(tile, false); }

 private:
  static std::uint64_t pack(std::uint64_t front, std::uint64_t back) noexcept { return back << 32 | front; }
  bool take(std::size_t& tile, bool from_front) noexcept {
    std::uint64_t r = range_.load(std::memory_order_relaxed);
    for (;;) {
      const std::uint64_t front = r & 0xffffffffu, back = r >> 32;
      if (front >= back) return false;
      const std::uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (range_.compare_exchange_weak(r, next, std::memory_order_relaxed)) {
        tile = static_cast<std::size_t>(from_front ? front : back - 1);
        return true;
      }
    }
  }
  std::atomic<std::uint64_t> range_{0};
};

// Runs body(begin, end) over tiles, on the pool when there is one; ORs the results. Each
// participant walks its own contiguous share front to back (one long stream per array for the
// prefetchers and the DRAM pages), then takes tiles from the back of the others' shares; a
// worker whose wake-up comes after the caller took everything is not waited for (a team). A
// fixed split left the caller waiting for a worker that takes a futex wake-up (tens of
// microseconds on a VM) to start: a tenth of the step at 1M params; tiles claimed one by one
// in turn cost a quarter of the bandwidth at 16M (every tile a new stream).
template <typename Body>
bool over_tiles(std::size_t n, ThreadPool* pool, Body&& body) {
  if (pool == nullptr || pool->size() == 1 || n <= kAdamwTile) return n != 0 && body(std::size_t{0}, n);
  const std::size_t count = tiles(n);
  const std::size_t parts = std::min(pool->size(), count);
  std::atomic<bool> any{false};
  auto run = [&](std::size_t t) {
    const std::size_t begin = t * kAdamwTile;
    if (body(begin, std::min(begin + kAdamwTile, n))) any.store(true, std::memory_order_relaxed);
  };
  constexpr std::size_t kMaxParts = 256;
  if (count > 0xffffffffu || parts > kMaxParts) {  // beyond what a share packs: fixed shares
    pool->parallel_for(count, run);
    return any.load(std::memory_order_relaxed);
  }
  TileShare shares[kMaxParts];
  for (std::size_t p = 0; p < parts; ++p) shares[p].reset(p * count / parts, (p + 1) * count / parts);
  pool->parallel_team(parts, [&](std::size_t me) {
    std::size_t t = 0;
    while (shares[me].take_front(t)) run(t);
    for (std::size_t k = 1; k < parts; ++k) {
      TileShare& other = shares[(me + k) % parts];
      while (other.take_back(t)) run(t);
    }
  });
  return any.load(std::memory_order_relaxed);
}

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument("adamw_step: " + message);
}

}  // namespace

namespace detail {

void validate_adamw_args(const AdamwArgs& a) {
  if (a.n == 0) return;
  require(a.param != nullptr && a.exp_avg != nullptr && a.exp_avg_sq != nullptr && a.grad != nullptr,
          "param, exp_avg, exp_avg_sq and grad must not be null");
  require(a.grad_dtype == DType::fp32 || a.grad_dtype == DType::fp16 || a.grad_dtype == DType::bf16,
          "grad dtype must be fp32, fp16 or bf16");
  require(a.param_out_dtype == DType::none || a.param_out_dtype == DType::fp16 || a.param_out_dtype == DType::bf16,
          "param_out dtype must be none, fp16 or bf16");
  require((a.param_out_dtype == DType::none) == (a.param_out == nullptr),
          "param_out and param_out_dtype must be given together");
  require(a.step >= 1, "step must be >= 1, got " + std::to_string(a.step));
  require(a.lr >= 0.0 && std::isfinite(a.lr), "lr must be finite and >= 0");
  require(a.beta1 >= 0.0 && a.beta1 < 1.0, "beta1 must be in [0, 1)");
  require(a.beta2 >= 0.0 && a.beta2 < 1.0, "beta2 must be in [0, 1)");
  require(a.eps >= 0.0 && std::isfinite(a.eps), "eps must be finite and >= 0");
  require(a.weight_decay >= 0.0 && std::isfinite(a.weight_decay), "weight_decay must be finite and >= 0");
  require(std::isfinite(a.grad_scale) && std::isfinite(a.clip), "grad_scale and clip must be finite");
  require(a.out_stores == OutStores::automatic || a.out_stores == OutStores::cached ||
              a.out_stores == OutStores::streaming,
          "out_stores must be automatic, cached or streaming, got " + std::to_string(static_cast<int>(a.out_stores)));
}

// The step's scalars, computed in double like torch's Python code and rounded to float once.
AdamwConsts adamw_consts(const AdamwArgs& a) {
  const double step = static_cast<double>(a.step);
  const double bc1 = 1.0 - std::pow(a.beta1, step);
  const double bc2 = 1.0 - std::pow(a.beta2, step);
  const double step_size = a.lr / bc1;
  AdamwConsts c{};
  c.grad_scale = static_cast<float>(a.grad_scale);
  c.clip = static_cast<float>(a.clip);
  c.decay = static_cast<float>(1.0 - a.lr * a.weight_decay);
  c.wd = static_cast<float>(a.weight_decay);
  c.w1 = static_cast<float>(1.0 - a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(a.eps);
  c.neg_step = static_cast<float>(-step_size);
  return c;
}

}  // namespace detail

bool cpu_isa_supported(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::automatic:
    case CpuIsa::scalar: return true;
#if defined(MEMTIDE_TIERING_X86)
    case CpuIsa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case CpuIsa::avx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
    default: return false;
  }
}

const char* cpu_isa_name(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::scalar: return "scalar";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    default: return "auto";
  }
}

const char* dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::fp32: return "fp32";
    case DType::fp16: return "fp16";
    case DType::bf16: return "bf16";
    default: return "none";
  }
}

CpuIsa resolve_cpu_isa(CpuIsa isa) {
  if (isa == CpuIsa::automatic) {
    const std::string& wanted = options().cpu_isa;
    isa = parse_isa(wanted);
    if (isa == CpuIsa::automatic) return best_isa();
    if (!cpu_isa_supported(isa)) {
      throw ConfigError("MEMTIDE_CPU_ISA=\"" + wanted + "\" is not supported by this CPU; use auto or one of: scalar" +
                        (cpu_isa_supported(CpuIsa::avx2) ? ", avx2" : ""));
    }
    return isa;
  }
  if (!cpu_isa_supported(isa)) throw InvalidArgument(std::string("CPU path ") + cpu_isa_name(isa) + " is not supported here");
  return isa;
}

const char* adamw_isa() { return cpu_isa_name(resolve_cpu_isa(CpuIsa::automatic)); }

OutStores resolve_out_stores(OutStores how, std::size_t n) noexcept {
  if (how != OutStores::automatic) return how;
  // Streaming pays when the copy would be evicted before anyone reads it: the step's streams
  // (28 B/param at most) are larger than the last-level cache.
  static const std::size_t llc = [] {
    const std::size_t bytes = os::last_level_cache_bytes();
    return bytes > 0 ? bytes : std::size_t{32} << 20;
  }();
  return n * 28 > llc ? OutStores::streaming : OutStores::cached;
}

bool adamw_step(const AdamwArgs& given, ThreadPool* pool, CpuIsa isa) {
  detail::validate_adamw_args(given);
  const Kernels k = kernels(resolve_cpu_isa(isa));
  if (given.n == 0) return false;
  AdamwArgs args = given;
  args.out_stores = resolve_out_stores(given.out_stores, given.n);
  const detail::AdamwConsts c = detail::adamw_consts(args);
  if (args.skip_if_nonfinite) {
    const bool bad = over_tiles(args.n, pool, [&](std::size_t b, std::size_t e) {
      return k.check(args.grad, args.grad_dtype, c.grad_scale, c.clip, b, e);
    });
    if (bad) return true;
  }
  return over_tiles(args.n, pool, [&](std::size_t b, std::size_t e) { return k.step(args, c, b, e); });
}

bool grads_finite(const void* grad, DType dtype, std::size_t n, double grad_scale, double clip, ThreadPool* pool,
                  CpuIsa isa) {
  if (n == 0) return true;
  if (grad == nullptr) throw InvalidArgument("grads_finite: grad must not be null");
  if (dtype != DType::fp32 && dtype != DType::fp16 && dtype != DType::bf16) {
    throw InvalidArgument("grads_finite: dtype must be fp32, fp16 or bf16");
  }
  const Kernels k = kernels(resolve_cpu_isa(isa));
  const float gs = static_cast<float>(grad_scale), cl = static_cast<float>(clip);
  return !over_tiles(n, pool, [&](std::size_t b, std::size_t e) { return k.check(grad, dtype, gs, cl, b, e); });
}

bool copy_grad(float* dst, const void* src, DType dtype, std::size_t n, ThreadPool* pool, OutStores stores,
               CpuIsa isa) {
  if (n == 0) return true;
  if (dst == nullptr || src == nullptr) {
    throw InvalidArgument("copy_grad: dst and src must not be null for n = " + std::to_string(n));
  }
  if (dtype != DType::fp32 && dtype != DType::fp16 && dtype != DType::bf16) {
    throw InvalidArgument(std::string("copy_grad: the gradient must be fp32, fp16 or bf16, got ") + dtype_name(dtype));
  }
  if (stores != OutStores::automatic && stores != OutStores::cached && stores != OutStores::streaming) {
    throw InvalidArgument("copy_grad: stores must be automatic, cached or streaming, got " +
                          std::to_string(static_cast<int>(stores)));
  }
  const Kernels k = kernels(resolve_cpu_isa(isa));
  const bool stream = resolve_out_stores(stores, n) == OutStores::streaming;
  // over_tiles ORs "something happened": here that is a non-finite element.
  return !over_tiles(n, pool, [&](std::size_t b, std::size_t e) { return !k.copy(dst, src, dtype, stream, b, e); });
}

double grad_square_sum(const void* grad, DType dtype, std::size_t n, ThreadPool* pool) {
  if (n == 0) return 0.0;
  if (grad == nullptr) throw InvalidArgument("grad_square_sum: grad must not be null for n = " + std::to_string(n));
  if (dtype != DType::fp32 && dtype != DType::fp16 && dtype != DType::bf16) {
    throw InvalidArgument(std::string("grad_square_sum: the gradient must be fp32, fp16 or bf16, got ") +
                          dtype_name(dtype));
  }
  // Eight running sums, each its own chain: the compiler may pack them into vectors without
  // reassociating anything, and the order of every addition is fixed.
  auto tile = [&](std::size_t b, std::size_t e) {
    constexpr std::size_t kLanes = 8;
    double acc[kLanes] = {};
    auto load = [&](std::size_t i) -> double {
      switch (dtype) {
        case DType::fp16: return fp16_to_f(static_cast<const std::uint16_t*>(grad)[i]);
        case DType::bf16: return bf16_to_f(static_cast<const std::uint16_t*>(grad)[i]);
        default: return static_cast<const float*>(grad)[i];
      }
    };
    std::size_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
      for (std::size_t j = 0; j < kLanes; ++j) {
        const double x = load(i + j);
        acc[j] += x * x;
      }
    }
    for (std::size_t j = 0; i < e; ++i, ++j) {
      const double x = load(i);
      acc[j] += x * x;
    }
    double s = 0.0;
    for (double a : acc) s += a;
    return s;
  };
  const std::size_t count = tiles(n);
  std::vector<double> sums(count, 0.0);
  auto run = [&](std::size_t t) { sums[t] = tile(t * kAdamwTile, std::min((t + 1) * kAdamwTile, n)); };
  if (pool == nullptr || pool->size() == 1 || count == 1) {
    for (std::size_t t = 0; t < count; ++t) run(t);
  } else {
    pool->parallel_for(count, run);
  }
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

std::uint16_t fp32_to_fp16(float f) noexcept { return f_to_fp16(f); }
std::uint16_t fp32_to_bf16(float f) noexcept { return f_to_bf16(f); }
float fp16_to_fp32(std::uint16_t h) noexcept { return fp16_to_f(h); }
float bf16_to_fp32(std::uint16_t b) noexcept { return bf16_to_f(b); }

}  // namespace memtide::tiering
