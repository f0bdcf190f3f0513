// memtide._memtide: the Python face of libmemtide.so. Everything goes through the shared
// library's C++ API (or its C ABI where that is the contract, as for snapshots), so Python, torch's
// CUDAPluggableAllocator and C callers share one Runtime.

#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <list>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <memory>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/stats.hpp"
#include "memtide/allocator/transformer_trace.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/options.hpp"
#include "memtide/device/device.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/device/topology.hpp"
#include "memtide/memtide.h"
#include "memtide/runtime.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"
#include "memtide/tiering/kernels/bandwidth_probe.hpp"
#include "memtide/tiering/calibration.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/optimizer_state.hpp"
#include "memtide/tiering/perf_model.hpp"
#include "memtide/tiering/update_scheduler.hpp"
#include "memtide/core/thread_pool.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// memtide._memtide.ConfigError, a ValueError: the CLI tells a bad MEMTIDE_* setting (exit 2, no
// traceback) apart from other errors by this type.
PyObject* g_config_error = nullptr;

[[noreturn]] void value_error(const std::string& message) { throw nb::value_error(message.c_str()); }

memtide::Phase phase_arg(const std::string& name, const char* argument) {
  const auto phase = memtide::parse_phase(name);
  if (!phase) {
    value_error(std::string(argument) + ": \"" + name + "\" is not a phase; expected forward, backward, update or other");
  }
  return *phase;
}

memtide::CachingAllocator& allocator(int device) { return memtide::Runtime::get().allocator(device); }

nb::dict watermark_dict(const memtide::PhaseWatermark& w) {
  nb::dict d;
  d["seen"] = w.seen;
  d["peak_allocated"] = w.peak_allocated;
  d["peak_reserved"] = w.peak_reserved;
  // A phase entered but never observed (nothing allocated or freed yet) has no low water.
  if (w.min_free == std::numeric_limits<std::uint64_t>::max()) {
    d["min_free"] = nb::none();
  } else {
    d["min_free"] = w.min_free;
  }
  d["duration_ns"] = w.duration_ns;
  return d;
}

nb::dict phases_dict(const memtide::IterationRecord& record) {
  nb::dict d;
  for (int i = 0; i < memtide::kPhaseCount; ++i) {
    const auto phase = static_cast<memtide::Phase>(i);
    d[memtide::phase_name(phase)] = watermark_dict(record.phases[static_cast<std::size_t>(i)]);
  }
  return d;
}

nb::dict iteration_dict(const memtide::IterationRecord& record) {
  nb::dict d;
  d["index"] = record.index;
  d["phases"] = phases_dict(record);
  return d;
}

nb::dict headroom_dict(const memtide::Headroom& h) {
  nb::dict d;
  d["bytes"] = h.bytes;
  d["limiting_phase"] = memtide::phase_name(h.limiting_phase);
  d["iterations_used"] = h.iterations_used;
  d["from_history"] = h.from_history;
  return d;
}

nb::dict phase_report_dict(const memtide::PhaseReport& r) {
  nb::dict d;
  d["current"] = memtide::phase_name(r.current);
  d["iterations"] = r.iterations;
  d["running"] = iteration_dict(r.running);
  nb::list history;
  for (const auto& record : r.history) history.append(iteration_dict(record));
  d["history"] = history;
  return d;
}

nb::dict cuda_status_dict() {
  const memtide::CudaStatus st = memtide::cuda_status();
  nb::dict d;
  d["compiled"] = st.compiled;
  d["usable"] = st.usable;
  d["device_count"] = st.device_count;
  d["runtime_version"] = st.runtime_version;
  d["driver_version"] = st.driver_version;
  d["reason"] = st.reason;
  return d;
}

nb::list option_table_list() {
  nb::list rows;
  for (const memtide::OptionInfo& row : memtide::option_table()) {
    nb::dict d;
    d["key"] = row.key;
    d["env"] = row.env;
    d["accepted"] = row.accepted;
    d["help"] = row.help;
    rows.append(d);
  }
  return rows;
}

const char* backend_name(memtide::Backend backend) {
  switch (backend) {
    case memtide::Backend::cuda: return "cuda";
    case memtide::Backend::sim: return "sim";
    case memtide::Backend::automatic: return "auto";
  }
  return "auto";
}

std::string library_path() {
  Dl_info info{};
  // Any symbol defined in libmemtide.so names the file the loader mapped, wherever it came from.
  if (dladdr(reinterpret_cast<void*>(&memtide_version), &info) == 0 || info.dli_fname == nullptr) {
    throw std::runtime_error("dladdr could not locate libmemtide.so");
  }
  // Not canonical(): torch should dlopen the very path already mapped, symlinks included.
  return std::filesystem::absolute(info.dli_fname).lexically_normal().string();
}

int shape_field(const char* name, std::int64_t value) {
  if (value <= 0) value_error(std::string("transformer shape: ") + name + " must be positive, got " + std::to_string(value));
  if (value > INT_MAX) {
    value_error(std::string("transformer shape: ") + name + " must be at most " + std::to_string(INT_MAX) + ", got " +
                std::to_string(value));
  }
  return static_cast<int>(value);
}

nb::dict replay_transformer(std::int64_t layers, std::int64_t hidden, std::int64_t heads, std::int64_t seq,
                            std::int64_t batch, std::int64_t vocab, std::int64_t iterations,
                            std::int64_t bytes_per_element, const std::string& backend,
                            std::optional<std::int64_t> sim_capacity) {
  memtide::TransformerShape shape;
  shape.layers = shape_field("layers", layers);
  shape.hidden = shape_field("hidden", hidden);
  shape.heads = shape_field("heads", heads);
  shape.seq = shape_field("seq", seq);
  shape.batch = shape_field("batch", batch);
  shape.vocab = shape_field("vocab", vocab);
  shape.iterations = shape_field("iterations", iterations);
  shape.bytes_per_element = shape_field("bytes_per_element", bytes_per_element);
  if (sim_capacity && *sim_capacity <= 0) {
    value_error("sim_capacity must be a positive number of bytes, got " + std::to_string(*sim_capacity));
  }

  memtide::ReplayResult result;
  memtide::DeviceProperties props;
  std::uint64_t limit = 0;
  {
    // Pure C++ from here on; other Python threads may run while the trace replays.
    nb::gil_scoped_release nogil;
    const memtide::Backend resolved = memtide::resolve_backend(memtide::parse_backend(backend));
    std::unique_ptr<memtide::Device> device;
    if (resolved == memtide::Backend::sim) {
      // Phantom: the trace is tens of GiB for real models; only addresses are needed.
      memtide::SimConfig config;
      config.phantom = true;
      config.capacity = sim_capacity ? static_cast<std::size_t>(*sim_capacity) : memtide::options().sim_capacity;
      device = std::make_unique<memtide::SimDevice>(config);
    } else {
      device = memtide::open_device(resolved, 0);
    }
    const std::vector<memtide::TraceOp> trace = memtide::make_transformer_trace(shape);
    memtide::CachingAllocator alloc(*device, memtide::AllocatorConfig::from_options());
    result = memtide::replay(alloc, trace);
    props = device->properties();
    limit = alloc.limit();
  }

  nb::dict d;
  d["ops"] = result.ops;
  d["peak_allocated"] = result.peak_allocated;
  d["peak_reserved"] = result.peak_reserved;
  d["reserved_over_allocated"] = result.reserved_over_allocated;
  d["seconds"] = result.seconds;
  d["update_headroom"] = headroom_dict(result.update_headroom);
  d["iterations_finished"] = result.phases.iterations;
  // The last finished iteration is the steady state (the first one also creates optimizer state).
  const memtide::IterationRecord& last =
      result.phases.history.empty() ? result.phases.running : result.phases.history.back();
  d["phases"] = phases_dict(last);
  d["device"] = props.name;
  d["backend"] = props.backend;
  d["device_memory"] = static_cast<std::uint64_t>(props.total_memory);
  d["limit"] = limit;
  d["params"] = shape.parameters();
  d["shape"] = shape.describe();
  return d;
}


// ---- topology -------------------------------------------------------------------------------

nb::list int_list(const std::vector<int>& values) {
  nb::list out;
  for (int v : values) out.append(v);
  return out;
}

nb::dict topology_dict(const std::optional<std::string>& path) {
  std::optional<memtide::Topology> topo;
  {
    // hwloc's discovery reads sysfs and can take a while on large machines.
    nb::gil_scoped_release nogil;
    topo = path ? memtide::Topology::from_xml(*path) : memtide::Topology::discover();
  }
  nb::dict d;
  d["source"] = topo->source();
  d["hwloc"] = memtide::hwloc_available();
  nb::list nodes;
  for (const memtide::NumaNode& n : topo->numa_nodes()) {
    nb::dict nd;
    nd["os_index"] = n.os_index;
    nd["memory_bytes"] = n.memory_bytes;
    nd["cpus"] = int_list(n.cpus);
    nodes.append(nd);
  }
  d["numa_nodes"] = nodes;
  nb::list gpus;
  nb::list links;
  const int count = static_cast<int>(topo->gpus().size());
  for (const memtide::GpuInfo& g : topo->gpus()) {
    nb::dict gd;
    gd["index"] = g.index;
    gd["pci_bus_id"] = g.pci_bus_id;
    gd["numa_nodes"] = int_list(g.numa_nodes);
    gd["cpus"] = int_list(g.cpus);
    gd["locality_known"] = g.locality_known;
    gd["name"] = g.name;
    gd["preferred_node"] = topo->preferred_node(g.index);
    gd["local_cpus"] = int_list(topo->local_cpus(g.index));
    nb::list pci_path;
    for (const std::string& hop : g.pci_path) pci_path.append(hop);
    gd["pci_path"] = pci_path;
    gpus.append(gd);
    nb::list row;
    for (int b = 0; b < count; ++b) row.append(std::string(memtide::link_name(topo->link(g.index, b))));
    links.append(row);
  }
  d["gpus"] = gpus;
  d["links"] = links;
  return d;
}

// ---- CPU AdamW ------------------------------------------------------------------------------

using CpuArray = nb::ndarray<nb::device::cpu, nb::c_contig>;

memtide::tiering::DType dlpack_dtype(const nb::dlpack::dtype& d) {
  using memtide::tiering::DType;
  const auto code = static_cast<nb::dlpack::dtype_code>(d.code);
  if (d.lanes != 1) return DType::none;
  if (code == nb::dlpack::dtype_code::Float && d.bits == 32) return DType::fp32;
  if (code == nb::dlpack::dtype_code::Float && d.bits == 16) return DType::fp16;
  if (code == nb::dlpack::dtype_code::Bfloat && d.bits == 16) return DType::bf16;
  return DType::none;
}

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

bool adamw_step_cpu(const CpuArray& param, const CpuArray& grad, const CpuArray& exp_avg, const CpuArray& exp_avg_sq,
                    double lr, double beta1, double beta2, double eps, double weight_decay, std::int64_t step,
                    double grad_scale, double clip, bool l2, std::optional<CpuArray> out, bool skip_if_nonfinite) {
  memtide::tiering::AdamwArgs a;
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


// ---- update-phase PerfModel ------------------------------------------------------------------

namespace tiering = memtide::tiering;

struct RateField {
  const char* key;
  double tiering::Rates::*member;
};
constexpr RateField kRateFields[] = {
    {"h2d_bytes_per_s", &tiering::Rates::h2d_bytes_per_s},
    {"d2h_bytes_per_s", &tiering::Rates::d2h_bytes_per_s},
    {"cpu_update_params_per_s", &tiering::Rates::cpu_update_params_per_s},
    {"gpu_update_params_per_s", &tiering::Rates::gpu_update_params_per_s},
    {"cpu_downscale_params_per_s", &tiering::Rates::cpu_downscale_params_per_s},
    {"host_dram_bytes_per_s", &tiering::Rates::host_dram_bytes_per_s},
    {"cpu_dram_bytes_per_param", &tiering::Rates::cpu_dram_bytes_per_param},
};

nb::dict rates_dict(const tiering::Rates& r) {
  nb::dict d;
  for (const RateField& f : kRateFields) d[f.key] = r.*f.member;
  return d;
}

// Starts from the C++ defaults; `overrides` may set any subset of the fields.
tiering::Rates rates_arg(const std::optional<nb::dict>& overrides) {
  tiering::Rates r;
  if (!overrides) return r;
  for (auto [key, value] : *overrides) {
    const std::string name = nb::cast<std::string>(key);
    bool known = false;
    for (const RateField& f : kRateFields) {
      if (name == f.key) {
        r.*f.member = nb::cast<double>(value);
        known = true;
      }
    }
    if (!known) {
      std::string keys;
      for (const RateField& f : kRateFields) keys += std::string(keys.empty() ? "" : ", ") + f.key;
      value_error("rates: unknown key \"" + name + "\"; known keys: " + keys);
    }
  }
  return r;
}

std::size_t count_arg(const char* name, std::int64_t value) {
  if (value < 0) value_error(std::string(name) + " must be >= 0, got " + std::to_string(value));
  return static_cast<std::size_t>(value);
}

tiering::Workload workload_arg(const std::vector<std::int64_t>& subgroup_params, std::int64_t low_precision_bytes,
                               bool grads_on_host, std::int64_t gpu_slot_limit, std::int64_t gpu_static_limit) {
  tiering::Workload w;
  w.subgroup_params.reserve(subgroup_params.size());
  for (std::int64_t p : subgroup_params) w.subgroup_params.push_back(count_arg("subgroup_params", p));
  w.low_precision_bytes = count_arg("low_precision_bytes", low_precision_bytes);
  w.grads_on_host = grads_on_host;
  w.gpu_slot_limit = count_arg("gpu_slot_limit", gpu_slot_limit);
  w.gpu_static_limit = count_arg("gpu_static_limit", gpu_static_limit);
  return w;
}

const char* policy_key(tiering::Policy p) {
  switch (p) {
    case tiering::Policy::cpu: return "cpu";
    case tiering::Policy::static_split: return "static";
    case tiering::Policy::interleaved: return "interleaved";
    case tiering::Policy::automatic: return "auto";
  }
  return "auto";
}

tiering::Policy policy_arg(const std::string& name) {
  for (auto p : {tiering::Policy::cpu, tiering::Policy::static_split, tiering::Policy::interleaved,
                 tiering::Policy::automatic}) {
    if (name == policy_key(p)) return p;
  }
  // The C++ enumerators' spellings are accepted too.
  if (name == "static_split") return tiering::Policy::static_split;
  if (name == "automatic") return tiering::Policy::automatic;
  value_error("policy: \"" + name + "\" is not a policy; expected cpu, static, interleaved or auto");
}

// One letter per subgroup: c (CPU), g (streamed through the GPU), s (GPU-static).
std::string placement_string(const std::vector<tiering::Placement>& placement) {
  std::string out;
  out.reserve(placement.size());
  for (tiering::Placement p : placement) {
    out += p == tiering::Placement::cpu ? 'c' : p == tiering::Placement::gpu ? 'g' : 's';
  }
  return out;
}

std::vector<tiering::Placement> placement_arg(const std::string& text) {
  std::vector<tiering::Placement> out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == 'c') out.push_back(tiering::Placement::cpu);
    else if (c == 'g') out.push_back(tiering::Placement::gpu);
    else if (c == 's') out.push_back(tiering::Placement::gpu_static);
    else value_error(std::string("placement: '") + c + "' is not a placement; expected c (CPU), g (streamed GPU) or s (GPU-static)");
  }
  return out;
}

nb::dict prediction_dict(const tiering::Prediction& p) {
  nb::dict d;
  d["total_ns"] = p.total_ns;
  d["bound_ns"] = p.bound_ns;
  d["cpu_ns"] = p.cpu_ns;
  d["gpu_ns"] = p.gpu_ns;
  d["h2d_ns"] = p.h2d_ns;
  d["d2h_ns"] = p.d2h_ns;
  d["dram_ns"] = p.dram_ns;
  d["busiest"] = p.busiest;
  d["h2d_bytes"] = p.h2d_bytes;
  d["d2h_bytes"] = p.d2h_bytes;
  d["dram_bytes"] = p.dram_bytes;
  return d;
}

nb::dict plan_dict(const tiering::Plan& p) {
  nb::dict d;
  d["policy"] = policy_key(p.policy);
  d["placement"] = placement_string(p.placement);
  d["k"] = p.k;
  d["gpu_slots"] = p.gpu_slots;
  d["gpu_streamed"] = p.gpu_streamed;
  d["static_residents"] = p.static_residents;
  d["prediction"] = prediction_dict(p.prediction);
  return d;
}

nb::dict plan_update(const std::vector<std::int64_t>& subgroup_params, const std::string& policy,
                     const std::optional<nb::dict>& rates, double static_fraction, double k,
                     std::int64_t low_precision_bytes, bool grads_on_host, std::int64_t gpu_slot_limit,
                     std::int64_t gpu_static_limit) {
  const tiering::Workload w =
      workload_arg(subgroup_params, low_precision_bytes, grads_on_host, gpu_slot_limit, gpu_static_limit);
  const tiering::Rates r = rates_arg(rates);
  const tiering::Policy pol = policy_arg(policy);
  tiering::Plan plan;
  {
    nb::gil_scoped_release nogil;
    plan = tiering::PerfModel{}.plan(w, r, pol, static_fraction, k);
  }
  return plan_dict(plan);
}

nb::dict predict_update(const std::vector<std::int64_t>& subgroup_params, const std::string& placement,
                        const std::optional<nb::dict>& rates, std::int64_t low_precision_bytes, bool grads_on_host,
                        std::int64_t gpu_slot_limit) {
  const tiering::Workload w = workload_arg(subgroup_params, low_precision_bytes, grads_on_host, gpu_slot_limit, 0);
  const tiering::Rates r = rates_arg(rates);
  const std::vector<tiering::Placement> pl = placement_arg(placement);
  tiering::Prediction p;
  {
    nb::gil_scoped_release nogil;
    p = tiering::PerfModel{}.predict(w, r, pl);
  }
  return prediction_dict(p);
}

// ---- pinned host memory -----------------------------------------------------------------------

memtide::HostArena& host_arena(int device, std::optional<int> numa_node) {
  memtide::Runtime& rt = memtide::Runtime::get();
  return numa_node ? rt.host_arena(device, *numa_node) : rt.host_arena(device);
}

// An array over a fresh buffer of the host arena. The owner capsule returns the buffer when the
// last view of it dies: the ndarray, or the torch tensor made from it with torch.from_dlpack.
nb::ndarray<> host_empty(const std::vector<std::int64_t>& shape, std::uint8_t code, std::uint8_t bits, int device,
                         std::optional<int> numa_node) {
  using nb::dlpack::dtype_code;
  const bool known = (code == static_cast<std::uint8_t>(dtype_code::Float) && (bits == 16 || bits == 32 || bits == 64)) ||
                     (code == static_cast<std::uint8_t>(dtype_code::Bfloat) && bits == 16) ||
                     (code == static_cast<std::uint8_t>(dtype_code::Int) && (bits == 8 || bits == 16 || bits == 32 || bits == 64)) ||
                     (code == static_cast<std::uint8_t>(dtype_code::UInt) && bits == 8);
  if (!known) value_error("host_empty: DLPack dtype (code " + std::to_string(code) + ", " + std::to_string(bits) + " bits) is not supported");
  std::size_t bytes = bits / 8;
  std::vector<std::size_t> dims;
  for (std::int64_t d : shape) {
    if (d < 0) value_error("host.empty: shape has a negative dimension (" + std::to_string(d) + ")");
    const auto u = static_cast<std::size_t>(d);
    if (u != 0 && bytes > SIZE_MAX / u) value_error("host.empty: shape holds more bytes than a size_t can count");
    bytes *= u;
    dims.push_back(u);
  }
  void* ptr = nullptr;
  {
    nb::gil_scoped_release nogil;  // a new slab maps, touches and registers: milliseconds
    // An empty tensor still gets a real buffer, so every tensor has a valid data pointer.
    ptr = host_arena(device, numa_node).allocate(bytes == 0 ? 1 : bytes);
  }
  nb::capsule owner(ptr, [](void* p) noexcept {
    try {
      memtide::Runtime::get().host_free(p);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "memtide: freeing a pinned host tensor failed: %s\n", e.what());
    }
  });
  nb::dlpack::dtype dt{code, bits, 1};
  return nb::ndarray<>(ptr, dims.size(), dims.data(), owner, nullptr, dt, nb::device::cpu::value, 0);
}

nb::dict host_stats(int device, std::optional<int> numa_node) {
  const memtide::HostArenaStats s = host_arena(device, numa_node).stats();
  nb::dict d;
  d["numa_node"] = host_arena(device, numa_node).config().numa_node;
  d["reserved_bytes"] = s.reserved_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["peak_allocated_bytes"] = s.peak_allocated_bytes;
  d["allocations"] = s.allocations;
  d["slabs"] = s.slabs;
  d["registered_slabs"] = s.registered_slabs;
  d["fallback_slabs"] = s.fallback_slabs;
  d["slabs_released"] = s.slabs_released;
  nb::dict per_node;
  for (const auto& [node, b] : s.bytes_per_node) per_node[nb::int_(node)] = b;
  d["bytes_per_node"] = per_node;
  d["map_bind_seconds"] = s.map_bind_seconds;
  d["touch_seconds"] = s.touch_seconds;
  d["register_seconds"] = s.register_seconds;
  return d;
}

nb::dict host_placement(std::uintptr_t address, std::size_t bytes, int device, std::optional<int> numa_node) {
  const memtide::PlacementReport r = host_arena(device, numa_node).verify_placement(reinterpret_cast<const void*>(address), bytes);
  nb::dict d;
  d["known"] = r.known;
  d["wanted_node"] = r.wanted_node;
  d["pages_sampled"] = r.pages_sampled;
  d["pages_not_present"] = r.pages_not_present;
  nb::dict per_node;
  for (const auto& [node, pages] : r.pages_per_node) per_node[nb::int_(node)] = pages;
  d["pages_per_node"] = per_node;
  d["on_wanted_node"] = r.on_wanted_node();
  d["reason"] = r.reason;
  return d;
}

// ---- UpdateEngine: TieredAdamW's flat buffers through the UpdateScheduler -------------------

// The range [start, end) of the flat buffers, the subgroup it lies in and the hyperparameters it
// is stepped with: one TieredAdamW Segment.
struct SegmentArg {
  std::size_t subgroup = 0, start = 0, end = 0;
  tiering::StepParams params;
};

// Segments stepped with the same hyperparameters share one scheduler run: StepParams holds one
// set, so a step with several param groups (or params at different step counts) is one run per set.
struct HyperKey {
  double lr, beta1, beta2, eps, weight_decay;
  std::int64_t step;
  bool operator<(const HyperKey& o) const {
    return std::tie(lr, beta1, beta2, eps, weight_decay, step) <
           std::tie(o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.step);
  }
};

void add_use(tiering::ResourceUse& into, const tiering::ResourceUse& from) {
  into.busy_ns += from.busy_ns;
  into.bytes += from.bytes;
  into.params += from.params;
  into.ops += from.ops;
}

nb::dict use_dict(const tiering::ResourceUse& u) {
  nb::dict d;
  d["busy_ns"] = u.busy_ns;
  d["bytes"] = u.bytes;
  d["params"] = u.params;
  d["ops"] = u.ops;
  return d;
}

constexpr std::size_t kSlotAlign = 512;  // the scheduler's device array alignment

/// Runs TieredAdamW's updates through an UpdateScheduler on the Runtime's device, over the
/// caller's flat fp32 buffers (external memory: no copy of the state is made), plans them with
/// the PerfModel on the Calibration's current rates and feeds each step's measurements back.
///
/// The host arrays hold the result of every step: static residents stay on the device between
/// steps but are copied back (sync_to_host) before step() returns, since the model reads the
/// host arrays (on the CPU its params are views of them). When the host arrays change outside
/// step() (a checkpoint load), host_changed() drops the residents' device copies.
class UpdateEngine {
 public:
  UpdateEngine(const CpuArray& param, const CpuArray& exp_avg, const CpuArray& exp_avg_sq, const CpuArray& grad,
               const std::vector<std::pair<std::int64_t, std::int64_t>>& subgroups, std::int64_t low_precision_bytes,
               int device)
      : allocator_(allocator(device)), device_(allocator_.device()) {
    n_ = param.size();
    param_ = flat_fp32(param, "param");
    exp_avg_ = flat_fp32(exp_avg, "exp_avg");
    exp_avg_sq_ = flat_fp32(exp_avg_sq, "exp_avg_sq");
    grad_ = flat_fp32(grad, "grad");
    if (low_precision_bytes != 2 && low_precision_bytes != 4) {
      value_error("UpdateEngine: low_precision_bytes must be 2 (fp16/bf16 model) or 4 (fp32 model), got " +
                  std::to_string(low_precision_bytes));
    }
    low_precision_bytes_ = static_cast<std::size_t>(low_precision_bytes);
    if (subgroups.empty()) value_error("UpdateEngine: subgroups is empty; at least one [start, end) range is needed");
    std::size_t expect = 0;
    for (auto [s, e] : subgroups) {
      if (s < 0 || e <= s || static_cast<std::size_t>(s) != expect || static_cast<std::size_t>(e) > n_) {
        value_error("UpdateEngine: subgroup [" + std::to_string(s) + ", " + std::to_string(e) +
                    ") is not the next non-empty range of the " + std::to_string(n_) +
                    "-element buffers (expected to start at " + std::to_string(expect) + ")");
      }
      subgroups_.emplace_back(static_cast<std::size_t>(s), static_cast<std::size_t>(e));
      expect = static_cast<std::size_t>(e);
    }
    sim_ = dynamic_cast<memtide::SimDevice*>(&device_);
    if (sim_ != nullptr && sim_->config().phantom) {
      value_error("UpdateEngine: the runtime's SimDevice is in phantom mode (MEMTIDE_SIM_PHANTOM=true), which holds "
                  "no bytes; the optimizer needs data mode (MEMTIDE_SIM_PHANTOM=false)");
    }
    // The SimDevice charges pageable rates for unregistered host memory; these buffers stand in
    // for the pinned ones a CUDA run has (torch pins them there), so register them on the sim.
    if (sim_ != nullptr) {
      for (float* p : {param_, exp_avg_, exp_avg_sq_, grad_}) {
        sim_->host_register(p, n_ * sizeof(float));
        registered_.push_back(p);
      }
    }
  }

  ~UpdateEngine() {
    try {
      // The host arrays hold every step's result (and maybe later changes): drop the residents'
      // device copies first, so the schedulers' destructors do not copy them back.
      for (Entry& e : cache_) e.scheduler->discard_residents();
      cache_.clear();
      for (float* p : registered_) device_.host_unregister(p);
    } catch (const memtide::Error&) {
      // Destructors never throw; the runtime may be shutting down.
    }
  }
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  nb::dict plan(const std::string& policy, std::optional<double> k, double static_fraction) {
    const tiering::Policy pol = policy_arg(policy);
    if (!(static_fraction >= 0 && static_fraction <= 1)) {
      value_error("UpdateEngine.plan: static_fraction must be in [0, 1], got " + std::to_string(static_fraction));
    }
    if (k && !(*k > 0)) value_error("UpdateEngine.plan: k must be None or > 0, got " + std::to_string(*k));
    tiering::Plan p;
    std::uint64_t headroom = 0;
    std::string headroom_from;
    std::string reason;
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);
      tiering::Workload w = workload(headroom, headroom_from);
      if (!tiering::device_ops_available(device_)) {
        // A GPU placement would throw half-way through a step: plan none.
        w.gpu_slot_limit = 0;
        w.gpu_static_limit = 0;
        reason = "this build has no CUDA optimizer kernels: every subgroup on the CPU";
      }
      const tiering::Rates rates = calibration_.rates();
      const std::size_t n = subgroups_.size();
      if (pol == tiering::Policy::automatic && !k) {
        p = model_.plan(w, rates, pol, static_fraction, 2);
      } else {
        // TieredAdamW's policies (memtide.optim.policy_placement): static residents are the last
        // round(fraction * n) subgroups; interleaved (and auto with a given k) also streams one in
        // every k + 1 of the others (k CPU : 1 GPU), i.e. the PerfModel's stride k + 1.
        std::size_t statics = 0;
        if (pol != tiering::Policy::cpu) {
          statics = static_cast<std::size_t>(std::llround(static_fraction * static_cast<double>(n)));
          if (statics > w.gpu_static_limit && reason.empty()) {
            reason = "headroom fits " + std::to_string(w.gpu_static_limit) + " static residents, the policy asked for " +
                     std::to_string(statics);
            statics = w.gpu_static_limit;
          }
        }
        double stride = 0;
        statics = std::min(statics, w.gpu_static_limit);
        if (pol == tiering::Policy::interleaved || pol == tiering::Policy::automatic) {
          stride = (k ? *k : 1.0) + 1.0;
          if (w.gpu_slot_limit == 0) {
            if (tiering::device_ops_available(device_)) reason += (reason.empty() ? "" : "; ") +
                                                                   std::string("headroom fits no GPU slot: nothing streamed");
            stride = 0;
          }
        }
        p.policy = pol;
        p.placement = tiering::interleave(n, stride, statics);
        p.k = stride;
        p.static_residents = statics;
        p.gpu_streamed = static_cast<std::size_t>(
            std::count(p.placement.begin(), p.placement.end(), tiering::Placement::gpu));
        p.gpu_slots = p.gpu_streamed > 0 ? std::min<std::size_t>(w.gpu_slot_limit, 3) : 0;
        p.prediction = model_.predict(w, rates, p.placement);
      }
    }
    nb::dict d = plan_dict(p);
    d["reason"] = reason;
    d["headroom_bytes"] = headroom;
    d["headroom_from"] = headroom_from;
    return d;
  }

  nb::dict step(const std::string& placement, std::int64_t gpu_slots, double predicted_ns, const nb::list& segments,
                double grad_scale, double clip, bool l2, bool skip_if_nonfinite) {
    const std::vector<tiering::Placement> place = placement_arg(placement);
    if (place.size() != subgroups_.size()) {
      value_error("UpdateEngine.step: placement has " + std::to_string(place.size()) + " letters, there are " +
                  std::to_string(subgroups_.size()) + " subgroups");
    }
    const std::size_t slots = count_arg("gpu_slots", gpu_slots);
    std::vector<SegmentArg> segs;
    segs.reserve(segments.size());
    for (nb::handle h : segments) {
      // (subgroup, start, end, lr, beta1, beta2, eps, weight_decay, step)
      nb::tuple t = nb::cast<nb::tuple>(h);
      if (t.size() != 9) value_error("UpdateEngine.step: a segment is (subgroup, start, end, lr, beta1, beta2, eps, weight_decay, step)");
      SegmentArg s;
      s.subgroup = nb::cast<std::size_t>(t[0]);
      s.start = nb::cast<std::size_t>(t[1]);
      s.end = nb::cast<std::size_t>(t[2]);
      if (s.subgroup >= subgroups_.size() || s.start < subgroups_[s.subgroup].first || s.end > subgroups_[s.subgroup].second ||
          s.end <= s.start) {
        value_error("UpdateEngine.step: segment [" + std::to_string(s.start) + ", " + std::to_string(s.end) +
                    ") is empty or not inside subgroup " + std::to_string(s.subgroup));
      }
      s.params.lr = nb::cast<double>(t[3]);
      s.params.beta1 = nb::cast<double>(t[4]);
      s.params.beta2 = nb::cast<double>(t[5]);
      s.params.eps = nb::cast<double>(t[6]);
      s.params.weight_decay = nb::cast<double>(t[7]);
      s.params.step = nb::cast<std::int64_t>(t[8]);
      s.params.grad_scale = grad_scale;
      s.params.clip = clip;
      s.params.l2 = l2;
      s.params.grads_finite = true;  // checked below, once for the whole step
      segs.push_back(s);
    }

    tiering::StepReport total;
    bool nonfinite = false;
    bool skipped = false;
    std::size_t runs = 0;
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);
      for (const SegmentArg& s : segs) {
        if (!tiering::grads_finite(grad_ + s.start, tiering::DType::fp32, s.end - s.start, grad_scale, clip,
                                   &memtide::default_pool())) {
          nonfinite = true;
          break;
        }
      }
      skipped = nonfinite && skip_if_nonfinite;
      if (!skipped && !segs.empty()) {
        std::map<HyperKey, std::vector<const SegmentArg*>> by_key;
        for (const SegmentArg& s : segs) {
          const auto& p = s.params;
          by_key[HyperKey{p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.step}].push_back(&s);
        }
        std::vector<tiering::UpdateScheduler*> used;
        for (auto& [key, list] : by_key) {
          std::vector<std::pair<std::size_t, std::size_t>> ranges;
          tiering::Plan plan;
          plan.gpu_slots = slots;
          for (const SegmentArg* s : list) {
            ranges.emplace_back(s->start, s->end);
            plan.placement.push_back(place[s->subgroup]);
          }
          tiering::UpdateScheduler& scheduler = scheduler_for(ranges);
          const tiering::StepReport r = scheduler.run(plan, list.front()->params);
          used.push_back(&scheduler);
          ++runs;
          total.phase_ns += r.phase_ns;
          add_use(total.cpu, r.cpu);
          add_use(total.gpu, r.gpu);
          add_use(total.h2d, r.h2d);
          add_use(total.d2h, r.d2h);
          total.h2d_d2h_overlap_ns += r.h2d_d2h_overlap_ns;
          total.params_cpu += r.params_cpu;
          total.params_gpu += r.params_gpu;
          total.params_gpu_static += r.params_gpu_static;
          total.setup_allocations += r.setup_allocations;
          total.loop_allocations += r.loop_allocations;
          total.loop_device_allocs += r.loop_device_allocs;
        }
        // Into the host arrays, which the model reads (see the class comment). A scheduler not
        // used in this step holds residents older than the host arrays now: they go.
        for (Entry& e : cache_) {
          if (std::find(used.begin(), used.end(), e.scheduler.get()) != used.end()) {
            e.scheduler->sync_to_host();
          } else {
            e.scheduler->discard_residents();
          }
        }
        // This step's schedulers are at the front (most recently used); older ones, their
        // residents just dropped, make room.
        while (cache_.size() > std::max(kCacheEntries, used.size())) cache_.pop_back();
        observe(total, predicted_ns);
      }
    }

    nb::dict d;
    d["nonfinite"] = nonfinite;
    d["skipped"] = skipped;
    d["runs"] = runs;
    d["measured_ns"] = total.phase_ns;
    d["clock"] = sim_ != nullptr ? "simulated" : "wall";
    d["predicted_ns"] = predicted_ns;
    d["cpu"] = use_dict(total.cpu);
    d["gpu"] = use_dict(total.gpu);
    d["h2d"] = use_dict(total.h2d);
    d["d2h"] = use_dict(total.d2h);
    d["h2d_d2h_overlap_ns"] = total.h2d_d2h_overlap_ns;
    d["params_cpu"] = total.params_cpu;
    d["params_gpu"] = total.params_gpu;
    d["params_gpu_static"] = total.params_gpu_static;
    d["loop_allocations"] = total.loop_allocations;
    d["loop_device_allocs"] = total.loop_device_allocs;
    return d;
  }

  void host_changed() {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    for (Entry& e : cache_) e.scheduler->discard_residents();
  }

  nb::dict rates() const { return rates_dict(calibration_.rates()); }

  nb::dict errors() const {
    const tiering::PredictionErrors e = calibration_.error_summary();
    nb::dict d;
    d["count"] = e.count;
    d["last"] = e.last;
    d["mean_abs"] = e.mean_abs;
    d["max_abs"] = e.max_abs;
    return d;
  }

  std::string device_name() { return device_.properties().name; }
  bool simulated() const { return sim_ != nullptr; }

 private:
  static constexpr std::size_t kCacheEntries = 4;

  struct Entry {
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    std::unique_ptr<tiering::OptimizerState> state;
    std::unique_ptr<tiering::UpdateScheduler> scheduler;
  };

  float* flat_fp32(const CpuArray& a, const char* name) const {
    if (array_dtype(a, name) != tiering::DType::fp32) value_error(std::string("UpdateEngine: ") + name + " must be float32");
    if (a.size() != n_) {
      value_error(std::string("UpdateEngine: ") + name + " has " + std::to_string(a.size()) + " elements, param has " +
                  std::to_string(n_));
    }
    if (n_ == 0) value_error(std::string("UpdateEngine: ") + name + " is empty");
    return static_cast<float*>(a.data());
  }

  // A scheduler over exactly `ranges` of the flat buffers. The usual step (one param group, every
  // param with a gradient) always asks for the same ranges, so a small cache keeps it built.
  tiering::UpdateScheduler& scheduler_for(const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->ranges == ranges) {
        if (it != cache_.begin()) cache_.splice(cache_.begin(), cache_, it);
        return *cache_.front().scheduler;
      }
    }
    std::vector<tiering::ExternalSubgroup> ext;
    ext.reserve(ranges.size());
    for (auto [s, e] : ranges) {
      ext.push_back(tiering::ExternalSubgroup{param_ + s, exp_avg_ + s, exp_avg_sq_ + s, grad_ + s, e - s});
    }
    Entry entry;
    entry.ranges = ranges;
    entry.state = tiering::OptimizerState::external(device_, ext);
    entry.scheduler = std::make_unique<tiering::UpdateScheduler>(*entry.state, allocator_, &memtide::default_pool());
    cache_.push_front(std::move(entry));
    return *cache_.front().scheduler;
  }

  // What the planner may use: slots and static residents in the update headroom (the
  // PhaseTracker's, once an iteration has finished; the device's free memory before that).
  tiering::Workload workload(std::uint64_t& headroom, std::string& from) {
    tiering::Workload w;
    std::size_t largest = 0;
    for (auto [s, e] : subgroups_) {
      w.subgroup_params.push_back(e - s);
      largest = std::max(largest, e - s);
    }
    w.low_precision_bytes = low_precision_bytes_;
    w.grads_on_host = true;
    const memtide::Headroom h = allocator_.headroom(memtide::Phase::forward);
    // The tracker sees only this allocator's blocks (not torch's own, when torch is not using
    // memtide), so the device's free memory caps it.
    const std::uint64_t free = device_.mem_info().free;
    if (h.from_history && h.bytes <= free) {
      headroom = h.bytes;
      from = "phase tracker (" + std::to_string(h.iterations_used) + " iterations)";
    } else {
      headroom = free;
      from = "device free memory";
    }
    const std::size_t array = (largest * sizeof(float) + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
    const std::uint64_t slot = 4 * array;
    const std::size_t n = subgroups_.size();
    w.gpu_slot_limit = static_cast<std::size_t>(std::min<std::uint64_t>(headroom / slot, n));
    const std::uint64_t slot_bytes = std::min<std::uint64_t>(w.gpu_slot_limit, 3) * slot;
    w.gpu_static_limit =
        headroom > slot_bytes ? static_cast<std::size_t>(std::min<std::uint64_t>((headroom - slot_bytes) / slot, n)) : 0;
    return w;
  }

  void observe(const tiering::StepReport& r, double predicted_ns) {
    if (r.cpu.busy_ns > 0 && r.cpu.params > 0) {
      calibration_.observe_cpu_update(static_cast<std::size_t>(r.cpu.params), r.cpu.busy_ns);
    }
    if (r.gpu.busy_ns > 0 && r.gpu.params > 0) {
      calibration_.observe_gpu_update(static_cast<std::size_t>(r.gpu.params), r.gpu.busy_ns);
    }
    if (r.h2d.busy_ns > 0 && r.h2d.bytes > 0) {
      calibration_.observe_copy(CopyKindH2D, static_cast<std::size_t>(r.h2d.bytes), r.h2d.busy_ns);
    }
    if (r.d2h.busy_ns > 0 && r.d2h.bytes > 0) {
      calibration_.observe_copy(CopyKindD2H, static_cast<std::size_t>(r.d2h.bytes), r.d2h.busy_ns);
    }
    if (predicted_ns > 0 && r.phase_ns > 0 && std::isfinite(predicted_ns)) {
      calibration_.observe_update_phase(predicted_ns, r.phase_ns);
    }
  }

  static constexpr memtide::CopyKind CopyKindH2D = memtide::CopyKind::host_to_device;
  static constexpr memtide::CopyKind CopyKindD2H = memtide::CopyKind::device_to_host;

  memtide::CachingAllocator& allocator_;
  memtide::Device& device_;
  memtide::SimDevice* sim_ = nullptr;
  std::size_t n_ = 0;
  float* param_ = nullptr;
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
  float* grad_ = nullptr;
  std::size_t low_precision_bytes_ = 2;
  std::vector<std::pair<std::size_t, std::size_t>> subgroups_;
  std::vector<float*> registered_;
  tiering::PerfModel model_;
  tiering::Calibration calibration_;
  std::list<Entry> cache_;  // most recently used first
  std::mutex mutex_;
};

// ---- kernels on their own: the CPU memory roof and the device-side step (benchmarks) ---------

void stream_probe_cpu(const CpuArray& p, const CpuArray& m, const CpuArray& v, const CpuArray& g, const CpuArray& out) {
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
  nb::gil_scoped_release nogil;
  memtide::tiering::stream_probe(static_cast<float*>(p.data()), static_cast<float*>(m.data()),
                                 static_cast<float*>(v.data()), static_cast<const std::uint16_t*>(g.data()),
                                 static_cast<std::uint16_t*>(out.data()), n, &memtide::default_pool());
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

NB_MODULE(_memtide, m) {
  m.doc() = "memtide's native module: allocator runtime, options, phases, snapshots and trace replay.";

  g_config_error = PyErr_NewExceptionWithDoc("memtide._memtide.ConfigError",
                                             "A MEMTIDE_* setting (or backend name) has a value memtide does not accept.",
                                             PyExc_ValueError, nullptr);
  if (g_config_error == nullptr) throw nb::python_error();
  m.attr("ConfigError") = nb::handle(g_config_error);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const memtide::OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const memtide::ConfigError& e) {
      PyErr_SetString(g_config_error, e.what());
    } catch (const memtide::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const memtide::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("version", [] { return std::string(memtide_version()); }, "memtide's version, e.g. \"0.1.0\".");
  m.def("backend", [] { return std::string(backend_name(memtide::Runtime::get().backend())); },
        "The backend the runtime's allocators use: \"cuda\" or \"sim\" (MEMTIDE_DEVICE resolved).");
  m.def("resolve_backend",
        [](const std::string& name) { return std::string(backend_name(memtide::resolve_backend(memtide::parse_backend(name)))); },
        "name"_a, "What \"auto\", \"cuda\" or \"sim\" resolves to on this machine.");
  m.def("cuda_status", &cuda_status_dict, "Whether CUDA is compiled in and usable here, and why not.");
  m.def("device_count", [] { return memtide::Runtime::get().device_count(); }, "Devices the runtime's backend offers.");

  m.def("options", [] { return memtide::describe(memtide::options()); },
        "Current option values as strings, keyed by option name. Raises ConfigError for a bad MEMTIDE_* value.");
  m.def("option_table", &option_table_list, "Every option: key, env, accepted values and help.");

  m.def(
      "mark_phase",
      [](const std::string& name) {
        const memtide::Phase phase = phase_arg(name, "mark_phase");
        memtide::Runtime& rt = memtide::Runtime::get();
        for (int d = 0; d < rt.device_count(); ++d) rt.allocator(d).mark_phase(phase);
      },
      "name"_a, "Enters a training phase (forward, backward, update, other) on every device.");
  m.def(
      "headroom",
      [](int device, const std::string& until, std::optional<std::int64_t> margin) {
        const memtide::Phase phase = phase_arg(until, "headroom: until");
        std::optional<std::uint64_t> keep;
        if (margin) {
          if (*margin < 0) value_error("headroom: margin must be >= 0, got " + std::to_string(*margin));
          keep = static_cast<std::uint64_t>(*margin);
        }
        return headroom_dict(allocator(device).headroom(phase, keep));
      },
      "device"_a = 0, "until"_a = "forward", "margin"_a = nb::none(),
      "Bytes that can be borrowed on `device` now and kept until phase `until` begins.");

  m.def("stats", [](int device) { return memtide::flatten(allocator(device).stats()); }, "device"_a = 0,
        "Allocator statistics with torch.cuda.memory_stats() names.");
  m.def("reset_peak_stats", [](int device) { allocator(device).reset_peak_stats(); }, "device"_a = 0,
        "Resets every peak statistic of `device` to its current value.");
  m.def(
      "empty_cache",
      [] {
        for (memtide::CachingAllocator* a : memtide::Runtime::get().opened()) {
          if (a != nullptr) a->empty_cache();
        }
      },
      "Returns every fully free cached segment to its device.");
  m.def(
      "record_history",
      [](bool enabled) {
        memtide::Runtime& rt = memtide::Runtime::get();
        for (int d = 0; d < rt.device_count(); ++d) rt.allocator(d).set_record_history(enabled);
      },
      "enabled"_a, "Turns the allocation trace used by snapshots on or off.");
  m.def(
      "dump_snapshot",
      [](const std::filesystem::path& path) {
        const std::string p = path.string();
        int rc = 0;
        {
          nb::gil_scoped_release nogil;
          rc = memtide_dump_snapshot(p.c_str());
        }
        if (rc != MEMTIDE_OK) throw std::runtime_error(std::string("dump_snapshot: ") + memtide_last_error());
      },
      "path"_a, "Writes a pickle that pytorch.org/memory_viz and torch.cuda._memory_viz read.");
  m.def("phase_report", [](int device) { return phase_report_dict(allocator(device).phase_report()); },
        "device"_a = 0, "Current phase, finished iterations and per-phase watermarks (running + remembered).");
  m.def("library_path", &library_path, "Absolute path of the loaded libmemtide.so (for CUDAPluggableAllocator).");

  m.def("replay_transformer", &replay_transformer, "layers"_a, "hidden"_a, "heads"_a, "seq"_a, "batch"_a, "vocab"_a,
        "iterations"_a, "bytes_per_element"_a = 2, "backend"_a = "auto", "sim_capacity"_a = nb::none(),
        "Replays the allocation trace of GPT-style training through a fresh CachingAllocator.\n\n"
        "On the sim backend the device is a phantom SimDevice (no bytes held) of `sim_capacity` bytes\n"
        "(default: MEMTIDE_SIM_CAPACITY). Returns peaks, per-phase watermarks of the last iteration,\n"
        "the update-phase headroom and timing.");

  m.def("adamw_step_cpu", &adamw_step_cpu, "param"_a.noconvert(), "grad"_a.noconvert(), "exp_avg"_a.noconvert(),
        "exp_avg_sq"_a.noconvert(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a, "step"_a,
        "grad_scale"_a = 1.0, "clip"_a = 1.0, "l2"_a = false, "out"_a.noconvert() = nb::none(),
        "skip_if_nonfinite"_a = false,
        "One fused AdamW (or, with l2=True, Adam with L2) step in place on contiguous CPU arrays\n"
        "(numpy or torch, via DLPack): param, exp_avg, exp_avg_sq float32; grad float32, float16 or\n"
        "bfloat16, multiplied by grad_scale then clip; `out` (float16 or bfloat16) receives the new params.\n"
        "`step` is the 1-based step count including this one. Returns True if a scaled gradient was\n"
        "NaN/Inf (with skip_if_nonfinite the state is then left untouched).");
  m.def("topology", &topology_dict, "path"_a = nb::none(),
        "The GPU/NUMA topology as plain dicts and lists: `source`, `hwloc` (built with hwloc),\n"
        "`numa_nodes` [{os_index, memory_bytes, cpus}], `gpus` [{index, pci_bus_id, numa_nodes, cpus,\n"
        "locality_known, name, preferred_node, local_cpus, pci_path}] and `links`, the GPU x GPU matrix\n"
        "of nvidia-smi topo -m classes (X, PIX, PXB, PHB, NODE, SYS). `path`: an hwloc XML file to load\n"
        "instead of discovering this machine (MEMTIDE_TOPOLOGY, else hwloc, else sysfs).");
  m.def("cpu_isa", [] { return std::string(memtide::tiering::adamw_isa()); },
        "The vector path of the CPU optimizer kernels: scalar, avx2 or avx512 (MEMTIDE_CPU_ISA resolved).");
  m.def("host_empty", &host_empty, "shape"_a, "code"_a, "bits"_a, "device"_a = 0, "numa_node"_a = nb::none(),
        "An uninitialized pinned host array (DLPack type code and bits) from the device's host arena;\n"
        "the buffer goes back to the arena when the array and every tensor made from it are gone.\n"
        "Use memtide.host.empty for torch tensors.");
  m.def("host_stats", &host_stats, "device"_a = 0, "numa_node"_a = nb::none(),
        "Statistics of the pinned host arena of `device` (on `numa_node`, default: the device's node).");
  m.def(
      "host_release_free_slabs",
      [](int device, std::optional<int> numa_node) {
        nb::gil_scoped_release nogil;
        return host_arena(device, numa_node).release_free_slabs();
      },
      "device"_a = 0, "numa_node"_a = nb::none(), "Unmaps the arena's slabs that hold no live buffer; returns the bytes.");
  m.def("host_node", [](int device) { return memtide::Runtime::get().host_node(device); }, "device"_a = 0,
        "The NUMA node whose memory serves `device`'s pinned host buffers (-1 = not bound).");
  m.def("host_placement", &host_placement, "address"_a, "bytes"_a, "device"_a = 0, "numa_node"_a = nb::none(),
        "Which NUMA nodes sampled pages of [address, address + bytes) are on (move_pages).");
  m.def("cpu_threads", [] { return memtide::default_pool().size(); },
        "Threads of the process-wide CPU kernel pool (the caller included).");

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
  m.def("default_rates", [] { return rates_dict(tiering::Rates{}); },
        "The update-phase PerfModel's default rates (bytes/s, params/s, bytes/param), keyed by field.");
  m.def("plan_update", &plan_update, "subgroup_params"_a, "policy"_a = "auto", "rates"_a = nb::none(),
        "static_fraction"_a = 0.2, "k"_a = 2.0, "low_precision_bytes"_a = 2, "grads_on_host"_a = true,
        "gpu_slot_limit"_a = 3, "gpu_static_limit"_a = 0,
        "The PerfModel's update-phase plan for `policy` (cpu, static, interleaved, auto).\n\n"
        "`rates` overrides any of default_rates(). Returns policy, placement (one letter per subgroup:\n"
        "c CPU, g streamed GPU, s GPU-static), k, gpu_slots, gpu_streamed, static_residents and the\n"
        "prediction (total_ns, bound_ns, per-resource busy ns, busiest, bytes moved).");
  m.def("predict_update", &predict_update, "subgroup_params"_a, "placement"_a, "rates"_a = nb::none(),
        "low_precision_bytes"_a = 2, "grads_on_host"_a = true, "gpu_slot_limit"_a = 3,
        "The PerfModel's predicted update phase for `placement` (one letter per subgroup: c, g, s).");

  nb::class_<UpdateEngine>(m, "UpdateEngine",
                           "TieredAdamW's update through the UpdateScheduler on the runtime's device (a data-mode\n"
                           "SimDevice without a GPU), planned by the PerfModel on calibrated rates.")
      .def(nb::init<const CpuArray&, const CpuArray&, const CpuArray&, const CpuArray&,
                    const std::vector<std::pair<std::int64_t, std::int64_t>>&, std::int64_t, int>(),
           "param"_a.noconvert(), "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(), "grad"_a.noconvert(),
           "subgroups"_a, "low_precision_bytes"_a = 2, "device"_a = 0,
           // The engine keeps raw pointers into the four arrays: they live as long as it does.
           nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(), nb::keep_alive<1, 4>(), nb::keep_alive<1, 5>(),
           "Over the caller's contiguous float32 CPU arrays (no copy is made; they are kept alive),\n"
           "cut into `subgroups`, consecutive [start, end) ranges covering them.")
      .def("plan", &UpdateEngine::plan, "policy"_a, "k"_a = nb::none(), "static_fraction"_a = 0.0,
           "The plan of `policy` (cpu, static, interleaved, auto) with TieredAdamW's k (CPU subgroups per\n"
           "GPU subgroup; None: the PerfModel picks under auto) in the current update headroom, on the\n"
           "calibrated rates. Returns placement (c/g/s per subgroup), k (PerfModel stride), gpu_slots,\n"
           "prediction, reason, headroom_bytes, headroom_from.")
      .def("step", &UpdateEngine::step, "placement"_a, "gpu_slots"_a, "predicted_ns"_a, "segments"_a,
           "grad_scale"_a = 1.0, "clip"_a = 1.0, "l2"_a = false, "skip_if_nonfinite"_a = false,
           "One update phase. segments: (subgroup, start, end, lr, beta1, beta2, eps, weight_decay, step)\n"
           "tuples; segments with the same hyperparameters share one scheduler run. Returns nonfinite,\n"
           "skipped, measured_ns (clock: simulated on a SimDevice, else wall), predicted_ns, per-resource\n"
           "use and params updated per placement. Calibration learns from every step.")
      .def("host_changed", &UpdateEngine::host_changed,
           "The host arrays were changed outside step(): GPU-static residents are dropped and moved in\n"
           "again from the host on the next step.")
      .def("rates", &UpdateEngine::rates, "The Calibration's current rates.")
      .def("prediction_errors", &UpdateEngine::errors, "Recent (measured - predicted) / predicted of whole phases.")
      .def_prop_ro("device_name", &UpdateEngine::device_name)
      .def_prop_ro("simulated", &UpdateEngine::simulated);

  m.def("stream_probe_cpu", &stream_probe_cpu, "p"_a.noconvert(), "m"_a.noconvert(), "v"_a.noconvert(),
        "g"_a.noconvert(), "out"_a.noconvert(),
        "The fused AdamW step's memory roof: its streams (28 B/element) with almost no arithmetic.");
  m.def("adamw_step_device", &adamw_step_device, "param"_a.noconvert(), "grad"_a.noconvert(),
        "exp_avg"_a.noconvert(), "exp_avg_sq"_a.noconvert(), "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
        "weight_decay"_a, "step"_a, "grad_scale"_a = 1.0, "clip"_a = 1.0, "l2"_a = false,
        "out"_a.noconvert() = nb::none(), "stream"_a = 0,
        "Enqueues the fused AdamW step on the runtime's device (CUDA kernels on a GPU, the CPU kernel on\n"
        "SimDevice) on `stream` (a cudaStream_t as int; 0 = default). Arrays must live on that device.");
  m.def("convert_device", &convert_device, "dst"_a.noconvert(), "src"_a.noconvert(), "scale"_a = 1.0, "stream"_a = 0,
        "Enqueues dst = src * scale with fp32/fp16/bf16 conversion on the runtime's device.");
}
