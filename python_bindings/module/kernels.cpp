// memtide._memtide: the optimizer kernels on their own (tests, benchmarks): the fused CPU AdamW
// step and its memory roof, the gradient check, and the device-side step and conversion.

#include <optional>

#include "memtide/core/log.hpp"
#include "memtide/core/os.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/kernels/bandwidth_probe.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "common.hpp"

namespace memtide::bindings {
namespace {

// ---- CPU AdamW ------------------------------------------------------------------------------

memtide::tiering::DType array_dtype(const CpuArray& a, const char* name) {
  const memtide::tiering::DType d = dlpack_dtype(a.dtype());
  if (d == memtide::tiering::DType::none) {
    value_error(std::string("adamw_step_cpu: ") + name + " must be float32, float16 or bfloat16");
  }
  return d;
}

// The per-step scalars of the adamw_step_* bindings, which take them as keyword arguments.
void set_hyperparameters(memtide::tiering::AdamwArgs& a, double lr, double beta1, double beta2, double eps,
                         double weight_decay, std::int64_t step, double grad_scale, double clip, bool l2) {
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  a.step = step;
  a.grad_scale = grad_scale;
  a.clip = clip;
  a.l2 = l2;
}

float* fp32_data(const CpuArray& a, const char* name, std::size_t n) {
  if (array_dtype(a, name) != memtide::tiering::DType::fp32) value_error(std::string("adamw_step_cpu: ") + name + " must be float32");
  if (a.size() != n) {
    value_error(std::string("adamw_step_cpu: ") + name + " has " + std::to_string(a.size()) + " elements, param has " +
                std::to_string(n));
  }
  return static_cast<float*>(a.data());
}

memtide::tiering::OutStores parse_out_stores(const std::string& name) {
  using memtide::tiering::OutStores;
  if (name == "auto") return OutStores::automatic;
  if (name == "cached") return OutStores::cached;
  if (name == "streaming") return OutStores::streaming;
  value_error("out_stores must be \"auto\", \"cached\" or \"streaming\", got \"" + name + "\"");
}

bool adamw_step_cpu(const CpuArray& param, const CpuArray& grad, const CpuArray& exp_avg, const CpuArray& exp_avg_sq,
                    double lr, double beta1, double beta2, double eps, double weight_decay, std::int64_t step,
                    double grad_scale, double clip, bool l2, std::optional<CpuArray> out, bool skip_if_nonfinite,
                    const std::string& out_stores) {
  memtide::tiering::AdamwArgs a;
  a.out_stores = parse_out_stores(out_stores);
  a.n = param.size();
  a.param = fp32_data(param, "param", a.n);
  a.exp_avg = fp32_data(exp_avg, "exp_avg", a.n);
  a.exp_avg_sq = fp32_data(exp_avg_sq, "exp_avg_sq", a.n);
  a.grad_dtype = array_dtype(grad, "grad");
  if (grad.size() != a.n) value_error("adamw_step_cpu: grad and param differ in size");
  a.grad = grad.data();
  if (out) {
    a.param_out_dtype = array_dtype(*out, "out");
    if (a.param_out_dtype == memtide::tiering::DType::fp32) value_error("adamw_step_cpu: out must be float16 or bfloat16");
    if (out->size() != a.n) value_error("adamw_step_cpu: out and param differ in size");
    a.param_out = out->data();
  }
  set_hyperparameters(a, lr, beta1, beta2, eps, weight_decay, step, grad_scale, clip, l2);
  a.skip_if_nonfinite = skip_if_nonfinite;
  nb::gil_scoped_release nogil;
  return memtide::tiering::adamw_step(a, &memtide::default_pool());
}
// ---- kernels on their own: the CPU memory roof and the device-side step (benchmarks) ---------

bool copy_grad_cpu(const CpuArray& dst, const CpuArray& src, const std::string& out_stores) {
  using memtide::tiering::DType;
  if (dlpack_dtype(dst.dtype()) != DType::fp32) value_error("copy_grad_cpu: dst must be a float32 array");
  const DType sd = dlpack_dtype(src.dtype());
  if (sd == DType::none) value_error("copy_grad_cpu: src must be float32, float16 or bfloat16");
  if (src.size() != dst.size()) {
    value_error("copy_grad_cpu: src has " + std::to_string(src.size()) + " elements, dst " + std::to_string(dst.size()));
  }
  const memtide::tiering::OutStores stores = parse_out_stores(out_stores);
  nb::gil_scoped_release nogil;
  return memtide::tiering::copy_grad(static_cast<float*>(dst.data()), src.data(), sd, dst.size(),
                                     &memtide::default_pool(), stores);
}

void stream_probe_cpu(const CpuArray& p, const CpuArray& m, const CpuArray& v, const CpuArray& g, const CpuArray& out,
                      std::size_t threads, std::size_t tile, bool stream_out, bool stream_all, std::size_t prefetch) {
  using memtide::tiering::DType;
  const std::size_t n = p.size();
  for (const auto* a : {&p, &m, &v}) {
    if (dlpack_dtype(a->dtype()) != DType::fp32 || a->size() != n) {
      value_error("stream_probe_cpu: p, m and v must be float32 arrays of one size");
    }
  }
  for (const auto* a : {&g, &out}) {
    const DType d = dlpack_dtype(a->dtype());
    if ((d != DType::fp16 && d != DType::bf16) || a->size() != n) {
      value_error("stream_probe_cpu: g and out must be 16-bit float arrays with as many elements as p");
    }
  }
  if (threads != 1 && threads != 0 && threads != memtide::default_pool().size()) {
    value_error("stream_probe_cpu: threads must be 1 or the pool's " + std::to_string(memtide::default_pool().size()) +
                " (0 = the pool), got " + std::to_string(threads));
  }
  memtide::tiering::StreamWay way;
  way.tile = tile;
  way.stream_out = stream_out;
  way.stream_all = stream_all;
  way.prefetch = prefetch;
  nb::gil_scoped_release nogil;
  memtide::tiering::stream_probe(static_cast<float*>(p.data()), static_cast<float*>(m.data()),
                                 static_cast<float*>(v.data()), static_cast<const std::uint16_t*>(g.data()),
                                 static_cast<std::uint16_t*>(out.data()), n,
                                 threads == 1 ? nullptr : &memtide::default_pool(), way);
}

using DeviceArray = nb::ndarray<nb::c_contig>;

// The Runtime's device for an array's device; CPU arrays go to SimDevice's device memory only
// when they were allocated there, so accept only arrays on the runtime's kind of device.
memtide::Device& device_for(const DeviceArray& a, const char* who) {
  memtide::Runtime& rt = memtide::Runtime::get();
  const bool cuda_array = a.device_type() == nb::device::cuda::value;
  if (cuda_array != (rt.backend() == memtide::Backend::cuda)) {
    value_error(std::string(who) + ": the array is on " + (cuda_array ? "a CUDA device" : "the CPU") +
                " but memtide's runtime uses the " + backend_name(rt.backend()) + " backend");
  }
  return rt.allocator(cuda_array ? a.device_id() : 0).device();
}

float* fp32_device(const DeviceArray& a, const char* name, std::size_t n) {
  if (dlpack_dtype(a.dtype()) != memtide::tiering::DType::fp32 || a.size() != n) {
    value_error(std::string("adamw_step_device: ") + name + " must be float32 with as many elements as param");
  }
  return static_cast<float*>(a.data());
}

void adamw_step_device(const DeviceArray& param, const DeviceArray& grad, const DeviceArray& exp_avg,
                       const DeviceArray& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                       double weight_decay, std::int64_t step, double grad_scale, double clip, bool l2,
                       std::optional<DeviceArray> out, std::uintptr_t stream) {
  memtide::Device& dev = device_for(param, "adamw_step_device");
  memtide::tiering::AdamwArgs a;
  a.n = param.size();
  a.param = fp32_device(param, "param", a.n);
  a.exp_avg = fp32_device(exp_avg, "exp_avg", a.n);
  a.exp_avg_sq = fp32_device(exp_avg_sq, "exp_avg_sq", a.n);
  a.grad_dtype = dlpack_dtype(grad.dtype());
  if (a.grad_dtype == memtide::tiering::DType::none || grad.size() != a.n) {
    value_error("adamw_step_device: grad must be float32, float16 or bfloat16 with as many elements as param");
  }
  a.grad = grad.data();
  if (out) {
    a.param_out_dtype = dlpack_dtype(out->dtype());
    if ((a.param_out_dtype != memtide::tiering::DType::fp16 && a.param_out_dtype != memtide::tiering::DType::bf16) ||
        out->size() != a.n) {
      value_error("adamw_step_device: out must be float16 or bfloat16 with as many elements as param");
    }
    a.param_out = out->data();
  }
  set_hyperparameters(a, lr, beta1, beta2, eps, weight_decay, step, grad_scale, clip, l2);
  nb::gil_scoped_release nogil;
  memtide::tiering::adamw_step_async(dev, memtide::Stream{reinterpret_cast<void*>(stream)}, a);
}

void convert_device(const DeviceArray& dst, const DeviceArray& src, double scale, std::uintptr_t stream) {
  memtide::Device& dev = device_for(dst, "convert_device");
  const auto dd = dlpack_dtype(dst.dtype()), sd = dlpack_dtype(src.dtype());
  if (dd == memtide::tiering::DType::none || sd == memtide::tiering::DType::none || dst.size() != src.size()) {
    value_error("convert_device: dst and src must be float32/float16/bfloat16 arrays of one size");
  }
  nb::gil_scoped_release nogil;
  memtide::tiering::convert_async(dev, memtide::Stream{reinterpret_cast<void*>(stream)}, dst.data(), dd, src.data(), sd,
                                  dst.size(), static_cast<float>(scale));
}

}  // namespace

void bind_kernels(nb::module_& m) {
  m.def("adamw_step_cpu", &adamw_step_cpu, "param"_a.noconvert(), "grad"_a.noconvert(), "exp_avg"_a.noconvert(),
        "exp_avg_sq"_a.noconvert(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a,
        "grad_scale"_a = 1.0, "clip"_a = 1.0, "l2"_a = false, "out"_a.noconvert() = nb::none(),
        "skip_if_nonfinite"_a = false, "out_stores"_a = "auto",
        "One fused AdamW (or, with l2=True, Adam with L2) step in place on contiguous CPU arrays\n"
        "(numpy or torch, via DLPack): param, exp_avg, exp_avg_sq float32; grad float32, float16 or\n"
        "bfloat16, multiplied by grad_scale then clip; `out` (float16 or bfloat16) receives the new params.\n"
        "`step` is the 1-based step count including this one. Returns True if a scaled gradient was\n"
        "NaN/Inf (with skip_if_nonfinite the state is then left untouched). out_stores: how `out` is\n"
        "written, \"cached\", \"streaming\" (non-temporal) or \"auto\" (streaming above the last-level\n"
        "cache); the bits are the same.");
  m.def("cpu_isa", [] { return std::string(memtide::tiering::adamw_isa()); },
        "The vector path of the CPU optimizer kernels: scalar, avx2 or avx512 (MEMTIDE_CPU_ISA resolved).");
  m.def("cpu_threads", [] { return memtide::default_pool().size(); },
        "Threads of the process-wide CPU kernel pool (the caller included).");
  m.def(
      "cpu_executor",
      []() -> std::optional<std::string> {
        const memtide::ParallelExecutor* e = memtide::default_pool().executor();
        if (e == nullptr) return std::nullopt;
        return std::string(e->name);
      },
      "Whose threads run the CPU kernels' jobs: None for memtide's own pool, \"torch\" for torch's\n"
      "intra-op threads (memtide.torch_bridge.use_torch_threads()).");
  // The package's Python code logs through memtide's log, so that one MEMTIDE_LOG_LEVEL governs both.
  m.def(
      "log",
      [](const std::string& level, const std::string& message) {
        memtide::LogLevel l = memtide::LogLevel::info;
        if (level == "error") l = memtide::LogLevel::error;
        else if (level == "warn") l = memtide::LogLevel::warn;
        else if (level == "debug") l = memtide::LogLevel::debug;
        else if (level != "info") value_error("log: level must be error, warn, info or debug, got \"" + level + "\"");
        if (memtide::log_enabled(l)) memtide::log_message(l, message);
      },
      "level"_a, "message"_a, "Prints \"memtide [level] message\" to stderr when MEMTIDE_LOG_LEVEL lets it through.");

  // TieredAdamW checks every subgroup before updating any of them (dynamic loss scaling must skip
  // the whole step), so the check is exposed on its own.
  m.def(
      "grads_finite_cpu",
      [](const CpuArray& grad, double grad_scale, double clip) {
        const memtide::tiering::DType dt = dlpack_dtype(grad.dtype());
        if (dt == memtide::tiering::DType::none) value_error("grads_finite_cpu: grad must be float32, float16 or bfloat16");
        const void* data = grad.data();
        const std::size_t n = grad.size();
        nb::gil_scoped_release nogil;
        return memtide::tiering::grads_finite(data, dt, n, grad_scale, clip, &memtide::default_pool());
      },
      "grad"_a.noconvert(), "grad_scale"_a = 1.0, "clip"_a = 1.0,
      "True if every grad[i] * grad_scale * clip (rounded as adamw_step_cpu computes it) is finite.\n"
      "grad: contiguous CPU float32, float16 or bfloat16 array.");
  m.def("copy_grad_cpu", &copy_grad_cpu, "dst"_a.noconvert(), "src"_a.noconvert(), "out_stores"_a = "auto",
        "dst = src upcast to float32 (contiguous CPU arrays; src float32, float16 or bfloat16), the NaN/Inf\n"
        "check in the same pass: True if every element is finite. out_stores: \"cached\", \"streaming\"\n"
        "(non-temporal stores into dst) or \"auto\".");
  m.def("out_stores_for", [](std::size_t n) {
          return std::string(memtide::tiering::resolve_out_stores(memtide::tiering::OutStores::automatic, n) ==
                                     memtide::tiering::OutStores::streaming ? "streaming" : "cached");
        }, "n"_a, "What out_stores=\"auto\" becomes for a step over n params here: \"cached\" or \"streaming\".");
  m.def("last_level_cache_bytes", [] { return memtide::os::last_level_cache_bytes(); },
        "The last-level cache the first core shares, in bytes (0: unknown): the figure out_stores=\"auto\"\n"
        "compares the step's streams with.");
  m.def("stream_probe_cpu", &stream_probe_cpu, "p"_a.noconvert(), "m"_a.noconvert(), "v"_a.noconvert(),
        "g"_a.noconvert(), "out"_a.noconvert(), "threads"_a = 0,
        "tile"_a = memtide::tiering::kAdamwTile, "stream_out"_a = false, "stream_all"_a = false, "prefetch"_a = 0,
        "The fused AdamW step's memory roof: its streams (28 B/element) with almost no arithmetic, one\n"
        "way or another: threads (1, or 0 = the pool), tile (elements per task; 0 = one share per\n"
        "thread), stream_out (non-temporal stores for out), stream_all (for p, m and v too),\n"
        "prefetch (software prefetch distance in elements; 0 = none).");
  m.def("adamw_step_device", &adamw_step_device, "param"_a.noconvert(), "grad"_a.noconvert(),
        "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
        "weight_decay"_a, "step"_a, "grad_scale"_a = 1.0, "clip"_a = 1.0, "l2"_a = false,
        "out"_a.noconvert() = nb::none(), "stream"_a = 0,
        "Enqueues the fused AdamW step on the runtime's device (CUDA kernels on a GPU, the CPU kernel on\n"
        "SimDevice) on `stream` (a cudaStream_t as int; 0 = default). Arrays must live on that device.");
  m.def("convert_device", &convert_device, "dst"_a.noconvert(), "src"_a.noconvert(), "scale"_a = 1.0, "stream"_a = 0,
        "Enqueues dst = src * scale with fp32/fp16/bf16 conversion on the runtime's device.");
}

}  // namespace memtide::bindings
