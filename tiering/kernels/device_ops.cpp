// Device-side ops: each is one DeviceKernel, its CUDA launch and its host form; the Device runs the
// form it can (a GPU the launch, a simulated device the host form on its clock).

#include "memtide/tiering/kernels/device_ops.hpp"

#include <cstdint>
#include <string>

#include "memtide/core/error.hpp"

#if MEMTIDE_HAVE_CUDA_KERNELS
#include "memtide/tiering/kernels/cuda_kernels.hpp"
#endif

namespace memtide::tiering {
namespace {

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
  DeviceKernel k;
  k.hbm_bytes = static_cast<double>(args.n) * adamw_bytes_per_param(args.grad_dtype, args.param_out_dtype);
  k.params = static_cast<double>(args.n);
  k.host = [args] { adamw_step(args, nullptr); };
#if MEMTIDE_HAVE_CUDA_KERNELS
  k.launch = [args](Stream s) { cuda::adamw_step(s.handle, args); };
#endif
  device.enqueue_kernel(stream, k);
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
  DeviceKernel k;
  k.hbm_bytes = static_cast<double>(n * (dtype_size(dst_dtype) + dtype_size(src_dtype)));
  k.host = [=] {
    for (std::size_t i = 0; i < n; ++i) from_float(dst, dst_dtype, i, to_float(src, src_dtype, i) * scale);
  };
#if MEMTIDE_HAVE_CUDA_KERNELS
  k.launch = [=](Stream s) { cuda::convert(s.handle, dst, dst_dtype, src, src_dtype, n, scale); };
#endif
  device.enqueue_kernel(stream, k);
}

void count_nonfinite_async(Device& device, Stream stream, const void* src, DType dtype, std::size_t n, double scale,
                           double clip, unsigned int* count) {
  if (count == nullptr) throw InvalidArgument("count_nonfinite_async: count must be a device pointer, got null");
  if (n == 0) return;
  DeviceKernel k;
  k.hbm_bytes = static_cast<double>(n * dtype_size(dtype));
  k.host = [=] {
    if (!grads_finite(src, dtype, n, scale, clip)) *count = 1;
  };
#if MEMTIDE_HAVE_CUDA_KERNELS
  k.launch = [=](Stream s) { cuda::grads_nonfinite(s.handle, src, dtype, n, scale, clip, count); };
#endif
  device.enqueue_kernel(stream, k);
}

bool device_ops_available(Device& device) noexcept {
  // The kernels of this build come in both forms or only the host one: ask with a probe.
  DeviceKernel probe;
  probe.host = [] {};
#if MEMTIDE_HAVE_CUDA_KERNELS
  probe.launch = [](Stream) {};
#endif
  return device.can_run(probe);
}

}  // namespace memtide::tiering
