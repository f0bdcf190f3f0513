#pragma once
// What the binding files of memtide._memtide (and memtide._sim, the simulator's extension) share:
// argument helpers and the bind functions each file defines. The bindings convert between Python and memtide's C++ API; they hold no logic.

#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/runtime/runtime.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/tiering/nvme/nvme_staging.hpp"
#include "memtide/cupti_tracer/tracer.hpp"

namespace nb = nanobind;

namespace memtide::bindings {

using namespace nb::literals;

[[noreturn]] inline void value_error(const std::string& message) { throw nb::value_error(message.c_str()); }

inline CachingAllocator& allocator(int device) { return Runtime::get().allocator(device); }

/// "cuda" or "sim".
inline const char* backend_name(memtide::Backend backend) {
  switch (backend) {
    case memtide::Backend::cuda: return "cuda";
    case memtide::Backend::sim: return "sim";
    case memtide::Backend::automatic: return "auto";
  }
  return "auto";
}

using CpuArray = nb::ndarray<nb::device::cpu, nb::c_contig>;

/// memtide's dtype of a DLPack dtype; none for anything but float32, float16 and bfloat16.
inline tiering::DType dlpack_dtype(const nb::dlpack::dtype& d) {
  using tiering::DType;
  const auto code = static_cast<nb::dlpack::dtype_code>(d.code);
  if (d.lanes != 1) return DType::none;
  if (code == nb::dlpack::dtype_code::Float && d.bits == 32) return DType::fp32;
  if (code == nb::dlpack::dtype_code::Float && d.bits == 16) return DType::fp16;
  if (code == nb::dlpack::dtype_code::Bfloat && d.bits == 16) return DType::bf16;
  return DType::none;
}

/// Version, backend, options, phases, headroom, stats, snapshots, trace replay, topology.
void bind_runtime(nb::module_& m);
/// Pinned host arrays from the HostArena.
void bind_host(nb::module_& m);
/// The optimizer kernels on their own: CPU AdamW, its memory roof, the device-side ops.
void bind_kernels(nb::module_& m);
/// The PerfModel, the layer window's sizing, the NVMe probe.
void bind_tiering(nb::module_& m);
/// The UpdateEngine and the typed results it hands over (Plan, StepReport, Segment).
void bind_engine(nb::module_& m);
/// CUPTI activity tracing.
void bind_tracing(nb::module_& m);
// Shared by the tiering, engine and simulator bindings (conversions.cpp, compiled into both extensions;
// count_arg and policy_arg in tiering.cpp).
std::size_t count_arg(const char* name, std::int64_t value);
tiering::Policy policy_arg(const std::string& name);
nb::dict rates_dict(const tiering::Rates& r);
/// Starts from the C++ defaults; `overrides` may set any subset of the fields.
tiering::Rates rates_arg(const std::optional<nb::dict>& overrides);
/// "cpu", "static", "interleaved" or "auto".
const char* policy_key(tiering::Policy p);
/// One letter per subgroup: c (CPU), g (streamed), s (GPU-static), d (done before the phase).
std::string placement_string(const std::vector<tiering::Placement>& placement);
nb::dict prediction_dict(const tiering::Prediction& p);
nb::dict plan_dict(const tiering::Plan& p);
/// The NVMe tier's transfers and waits as (what, subgroup, queued_s, start_s, end_s, bytes).
nb::list nvme_transfer_list(const std::vector<tiering::NvmeTransfer>& transfers);

}  // namespace memtide::bindings
