// Device-side ops: one dispatch point between the CUDA kernels and SimDevice's simulated ones.

#include "memtide/tiering/kernels/device_ops.hpp"

#include <cstdint>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"

#if MEMTIDE_HAVE_CUDA_KERNELS
#include "memtide/tiering/kernels/cuda_kernels.hpp"
#endif

namespace memtide::tiering {
namespace {

#if !MEMTIDE_HAVE_CUDA_KERNELS
[[noreturn]] void no_kernels(const Device& device, const char* op) {
  throw Error(std::string(op) + ": CUDA optimizer kernels are not in this build (device \"" +
              device.properties().name + "\"); rebuild with the kernels or use the CPU path");
}
#endif

float to_float(const void* src, DType dtype, std::size_t i) {
  switch (dtype) {
    case DType::fp16: return fp16_to_fp32(static_cast<const std::uint16_t*>(src)[i]);
    case DType::bf16: return bf16_to_fp32(static_cast<const std::uint16_t*>(src)[i]);
    default: return static_cast<const float*>(src)[i];
  }
}

void from_float(void* dst, DType dtype, std::size_t i, float v) {
  switch (dtype) {
    case DType::fp16: static_cast<std::uint16_t*>(dst)[i] = fp32_to_fp16(v); break;
    case DType::bf16: static_cast<std::uint16_t*>(dst)[i] = fp32_to_bf16(v); break;
    default: static_cast<float*>(dst)[i] = v; break;
  }
}

}  // namespace

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::fp32: return 4;
    case DType::fp16:
    case DType::bf16: return 2;
    default: return 0;
  }
}

double adamw_bytes_per_param(DType grad_dtype, DType param_out_dtype) noexcept {
  return 24.0 + static_cast<double>(dtype_size(grad_dtype) + dtype_size(param_out_dtype));
}

void adamw_step_async(Device& device, Stream stream, const AdamwArgs& args) {
  if (args.skip_if_nonfinite) {
    throw InvalidArgument("adamw_step_async: skip_if_nonfinite=true is not supported on the device; "
                          "check gradients with count_nonfinite_async first");
  }
  if (args.n == 0) return;
  if (args.param == nullptr || args.exp_avg == nullptr || args.exp_avg_sq == nullptr || args.grad == nullptr) {
    throw InvalidArgument("adamw_step_async: param, exp_avg, exp_avg_sq and grad must be non-null for n = " +
                          std::to_string(args.n));
  }
  if (auto* sim = dynamic_cast<SimDevice*>(&device)) {
    const double n = static_cast<double>(args.n);
    const double rate = sim->config().gpu_update_params_per_s;
    AdamwArgs copy = args;
    sim->enqueue_compute(stream, n * adamw_bytes_per_param(args.grad_dtype, args.param_out_dtype),
                         [copy] { adamw_step(copy, nullptr); }, rate > 0 ? n / rate * 1e9 : 0.0);
    return;
  }
#if MEMTIDE_HAVE_CUDA_KERNELS
  cuda::adamw_step(stream.handle, args);
#else
  no_kernels(device, "adamw_step_async");
#endif
}

void convert_async(Device& device, Stream stream, void* dst, DType dst_dtype, const void* src, DType src_dtype,
                   std::size_t n, float scale) {
  const bool up = dst_dtype == DType::fp32 && (src_dtype == DType::fp16 || src_dtype == DType::bf16 || src_dtype == DType::fp32);
  const bool down = src_dtype == DType::fp32 && (dst_dtype == DType::fp16 || dst_dtype == DType::bf16);
  if (!up && !down) {
    throw InvalidArgument(std::string("convert_async: ") + dtype_name(src_dtype) + " -> " + dtype_name(dst_dtype) +
                          " is not supported; accepted: fp16/bf16/fp32 -> fp32 and fp32 -> fp16/bf16");
  }
  if (n == 0) return;
  if (dst == nullptr || src == nullptr) throw InvalidArgument("convert_async: null pointer for n = " + std::to_string(n));
  if (auto* sim = dynamic_cast<SimDevice*>(&device)) {
    const double bytes = static_cast<double>(n * (dtype_size(dst_dtype) + dtype_size(src_dtype)));
    sim->enqueue_compute(stream, bytes, [=] {
      for (std::size_t i = 0; i < n; ++i) from_float(dst, dst_dtype, i, to_float(src, src_dtype, i) * scale);
    });
    return;
  }
#if MEMTIDE_HAVE_CUDA_KERNELS
  cuda::convert(stream.handle, dst, dst_dtype, src, src_dtype, n, scale);
#else
  no_kernels(device, "convert_async");
#endif
}

void count_nonfinite_async(Device& device, Stream stream, const void* src, DType dtype, std::size_t n, double scale,
                           double clip, unsigned int* count) {
  if (count == nullptr) throw InvalidArgument("count_nonfinite_async: count must be a device pointer, got null");
  if (n == 0) return;
  if (auto* sim = dynamic_cast<SimDevice*>(&device)) {
    sim->enqueue_compute(stream, static_cast<double>(n * dtype_size(dtype)), [=] {
      if (!grads_finite(src, dtype, n, scale, clip)) *count = 1;
    });
    return;
  }
#if MEMTIDE_HAVE_CUDA_KERNELS
  cuda::grads_nonfinite(stream.handle, src, dtype, n, scale, clip, count);
#else
  no_kernels(device, "count_nonfinite_async");
#endif
}

bool device_ops_available(Device& device) noexcept {
  if (dynamic_cast<SimDevice*>(&device) != nullptr) return true;
#if MEMTIDE_HAVE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

}  // namespace memtide::tiering
