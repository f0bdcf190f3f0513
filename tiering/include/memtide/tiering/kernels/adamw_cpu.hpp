#pragma once
/// @file
/// Fused CPU AdamW/Adam step: one pass over a subgroup reads the gradient (fp32, fp16 or bf16),
/// unscales and clips it, updates fp32 params, exp_avg and exp_avg_sq in place, and writes an
/// optional fp16/bf16 copy of the new params (round to nearest even) for the GPU.
///
/// The arithmetic follows torch.optim.AdamW's single-tensor path operation by operation, in fp32,
/// with the per-step scalars computed in double and rounded to float once, as torch does:
///
///   g  = (grad * grad_scale) * clip
///   p  = p * (1 - lr*wd)   (AdamW)   or   g = fma(wd, p, g)   (L2 / Adam: grad.add(p, alpha=wd))
///   m  = fma(1-beta1, g - m, m)                           (exp_avg.lerp_, fused as in torch)
///   v  = v * beta2;  v = v + ((1-beta2) * g) * g          (mul_, addcmul_)
///   d  = sqrt(v) * (1 / sqrt(1 - beta2^step)) + eps
///   p  = p + (-(lr / (1 - beta1^step)) * m) / d           (addcdiv_)
///
/// One departure from torch: torch divides sqrt(v) by sqrt(1 - beta2^step); memtide multiplies by
/// its reciprocal (rounded once). The divider is the bottleneck of this loop on AVX-512 cores
/// (a 512-bit divide or square root issues only every ~10 cycles), and dropping one of the two
/// divides made the in-cache step 1.3x faster; d then differs from torch's by at most one ulp,
/// well inside the 1e-6 relative agreement the tests check over 100 steps.
///
/// Every ISA path (scalar, AVX2, AVX-512) performs exactly these operations: no FMA contraction
/// besides the explicit, correctly rounded fmas, no reassociation. So they give bitwise identical
/// results, and the thread count does not matter either.
///
/// Dynamic loss scaling: call grads_finite() (or set skip_if_nonfinite) before stepping. With
/// skip_if_nonfinite the step first checks every scaled gradient and, if any is NaN or Inf, returns
/// true without touching params or state; the caller then lowers the loss scale and skips the
/// step. Without it the step always runs and its return value still says whether a non-finite
/// gradient was seen (the state is then contaminated).

#include <cstddef>
#include <cstdint>
#include <string>

#include "memtide/core/thread_pool.hpp"

namespace memtide::tiering {

using memtide::ThreadPool;

enum class DType : std::uint8_t { none = 0, fp32 = 1, fp16 = 2, bf16 = 3 };
enum class CpuIsa : std::uint8_t { automatic = 0, scalar = 1, avx2 = 2, avx512 = 3 };

/// How the step writes its low-precision copy (param_out). The values written are the same bits
/// either way; only the traffic differs.
enum class OutStores : std::uint8_t {
  automatic = 0,  ///< streaming when the step's streams are larger than the last-level cache
  cached = 1,     ///< plain stores: the copy stays in cache for a reader that comes soon
  streaming = 2,  ///< non-temporal stores: no read-for-ownership of the copy's lines (2 B/param)
};

struct AdamwArgs {
  float* param = nullptr;       ///< fp32 master params, updated in place
  float* exp_avg = nullptr;     ///< fp32, in/out
  float* exp_avg_sq = nullptr;  ///< fp32, in/out
  const void* grad = nullptr;   ///< grad_dtype elements
  DType grad_dtype = DType::fp32;
  void* param_out = nullptr;    ///< optional low-precision copy of the new params
  DType param_out_dtype = DType::none;  ///< none, fp16 or bf16
  std::size_t n = 0;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;        ///< 1-based step count after this update (bias correction)
  double grad_scale = 1.0;      ///< multiplier, e.g. 1 / loss_scale
  double clip = 1.0;            ///< multiplier, e.g. the clip_grad_norm_ coefficient
  bool l2 = false;              ///< false: decoupled weight decay (AdamW); true: Adam's L2 term
  bool skip_if_nonfinite = false;
  OutStores out_stores = OutStores::automatic;  ///< how param_out is written
};

/// Validates `args` (throws InvalidArgument), then runs the step over `pool` (null = one thread,
/// the caller). Returns true if any scaled gradient was non-finite; with skip_if_nonfinite the
/// state is then left untouched. `isa` = automatic uses MEMTIDE_CPU_ISA (default auto: the
/// widest path this CPU supports); asking for a path the CPU lacks throws InvalidArgument.
bool adamw_step(const AdamwArgs& args, ThreadPool* pool, CpuIsa isa = CpuIsa::automatic);

/// True if every grad[i] * grad_scale * clip (computed as in adamw_step) is finite.
bool grads_finite(const void* grad, DType dtype, std::size_t n, double grad_scale = 1.0, double clip = 1.0,
                  ThreadPool* pool = nullptr, CpuIsa isa = CpuIsa::automatic);

/// The sum of grad[i]^2 (upcast to fp32 exactly, squared and summed in double): a gradient
/// norm's square. Summed tile by tile (kAdamwTile) and the tiles in order, so the thread count
/// never changes the bits. NaN or Inf in, NaN or Inf out.
double grad_square_sum(const void* grad, DType dtype, std::size_t n, ThreadPool* pool = nullptr);

/// dst[i] = src[i] upcast to fp32 (exact) for a gradient of `dtype` (fp32, fp16 or bf16), over
/// `pool`; returns true if every element is finite (the NaN/Inf check rides the copy's pass).
/// `stores`: how dst is written (streaming: non-temporal stores, no read-for-ownership of dst;
/// automatic: streaming when n params' step would not fit the last-level cache). This is the
/// host side of the gradient path for CPU tensors: the copy into the optimizer's flat buffer.
bool copy_grad(float* dst, const void* src, DType dtype, std::size_t n, ThreadPool* pool,
               OutStores stores = OutStores::automatic, CpuIsa isa = CpuIsa::automatic);

/// What OutStores::automatic becomes for a step over n params on this machine (the others stay).
OutStores resolve_out_stores(OutStores how, std::size_t n) noexcept;

/// The path `isa` resolves to here (automatic: MEMTIDE_CPU_ISA, then the best supported).
CpuIsa resolve_cpu_isa(CpuIsa isa = CpuIsa::automatic);
/// Whether this CPU can run `isa` (automatic and scalar: always).
bool cpu_isa_supported(CpuIsa isa) noexcept;
/// "scalar", "avx2", "avx512" or "auto".
const char* cpu_isa_name(CpuIsa isa) noexcept;
/// "fp32", "fp16", "bf16" or "none".
const char* dtype_name(DType dtype) noexcept;
/// The name of the path adamw_step uses by default here.
const char* adamw_isa();

/// Reference conversions (round to nearest even; fp16 overflow -> inf; NaN stays NaN).
std::uint16_t fp32_to_fp16(float f) noexcept;
std::uint16_t fp32_to_bf16(float f) noexcept;
float fp16_to_fp32(std::uint16_t h) noexcept;
float bf16_to_fp32(std::uint16_t b) noexcept;

/// Elements per tile handed to one thread at a time.
inline constexpr std::size_t kAdamwTile = 16384;

}  // namespace memtide::tiering
