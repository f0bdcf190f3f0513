#pragma once
/// @file
/// Device-side optimizer kernels for CudaDevice (compiled by nvcc into memtide::tiering when
/// MEMTIDE_HAVE_CUDA_KERNELS is set). Callers normally use kernels/device_ops.hpp, which picks
/// these on CudaDevice and the simulated kernels on SimDevice.
///
/// Each call enqueues on `stream` and returns at once; pointers are device pointers. Results must
/// be bitwise identical to the CPU kernel (kernels/adamw_cpu.hpp): same operation order, explicit
/// fmas only, no contraction.

#include <cstddef>

#include <cuda_runtime_api.h>

#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering::cuda {

/// One AdamW/Adam step over `args.n` elements (args.skip_if_nonfinite is ignored: callers check
/// gradients first with count_nonfinite).
void adamw_step(cudaStream_t stream, const AdamwArgs& args);

/// dst[i] = convert(src[i] * scale) between fp32 and fp16/bf16 (round to nearest even).
void convert(cudaStream_t stream, void* dst, DType dst_dtype, const void* src, DType src_dtype, std::size_t n,
             float scale);

/// Makes `*count` (a device counter) non-zero if any src[i] * scale * clip is not finite, computed
/// as grads_finite does; leaves it alone otherwise.
void count_nonfinite(cudaStream_t stream, const void* src, DType dtype, std::size_t n, double scale, double clip,
                     unsigned int* count);

}  // namespace memtide::tiering::cuda
