// The GPU side of the optimizer: fused AdamW step, non-finite check, and fp16/bf16 <-> fp32
// conversion. See memtide/tiering/kernels/cuda_kernels.hpp for the contract.
//
// Every float operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...):
// nvcc contracts a*b+c into an fma by default, which would make the GPU result differ from the
// CPU step in the last bit. Memory-bound kernels lose nothing by it.

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "../adamw_consts.hpp"
#include "../fp_bits.hpp"
#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/cuda_kernels.hpp"

namespace memtide::tiering::cuda {
namespace {

using detail::AdamwConsts;

constexpr int kThreads = 256;

// ---- element access: W consecutive elements per unit, vector loads when W == 4 -------------

template <int W>
struct Frag {
  float v[W];
};

template <int W>
__device__ __forceinline__ Frag<W> load_f32(const float* p, std::size_t unit) {
  Frag<W> f;
  if constexpr (W == 4) {
    const float4 x = reinterpret_cast<const float4*>(p)[unit];
    f.v[0] = x.x;
    f.v[1] = x.y;
    f.v[2] = x.z;
    f.v[3] = x.w;
  } else {
    f.v[0] = p[unit];
  }
  return f;
}

template <int W>
__device__ __forceinline__ void store_f32(float* p, std::size_t unit, const Frag<W>& f) {
  if constexpr (W == 4) {
    reinterpret_cast<float4*>(p)[unit] = make_float4(f.v[0], f.v[1], f.v[2], f.v[3]);
  } else {
    p[unit] = f.v[0];
  }
}

template <DType D>
__device__ __forceinline__ float u16_to_f(std::uint16_t h) {
  if constexpr (D == DType::fp16) {
    return fp::fp16_to_f(h);
  } else {
    return fp::bf16_to_f(h);
  }
}

template <DType D>
__device__ __forceinline__ std::uint16_t f_to_u16(float f) {
  if constexpr (D == DType::fp16) {
    return fp::f_to_fp16(f);
  } else {
    return fp::f_to_bf16(f);
  }
}

// Reads W elements of dtype D as floats (exact conversion).
template <DType D, int W>
__device__ __forceinline__ Frag<W> load_any(const void* p, std::size_t unit) {
  if constexpr (D == DType::fp32) {
    return load_f32<W>(static_cast<const float*>(p), unit);
  } else {
    Frag<W> f;
    if constexpr (W == 4) {
      const uint2 x = reinterpret_cast<const uint2*>(p)[unit];
      f.v[0] = u16_to_f<D>(static_cast<std::uint16_t>(x.x & 0xFFFFU));
      f.v[1] = u16_to_f<D>(static_cast<std::uint16_t>(x.x >> 16));
      f.v[2] = u16_to_f<D>(static_cast<std::uint16_t>(x.y & 0xFFFFU));
      f.v[3] = u16_to_f<D>(static_cast<std::uint16_t>(x.y >> 16));
    } else {
      f.v[0] = u16_to_f<D>(static_cast<const std::uint16_t*>(p)[unit]);
    }
    return f;
  }
}

// Writes W floats as dtype D (round to nearest even).
template <DType D, int W>
__device__ __forceinline__ void store_any(void* p, std::size_t unit, const Frag<W>& f) {
  if constexpr (D == DType::fp32) {
    store_f32<W>(static_cast<float*>(p), unit, f);
  } else if constexpr (W == 4) {
    uint2 x;
    x.x = static_cast<unsigned>(f_to_u16<D>(f.v[0])) | (static_cast<unsigned>(f_to_u16<D>(f.v[1])) << 16);
    x.y = static_cast<unsigned>(f_to_u16<D>(f.v[2])) | (static_cast<unsigned>(f_to_u16<D>(f.v[3])) << 16);
    reinterpret_cast<uint2*>(p)[unit] = x;
  } else {
    static_cast<std::uint16_t*>(p)[unit] = f_to_u16<D>(f.v[0]);
  }
}

// One flag write per warp that saw a non-finite value.
__device__ __forceinline__ void report_nonfinite(unsigned bad, unsigned* flag) {
  const unsigned any = __ballot_sync(0xFFFFFFFFU, bad != 0);
  if (flag != nullptr && any != 0 && (threadIdx.x & 31U) == (__ffs(any) - 1U)) atomicOr(flag, 1U);
}

// ---- kernels ----------------------------------------------------------------------------------

struct StepPtrs {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  void* param_out;
  std::size_t units;  // elements / W
};

// The loop body is adamw_impl.hpp's, operation for operation.
template <DType G, DType O, bool kL2, int W>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(StepPtrs s, AdamwConsts c, unsigned* nonfinite_flag, const unsigned* skip_flag) {
  if (skip_flag != nullptr && *skip_flag != 0) return;
  unsigned bad = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  // Every thread of a warp runs the same number of iterations, so the ballot below is safe.
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t rounds = (s.units + stride - 1) / stride;
  for (std::size_t r = 0; r < rounds; ++r) {
    const std::size_t u = first + r * stride;
    if (u >= s.units) continue;
    Frag<W> g = load_any<G, W>(s.grad, u);
    Frag<W> p = load_f32<W>(s.param, u);
    Frag<W> m = load_f32<W>(s.exp_avg, u);
    Frag<W> v = load_f32<W>(s.exp_avg_sq, u);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      float gj = __fmul_rn(g.v[j], c.grad_scale);
      gj = __fmul_rn(gj, c.clip);
      bad |= fp::nonfinite_bit(gj);
      float pj = p.v[j];
      if constexpr (kL2) {
        gj = __fmaf_rn(c.wd, pj, gj);
      } else {
        pj = __fmul_rn(pj, c.decay);
      }
      const float mj = __fmaf_rn(c.w1, __fsub_rn(gj, m.v[j]), m.v[j]);
      float vj = __fmul_rn(v.v[j], c.beta2);
      vj = __fadd_rn(vj, __fmul_rn(__fmul_rn(c.one_minus_beta2, gj), gj));
      const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vj), c.inv_bc2_sqrt), c.eps);
      pj = __fadd_rn(pj, __fdiv_rn(__fmul_rn(c.neg_step, mj), denom));
      p.v[j] = pj;
      m.v[j] = mj;
      v.v[j] = vj;
    }
    store_f32<W>(s.param, u, p);
    store_f32<W>(s.exp_avg, u, m);
    store_f32<W>(s.exp_avg_sq, u, v);
    if constexpr (O != DType::none) store_any<O, W>(s.param_out, u, p);
  }
  report_nonfinite(bad, nonfinite_flag);
}

template <DType G, int W>
__global__ void __launch_bounds__(kThreads)
    nonfinite_kernel(const void* grad, std::size_t units, float grad_scale, float clip, unsigned* flag) {
  unsigned bad = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t rounds = (units + stride - 1) / stride;
  for (std::size_t r = 0; r < rounds; ++r) {
    const std::size_t u = first + r * stride;
    if (u >= units) continue;
    const Frag<W> g = load_any<G, W>(grad, u);
#pragma unroll
    for (int j = 0; j < W; ++j) bad |= fp::nonfinite_bit(__fmul_rn(__fmul_rn(g.v[j], grad_scale), clip));
  }
  report_nonfinite(bad, flag);
}

template <DType S, DType D, int W>
__global__ void __launch_bounds__(kThreads) convert_kernel(void* dst, const void* src, std::size_t units, float scale) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t u = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    Frag<W> f = load_any<S, W>(src, u);
    if (scale != 1.0F) {
#pragma unroll
      for (int j = 0; j < W; ++j) f.v[j] = __fmul_rn(f.v[j], scale);
    }
    store_any<D, W>(dst, u, f);
  }
}

// ---- host side --------------------------------------------------------------------------------

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw CudaError(static_cast<int>(err), std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                               cudaGetErrorString(err) + ")");
  }
}

// Enough resident blocks to cover the GPU a few times over; more only adds scheduling.
unsigned grid_for(std::size_t units) {
  static std::array<std::atomic<int>, 64> sm_count{};
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  int sms = dev >= 0 && dev < 64 ? sm_count[static_cast<std::size_t>(dev)].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    if (dev >= 0 && dev < 64) sm_count[static_cast<std::size_t>(dev)].store(sms, std::memory_order_relaxed);
  }
  const std::size_t wanted = (units + kThreads - 1) / kThreads;
  const std::size_t cap = static_cast<std::size_t>(sms) * 8;
  return static_cast<unsigned>(wanted < cap ? (wanted == 0 ? 1 : wanted) : cap);
}

bool aligned(const void* p, std::size_t a) { return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % a == 0; }

std::size_t elem_size(DType d) { return d == DType::fp32 ? 4 : 2; }

const unsigned char* offset(const void* p, std::size_t elems, DType d) {
  return p == nullptr ? nullptr : static_cast<const unsigned char*>(p) + elems * elem_size(d);
}

template <DType G, DType O, bool kL2, int W>
void launch_step(cudaStream_t st, const StepPtrs& s, const AdamwConsts& c, unsigned* nf, const unsigned* skip) {
  adamw_kernel<G, O, kL2, W><<<grid_for(s.units), kThreads, 0, st>>>(s, c, nf, skip);
  check(cudaGetLastError(), "adamw_step kernel launch");
}

template <int W>
void dispatch_step(cudaStream_t st, const AdamwArgs& a, const StepPtrs& s, const AdamwConsts& c, unsigned* nf,
                   const unsigned* skip) {
  auto by_out = [&](auto g_tag, auto l2_tag) {
    constexpr DType G = decltype(g_tag)::value;
    constexpr bool L2 = decltype(l2_tag)::value;
    switch (a.param_out_dtype) {
      case DType::fp16: return launch_step<G, DType::fp16, L2, W>(st, s, c, nf, skip);
      case DType::bf16: return launch_step<G, DType::bf16, L2, W>(st, s, c, nf, skip);
      default: return launch_step<G, DType::none, L2, W>(st, s, c, nf, skip);
    }
  };
  auto by_grad = [&](auto l2_tag) {
    switch (a.grad_dtype) {
      case DType::fp16: return by_out(std::integral_constant<DType, DType::fp16>{}, l2_tag);
      case DType::bf16: return by_out(std::integral_constant<DType, DType::bf16>{}, l2_tag);
      default: return by_out(std::integral_constant<DType, DType::fp32>{}, l2_tag);
    }
  };
  if (a.l2) {
    by_grad(std::true_type{});
  } else {
    by_grad(std::false_type{});
  }
}

template <int W>
void dispatch_nonfinite(cudaStream_t st, const void* grad, DType d, std::size_t units, float gs, float clip,
                        unsigned* flag) {
  const unsigned grid = grid_for(units);
  switch (d) {
    case DType::fp16: nonfinite_kernel<DType::fp16, W><<<grid, kThreads, 0, st>>>(grad, units, gs, clip, flag); break;
    case DType::bf16: nonfinite_kernel<DType::bf16, W><<<grid, kThreads, 0, st>>>(grad, units, gs, clip, flag); break;
    default: nonfinite_kernel<DType::fp32, W><<<grid, kThreads, 0, st>>>(grad, units, gs, clip, flag); break;
  }
  check(cudaGetLastError(), "grads_nonfinite kernel launch");
}

template <DType S, int W>
void convert_from(cudaStream_t st, void* dst, DType dd, const void* src, std::size_t units, float scale) {
  const unsigned grid = grid_for(units);
  switch (dd) {
    case DType::fp16: convert_kernel<S, DType::fp16, W><<<grid, kThreads, 0, st>>>(dst, src, units, scale); break;
    case DType::bf16: convert_kernel<S, DType::bf16, W><<<grid, kThreads, 0, st>>>(dst, src, units, scale); break;
    default: convert_kernel<S, DType::fp32, W><<<grid, kThreads, 0, st>>>(dst, src, units, scale); break;
  }
  check(cudaGetLastError(), "convert kernel launch");
}

template <int W>
void dispatch_convert(cudaStream_t st, void* dst, DType dd, const void* src, DType sd, std::size_t units,
                      float scale) {
  switch (sd) {
    case DType::fp16: return convert_from<DType::fp16, W>(st, dst, dd, src, units, scale);
    case DType::bf16: return convert_from<DType::bf16, W>(st, dst, dd, src, units, scale);
    default: return convert_from<DType::fp32, W>(st, dst, dd, src, units, scale);
  }
}

bool is_float_type(DType d) { return d == DType::fp32 || d == DType::fp16 || d == DType::bf16; }

// A GPU load of an element must be aligned to its size (a misaligned one is a sticky
// cudaErrorMisalignedAddress that ends the context), so it is refused here, naming the array.
// torch's tensors always satisfy it; the CPU kernels accept any address.
void require_element_aligned(const void* p, DType d, const char* fn, const char* name) {
  if (!aligned(p, elem_size(d))) {
    throw InvalidArgument(std::string("cuda::") + fn + ": " + name + " is not aligned to its " +
                          std::to_string(elem_size(d)) + "-byte element");
  }
}

}  // namespace

void adamw_step(void* stream, const AdamwArgs& args, unsigned* nonfinite_flag, const unsigned* skip_flag) {
  detail::validate_adamw_args(args);
  if (args.n == 0) return;
  if (args.skip_if_nonfinite) {
    throw InvalidArgument(
        "cuda::adamw_step: skip_if_nonfinite needs a host round trip; run grads_nonfinite into a device flag and "
        "pass it as skip_flag instead");
  }
  const DType out = args.param_out_dtype;
  require_element_aligned(args.param, DType::fp32, "adamw_step", "param");
  require_element_aligned(args.exp_avg, DType::fp32, "adamw_step", "exp_avg");
  require_element_aligned(args.exp_avg_sq, DType::fp32, "adamw_step", "exp_avg_sq");
  require_element_aligned(args.grad, args.grad_dtype, "adamw_step", "grad");
  if (out != DType::none) require_element_aligned(args.param_out, out, "adamw_step", "param_out");
  const auto st = static_cast<cudaStream_t>(stream);
  const AdamwConsts c = detail::adamw_consts(args);
  const bool vec = aligned(args.param, 16) && aligned(args.exp_avg, 16) && aligned(args.exp_avg_sq, 16) &&
                   aligned(args.grad, 4 * elem_size(args.grad_dtype)) &&
                   (out == DType::none || aligned(args.param_out, 8));
  const std::size_t head = vec ? args.n / 4 * 4 : 0;
  if (head != 0) {
    const StepPtrs s{args.param, args.exp_avg, args.exp_avg_sq, args.grad, args.param_out, head / 4};
    dispatch_step<4>(st, args, s, c, nonfinite_flag, skip_flag);
  }
  if (head != args.n) {
    const StepPtrs s{args.param + head,
                     args.exp_avg + head,
                     args.exp_avg_sq + head,
                     offset(args.grad, head, args.grad_dtype),
                     out == DType::none ? nullptr : const_cast<unsigned char*>(offset(args.param_out, head, out)),
                     args.n - head};
    dispatch_step<1>(st, args, s, c, nonfinite_flag, skip_flag);
  }
}

void grads_nonfinite(void* stream, const void* grad, DType dtype, std::size_t n, double grad_scale, double clip,
                     unsigned* flag) {
  if (n == 0) return;
  if (grad == nullptr || flag == nullptr) throw InvalidArgument("cuda::grads_nonfinite: grad and flag must not be null");
  if (!is_float_type(dtype)) throw InvalidArgument("cuda::grads_nonfinite: dtype must be fp32, fp16 or bf16");
  require_element_aligned(grad, dtype, "grads_nonfinite", "grad");
  require_element_aligned(flag, DType::fp32, "grads_nonfinite", "flag");
  const auto st = static_cast<cudaStream_t>(stream);
  const float gs = static_cast<float>(grad_scale), cl = static_cast<float>(clip);
  const std::size_t head = aligned(grad, 4 * elem_size(dtype)) ? n / 4 * 4 : 0;
  if (head != 0) dispatch_nonfinite<4>(st, grad, dtype, head / 4, gs, cl, flag);
  if (head != n) dispatch_nonfinite<1>(st, offset(grad, head, dtype), dtype, n - head, gs, cl, flag);
}

void convert(void* stream, void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t n, double scale) {
  if (n == 0) return;
  if (dst == nullptr || src == nullptr) throw InvalidArgument("cuda::convert: dst and src must not be null");
  if (!is_float_type(dst_dtype) || !is_float_type(src_dtype)) {
    throw InvalidArgument("cuda::convert: dtypes must be fp32, fp16 or bf16");
  }
  require_element_aligned(dst, dst_dtype, "convert", "dst");
  require_element_aligned(src, src_dtype, "convert", "src");
  const auto st = static_cast<cudaStream_t>(stream);
  const float s = static_cast<float>(scale);
  const std::size_t head =
      aligned(dst, 4 * elem_size(dst_dtype)) && aligned(src, 4 * elem_size(src_dtype)) ? n / 4 * 4 : 0;
  if (head != 0) dispatch_convert<4>(st, dst, dst_dtype, src, src_dtype, head / 4, s);
  if (head != n) {
    dispatch_convert<1>(st, const_cast<unsigned char*>(offset(dst, head, dst_dtype)), dst_dtype,
                        offset(src, head, src_dtype), src_dtype, n - head, s);
  }
}

}  // namespace memtide::tiering::cuda
