#pragma once
/// @file
/// The device-side operations the tiering engine needs, on any Device: the AdamW step over
/// GPU-resident state, precision conversion (gradient upcast, parameter downcast) and the
/// non-finite gradient check.
///
/// On CudaDevice they launch the kernels of kernels/cuda_kernels.hpp; on SimDevice they are
/// scheduled on the simulated compute engine and (in data mode) run the CPU kernels over the
/// simulated device memory, so results are bitwise those of the CPU path.

#include <cstddef>

#include "memtide/device/device.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering {

/// Bytes per element of `dtype` (none: 0).
std::size_t dtype_size(DType dtype) noexcept;

/// Enqueues one AdamW step on `stream`. Every pointer in `args` is device memory.
/// `args.skip_if_nonfinite` must be false: check gradients first (count_nonfinite_async).
/// Throws InvalidArgument for bad arguments, Error when the build has no kernels for the device.
void adamw_step_async(Device& device, Stream stream, const AdamwArgs& args);

/// Enqueues dst[i] = convert(src[i] * scale) for `n` elements of device memory: fp16/bf16 -> fp32
/// (upcast, optionally unscaling) or fp32 -> fp16/bf16 (downcast). Callers chunk large arrays.
void convert_async(Device& device, Stream stream, void* dst, DType dst_dtype, const void* src, DType src_dtype,
                   std::size_t n, float scale = 1.0F);

/// Enqueues a check of src[i] * scale * clip (computed as grads_finite does): `*count` (one device
/// uint32) becomes non-zero if any element is NaN or Inf, and is left alone otherwise.
void count_nonfinite_async(Device& device, Stream stream, const void* src, DType dtype, std::size_t n,
                           double scale, double clip, unsigned int* count);

/// True when the operations above can run on `device`: always on a SimDevice, on other devices
/// only when this build has the CUDA kernels (a planner then keeps every subgroup on the CPU).
bool device_ops_available(Device& device) noexcept;

/// HBM bytes one AdamW step moves per parameter (reads p, m, v, grad; writes p, m, v and the
/// low-precision copy).
double adamw_bytes_per_param(DType grad_dtype, DType param_out_dtype) noexcept;

}  // namespace memtide::tiering
