#pragma once
/// @file
/// The optimizer's GPU kernels (built only with CUDA: MEMTIDE_HAVE_CUDA_KERNELS).
///
/// The AdamW step performs the same IEEE operations in the same order as the CPU step
/// (adamw_cpu.hpp), with no FMA contraction besides the two explicit fmas, and shares its
/// fp16/bf16 rounding code, so a GPU-updated subgroup is bit-for-bit what the CPU would have
/// produced: placement never changes the numbers. No alignment is required of any pointer
/// (DeepSpeed's fp16 kernel needs 32 bytes): aligned arrays take a 4-wide vector path, others
/// a scalar one. Nothing here allocates or synchronizes; every call is ordered on `stream`
/// (a cudaStream_t, passed as void* so this header needs no CUDA headers).

#include <cstddef>

#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering::cuda {

/// Launches one fused AdamW step over device pointers. `nonfinite_flag` (device memory, may be
/// null) is OR-ed with 1 when a scaled gradient is NaN or Inf. `skip_flag` (device memory, may
/// be null): when it holds non-zero at kernel start, the step leaves everything untouched — the
/// stream-ordered form of skip_if_nonfinite (run grads_nonfinite into the same flag first).
/// Throws InvalidArgument for bad arguments and CudaError when the launch fails.
void adamw_step(void* stream, const AdamwArgs& args, unsigned* nonfinite_flag = nullptr,
                const unsigned* skip_flag = nullptr);

/// ORs 1 into `flag` (device memory) if any grad[i] * grad_scale * clip is non-finite.
void grads_nonfinite(void* stream, const void* grad, DType dtype, std::size_t n, double grad_scale, double clip,
                     unsigned* flag);

/// dst[i] = src[i] * scale, converted from `src_dtype` to `dst_dtype` (fp32, fp16, bf16), rounding
/// to nearest even: the gradient upcast (16-bit -> fp32, scale = 1/loss_scale) and the param
/// downcast (fp32 -> 16-bit, scale = 1). `dst` and `src` must not overlap.
void convert(void* stream, void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t n,
             double scale = 1.0);

}  // namespace memtide::tiering::cuda
