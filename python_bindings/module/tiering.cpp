// memtide._memtide: the update-phase PerfModel (plans, predictions, fitting device memory) and the
// UpdateEngine that TieredAdamW drives.

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/model/calibration.hpp"
#include "memtide/tiering/window/layer_window.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/core/error.hpp"
#if MEMTIDE_HAVE_NVME
#include "memtide/tiering/nvme/nvme_store.hpp"
#endif
#include "memtide/tiering/engine/update_engine.hpp"
#include "common.hpp"

#include <nanobind/stl/tuple.h>

namespace memtide::bindings {

// ---- update-phase PerfModel ------------------------------------------------------------------

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

std::vector<tiering::Placement> placement_arg(const std::string& text) {
  std::vector<tiering::Placement> out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == 'c') out.push_back(tiering::Placement::cpu);
    else if (c == 'g') out.push_back(tiering::Placement::gpu);
    else if (c == 's') out.push_back(tiering::Placement::gpu_static);
    else if (c == 'd') out.push_back(tiering::Placement::done);
    else value_error(std::string("placement: '") + c + "' is not a placement; expected c (CPU), g (streamed GPU), s (GPU-static) "
                     "or d (done: updated before the phase)");
  }
  return out;
}

namespace {

nb::dict plan_update(const std::vector<std::int64_t>& subgroup_params, const std::string& policy,
                     const std::optional<nb::dict>& rates, double static_fraction, std::optional<double> k,
                     std::int64_t low_precision_bytes, bool grads_on_host, std::int64_t gpu_slot_limit,
                     std::int64_t gpu_static_limit, const std::optional<std::vector<bool>>& on_nvme,
                     std::int64_t nvme_read_ahead) {
  tiering::Workload w =
      workload_arg(subgroup_params, low_precision_bytes, grads_on_host, gpu_slot_limit, gpu_static_limit);
  if (on_nvme) w.on_nvme = *on_nvme;
  w.nvme_read_ahead = count_arg("nvme_read_ahead", nvme_read_ahead);
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

// ---- fitting device memory -------------------------------------------------------------------

std::vector<bool> fit_host_budget(const std::vector<std::int64_t>& subgroup_params, std::int64_t host_budget_bytes,
                                  std::int64_t gpu_static_limit, std::int64_t nvme_read_ahead) {
  tiering::Workload w = workload_arg(subgroup_params, 2, true, 0, gpu_static_limit);
  w.nvme_read_ahead = count_arg("nvme_read_ahead", nvme_read_ahead);
  tiering::fit_host_budget(w, count_arg("host_budget_bytes", host_budget_bytes));
  return w.on_nvme.empty() ? std::vector<bool>(w.subgroup_params.size(), false) : w.on_nvme;
}

nb::dict fit_gpu_budget(const std::vector<std::int64_t>& subgroup_params, std::int64_t update_bytes,
                        std::int64_t resident_bytes, bool grads_on_host) {
  tiering::Workload w = workload_arg(subgroup_params, 2, grads_on_host, 0, 0);
  tiering::fit_gpu_budget(w, tiering::GpuBudget{count_arg("update_bytes", update_bytes),
                                                count_arg("resident_bytes", resident_bytes)});
  std::size_t largest = 0;
  for (std::size_t n : w.subgroup_params) largest = std::max(largest, n);
  nb::dict d;
  d["gpu_slot_limit"] = w.gpu_slot_limit;
  d["gpu_static_limit"] = w.gpu_static_limit;
  d["slot_bytes"] = tiering::gpu_slot_bytes(largest, grads_on_host);
  d["resident_bytes"] = tiering::gpu_slot_bytes(largest, true);
  return d;
}

// ---- UpdateEngine: conversion only; the engine is tiering::UpdateEngine -------------------------

nb::dict use_dict(const tiering::ResourceUse& u) {
  nb::dict d;
  d["busy_ns"] = u.busy_ns;
  d["bytes"] = u.bytes;
  d["params"] = u.params;
  d["ops"] = u.ops;
  return d;
}

nb::dict budget_dict(const tiering::EngineBudget& b) {
  nb::dict d;
  d["update_bytes"] = b.budget.update_bytes;
  d["resident_bytes"] = b.budget.resident_bytes;
  d["source"] = b.source;
  d["slot_bytes"] = b.slot_bytes;
  d["slots_taken"] = b.slots_taken;
  d["residents_taken"] = b.residents_taken;
  nb::dict phases;
  for (int p = 0; p < kPhaseCount; ++p) {
    phases[phase_name(static_cast<Phase>(p))] = b.phase_seen[p] ? nb::cast(b.phase_min_free[p]) : nb::none();
  }
  d["phase_min_free"] = phases;
  return d;
}

using FloatArray = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// The Python face of tiering::UpdateEngine on one of the runtime's devices. One call at a time
/// reaches the engine (it is not thread-safe); the GIL is released while it works.
class PyUpdateEngine {
 public:
  PyUpdateEngine(std::int64_t n, const std::vector<std::pair<std::int64_t, std::int64_t>>& subgroups,
                 std::int64_t low_precision_bytes, int device, std::optional<std::string> nvme_dir,
                 std::int64_t host_budget, std::int64_t nvme_read_ahead, double nvme_read_bytes_per_s,
                 double nvme_write_bytes_per_s) {
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    for (auto [s, e] : subgroups) {
      if (s < 0 || e < 0) {
        value_error("UpdateEngine: subgroup [" + std::to_string(s) + ", " + std::to_string(e) + ") is negative");
      }
      ranges.emplace_back(static_cast<std::size_t>(s), static_cast<std::size_t>(e));
    }
    tiering::EngineConfig config;
    config.low_precision_bytes = count_arg("low_precision_bytes", low_precision_bytes);
    if (nvme_dir) config.nvme.dir = *nvme_dir;
    config.nvme.host_budget_bytes = count_arg("host_budget", host_budget);
    config.nvme.read_ahead = count_arg("nvme_read_ahead", nvme_read_ahead);
    if (!(nvme_read_bytes_per_s >= 0) || !(nvme_write_bytes_per_s >= 0)) {
      value_error("UpdateEngine: nvme_read_bytes_per_s and nvme_write_bytes_per_s must be >= 0 (0: measured)");
    }
    config.nvme.read_bytes_per_s = nvme_read_bytes_per_s;
    config.nvme.write_bytes_per_s = nvme_write_bytes_per_s;
    const std::size_t count = count_arg("n", n);
    Runtime& rt = Runtime::get();
    CachingAllocator& a = rt.allocator(device);
    HostArena& arena = rt.host_arena(device);
    nb::gil_scoped_release nogil;  // the arena may map, touch and register a slab: milliseconds
    engine_ = std::make_unique<tiering::UpdateEngine>(a, arena, count, std::move(ranges), &default_pool(), config);
    device_ = device;
  }

  // The four host arrays as zero-copy arrays that keep this engine alive.
  nb::tuple arrays(nb::handle self) {
    const std::size_t shape[1] = {engine_->size()};
    auto view = [&](float* p) { return FloatArray(p, 1, shape, self); };
    return nb::make_tuple(view(engine_->param()), view(engine_->exp_avg()), view(engine_->exp_avg_sq()),
                          view(engine_->grad()));
  }

  nb::dict plan(const std::string& policy, std::optional<double> k, double static_fraction) {
    const tiering::Policy pol = policy_arg(policy);
    tiering::EnginePlan p;
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);
      p = engine_->plan(pol, static_fraction, k);
    }
    nb::dict d = plan_dict(p.plan);
    d["reason"] = p.reason;
    d["budget"] = budget_dict(p.budget);
    d["headroom_bytes"] = p.budget.budget.update_bytes;
    d["headroom_from"] = p.budget.source;
    return d;
  }

  nb::dict step(const std::string& placement, std::int64_t gpu_slots, double predicted_ns, const nb::list& segments,
                double grad_scale, double clip, bool l2, bool skip_if_nonfinite, std::optional<bool> grads_finite) {
    const std::vector<tiering::Placement> place = placement_arg(placement);
    const std::size_t slots = count_arg("gpu_slots", gpu_slots);
    std::vector<tiering::Segment> segs;
    segs.reserve(segments.size());
    for (nb::handle h : segments) {
      // (subgroup, start, end, lr, beta1, beta2, eps, weight_decay, step)
      nb::tuple t = nb::cast<nb::tuple>(h);
      if (t.size() != 9) value_error("UpdateEngine.step: a segment is (subgroup, start, end, lr, beta1, beta2, eps, weight_decay, step)");
      tiering::Segment s;
      s.subgroup = nb::cast<std::size_t>(t[0]);
      s.start = nb::cast<std::size_t>(t[1]);
      s.end = nb::cast<std::size_t>(t[2]);
      s.params.lr = nb::cast<double>(t[3]);
      s.params.beta1 = nb::cast<double>(t[4]);
      s.params.beta2 = nb::cast<double>(t[5]);
      s.params.eps = nb::cast<double>(t[6]);
      s.params.weight_decay = nb::cast<double>(t[7]);
      s.params.step = nb::cast<std::int64_t>(t[8]);
      segs.push_back(s);
    }
    tiering::EngineStep r;
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);
      r = engine_->step(place, slots, segs, grad_scale, clip, l2, skip_if_nonfinite, predicted_ns, grads_finite);
      observe_traced_pcie(r.total);
    }
    nb::dict d;
    d["nonfinite"] = r.nonfinite;
    d["skipped"] = r.skipped;
    d["runs"] = r.runs;
    d["measured_ns"] = r.total.phase_ns;
    d["clock"] = simulated() ? "simulated" : "wall";
    d["predicted_ns"] = predicted_ns;
    d["cpu"] = use_dict(r.total.cpu);
    d["gpu"] = use_dict(r.total.gpu);
    d["h2d"] = use_dict(r.total.h2d);
    d["d2h"] = use_dict(r.total.d2h);
    d["h2d_d2h_overlap_ns"] = r.total.h2d_d2h_overlap_ns;
    d["params_cpu"] = r.total.params_cpu;
    d["params_gpu"] = r.total.params_gpu;
    d["params_gpu_static"] = r.total.params_gpu_static;
    d["loop_allocations"] = r.total.loop_allocations;
    d["loop_device_allocs"] = r.total.loop_device_allocs;
    d["nvme"] = nvme_use_dict(r.total.nvme);
    return d;
  }

  static nb::dict nvme_use_dict(const tiering::NvmeUse& u) {
    nb::dict d;
    d["read_bytes"] = u.read_bytes;
    d["write_bytes"] = u.write_bytes;
    d["read_busy_ns"] = u.read_busy_ns;
    d["write_busy_ns"] = u.write_busy_ns;
    d["stall_ns"] = u.stall_ns;
    d["stall_wall_ns"] = u.stall_wall_ns;
    d["reads"] = u.reads;
    d["writes"] = u.writes;
    return d;
  }

  nb::dict nvme_info() const {
    const tiering::NvmeTierInfo i = engine_->nvme_info();
    nb::dict d;
    d["spilled"] = i.spilled;
    d["spilled_params"] = i.spilled_params;
    d["on_nvme"] = engine_->on_nvme();
    d["file"] = i.file.empty() ? nb::none() : nb::cast(i.file.string());
    d["file_bytes"] = i.file_bytes;
    d["staging_bytes"] = i.staging_bytes;
    d["read_bytes_per_s"] = i.read_bytes_per_s;
    d["write_bytes_per_s"] = i.write_bytes_per_s;
    d["held"] = i.held;
    d["last"] = nvme_use_dict(i.last);
    return d;
  }

  void spill_host(std::int64_t up_to) {
    const std::size_t at = count_arg("up_to", up_to);
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->spill_host(at);
  }

  double nvme_round_trip() {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->nvme_round_trip();
  }

  void inject_nvme_faults(int write_errno, bool short_write, int read_errno) {
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->inject_nvme_faults(tiering::NvmeFaults{write_errno, short_write, read_errno});
  }

  void host_changed() {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->host_changed();
  }

  void push_grad(std::int64_t offset, std::uintptr_t address, const std::string& dtype, std::int64_t n,
                 std::uintptr_t stream) {
    tiering::DType dt = tiering::DType::none;
    if (dtype == "float32") dt = tiering::DType::fp32;
    else if (dtype == "float16") dt = tiering::DType::fp16;
    else if (dtype == "bfloat16") dt = tiering::DType::bf16;
    else value_error("UpdateEngine.push_grad: dtype must be float32, float16 or bfloat16, got \"" + dtype + "\"");
    const std::size_t at = count_arg("offset", offset);
    const std::size_t count = count_arg("n", n);
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->push_grad(at, reinterpret_cast<const void*>(address), dt, count, Stream{reinterpret_cast<void*>(stream)});
  }

  bool finish_grads() {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->finish_grads();
  }

  // Not under mutex_: an update during backward waits here on a worker thread while backward
  // goes on pushing (the engine locks itself only to mark the point).
  void wait_grads_pushed() {
    nb::gil_scoped_release nogil;
    engine_->wait_grads_pushed();
  }

  void set_host_gradients(const std::vector<bool>& host) {
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->set_host_gradients(host);
  }

  double grad_bytes_to_host() const { return engine_->grad_bytes_to_host(); }

  void grads_to_host() {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->grads_to_host();
  }

  void sync_host() {
    nb::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mutex_);
    engine_->sync_host();
  }

  // The model's 16-bit params in the engine's device memory: a CUDA array on a GPU, a CPU array
  // over the simulated device's memory (which is host memory) on a SimDevice.
  nb::ndarray<> model_params(nb::handle self, const std::string& dtype) {
    tiering::DType dt = tiering::DType::none;
    if (dtype == "bf16" || dtype == "bfloat16") dt = tiering::DType::bf16;
    else if (dtype == "fp16" || dtype == "float16") dt = tiering::DType::fp16;
    else value_error("UpdateEngine.model_params: dtype must be \"bf16\" or \"fp16\", got \"" + dtype + "\"");
    void* p = nullptr;
    {
      nb::gil_scoped_release nogil;
      std::lock_guard<std::mutex> lock(mutex_);
      p = engine_->model_params(dt);
    }
    const std::size_t shape[1] = {engine_->size()};
    const auto code = static_cast<std::uint8_t>(dt == tiering::DType::bf16 ? nb::dlpack::dtype_code::Bfloat
                                                                            : nb::dlpack::dtype_code::Float);
    const nb::dlpack::dtype d{code, 16, 1};
    const bool sim = simulated();
    return nb::ndarray<>(p, 1, shape, self, nullptr, d, sim ? nb::device::cpu::value : nb::device::cuda::value,
                         sim ? 0 : device_);
  }

  nb::dict rates() const { return rates_dict(engine_->rates()); }
  static nb::dict errors_dict(const tiering::PredictionErrors& e) {
    nb::dict d;
    d["count"] = e.count;
    d["last"] = e.last;
    d["mean_abs"] = e.mean_abs;
    d["max_abs"] = e.max_abs;
    return d;
  }
  nb::dict errors() const { return errors_dict(engine_->prediction_errors()); }
  nb::dict iteration_errors() const { return errors_dict(engine_->iteration_errors()); }
  std::uint64_t host_bytes() const { return engine_->host_bytes(); }
  tiering::UpdateEngine& native() { return *engine_; }

  // On a GPU with CUPTI tracing on, the PCIe links during the previous update phase (its records
  // have arrived by now) less this engine's own copies tell the plan what others take.
  void observe_traced_pcie(const tiering::StepReport& r) {
    if (engine_->device().properties().backend != "cuda") return;
    if (last_window_[1] > last_window_[0]) {
      if (const auto use = traced_pcie(last_window_[0], last_window_[1])) {
        engine_->observe_pcie(tiering::PcieObservation{last_window_[1] - last_window_[0], use->h2d.busy_ns,
                                                       use->d2h.busy_ns, last_own_[0], last_own_[1]});
      }
    }
    last_window_[0] = r.phase_start_ns;
    last_window_[1] = r.phase_start_ns + r.phase_ns;
    last_own_[0] = r.h2d.busy_ns;
    last_own_[1] = r.d2h.busy_ns;
  }
  std::uint64_t resident_bytes() const { return engine_->resident_bytes(); }
  std::string device_name() const { return engine_->device().properties().name; }
  int device() const { return device_; }
  // For reports: which clock the measurements are on.
  bool simulated() const { return engine_->device().properties().backend != "cuda"; }

 private:
  std::unique_ptr<tiering::UpdateEngine> engine_;
  double last_window_[2] = {0, 0};  // the last update phase, host clock ns
  double last_own_[2] = {0, 0};     // its H2D and D2H busy time from this engine's copies
  std::mutex mutex_;
  int device_ = 0;
};

}  // namespace

#if MEMTIDE_HAVE_NVME
// Sequential write then read of `bytes` through NvmeStore in `dir` (direct I/O, the store's
// queue depth and block size), with the spills other processes left there.
nb::dict nvme_probe(const std::string& dir, std::uint64_t bytes, std::size_t queue_depth, std::size_t block_bytes) {
  if (bytes < tiering::NvmeStore::kAlign || bytes > (std::uint64_t{1} << 40)) {
    value_error("nvme_probe: bytes must be 4 KiB to 1 TiB, got " + std::to_string(bytes));
  }
  nb::list stale;
  for (const tiering::StaleSpill& s : tiering::SpillDir::find_stale(dir)) {
    stale.append(nb::make_tuple(s.path.string(), s.bytes, s.age_s));
  }
  double write_s = 0, read_s = 0;
  std::uint64_t moved = 0;
  std::string file;
  {
    nb::gil_scoped_release nogil;
    tiering::SpillDir spill(dir);
    tiering::NvmeConfig config;
    config.queue_depth = queue_depth;
    config.block_bytes = block_bytes;
    // Extents of 256 MiB, one buffer reused: the rate of the store, not of the page cache.
    const std::uint64_t extent = std::min<std::uint64_t>(bytes, std::uint64_t{256} << 20);
    const std::size_t n = static_cast<std::size_t>((bytes + extent - 1) / extent);
    tiering::NvmeStore store(spill, std::vector<std::uint64_t>(n, extent), config);
    file = store.file().string();
    void* buffer = nullptr;
    if (posix_memalign(&buffer, tiering::NvmeStore::kAlign, extent) != 0) throw memtide::OutOfMemory("nvme_probe: no buffer");
    std::unique_ptr<void, decltype(&std::free)> owned(buffer, &std::free);
    std::memset(buffer, 0x5a, extent);
    for (std::size_t i = 0; i < n; ++i) store.write(i, buffer, extent);
    for (std::size_t i = 0; i < n; ++i) store.read(i, buffer);
    const auto c = store.counters();
    write_s = c.write_s;
    read_s = c.read_s;
    moved = c.bytes_written;
  }
  nb::dict d;
  d["dir"] = dir;
  d["bytes"] = moved;
  d["write_bytes_per_s"] = write_s > 0 ? static_cast<double>(moved) / write_s : 0.0;
  d["read_bytes_per_s"] = read_s > 0 ? static_cast<double>(moved) / read_s : 0.0;
  d["queue_depth"] = queue_depth;
  d["block_bytes"] = block_bytes;
  d["stale_spills"] = stale;
  return d;
}
#endif

namespace {
std::vector<tiering::BlockProfile> block_profiles(const nb::list& blocks) {
  std::vector<tiering::BlockProfile> out;
  for (nb::handle h : blocks) {
    const nb::dict d = nb::cast<nb::dict>(h);
    tiering::BlockProfile b;
    for (auto [key, value] : d) {
      const std::string k = nb::cast<std::string>(key);
      if (k == "forward_ns") b.forward_ns = nb::cast<double>(value);
      else if (k == "backward_ns") b.backward_ns = nb::cast<double>(value);
      else if (k == "h2d_ns") b.h2d_ns = nb::cast<double>(value);
      else if (k == "d2h_ns") b.d2h_ns = nb::cast<double>(value);
      else if (k == "bytes") b.bytes = nb::cast<std::uint64_t>(value);
      else throw InvalidArgument("block profile: unknown key '" + k + "' (forward_ns, backward_ns, h2d_ns, d2h_ns, bytes)");
    }
    out.push_back(b);
  }
  return out;
}
}  // namespace

void bind_tiering(nb::module_& m) {
  m.def(
      "choose_window",
      [](const nb::list& blocks, std::uint64_t available, double async_ns) {
        const tiering::WindowSize w = tiering::choose_window(block_profiles(blocks), available, async_ns);
        nb::dict d;
        d["blocks"] = w.blocks;
        d["hides_transfers"] = w.hides_transfers;
        d["peak_bytes"] = w.peak_bytes;
        d["why"] = w.why;
        return d;
      },
      "blocks"_a, "available"_a, "async_ns"_a = 0.0,
      "The layer window's size (tiering::choose_window): `blocks` is a list of dicts with forward_ns,\n"
      "backward_ns, h2d_ns, d2h_ns and bytes per block; returns blocks (m), hides_transfers,\n"
      "peak_bytes and why. Raises ValueError, with the numbers, when one block and its prefetch do not fit.");
  m.def(
      "fit_before_end",
      [](const std::vector<std::tuple<std::size_t, double, double>>& candidates, double end_ns, std::size_t cap) {
        std::vector<tiering::BackwardCandidate> c;
        c.reserve(candidates.size());
        for (const auto& [subgroup, ready, work] : candidates) c.push_back({subgroup, ready, work});
        return tiering::fit_before_end(std::move(c), end_ns, cap);
      },
      "candidates"_a, "end_ns"_a, "cap"_a,
      "Which subgroups one host worker updates before backward ends (tiering::fit_before_end):\n"
      "`candidates` are (subgroup, ready_ns, work_ns); returns the subgroups taken, in order, at most `cap`.");
  m.def(
      "window_pass_ns",
      [](const nb::list& blocks, int window, double async_ns) {
        return tiering::window_pass_ns(block_profiles(blocks), window, async_ns);
      },
      "blocks"_a, "m"_a, "async_ns"_a = 0.0,
      "The modelled forward + backward time with a window of m blocks (tiering::window_pass_ns).");
#if MEMTIDE_HAVE_NVME
  m.def("nvme_probe", &nvme_probe, "dir"_a, "bytes"_a = std::uint64_t{1} << 30, "queue_depth"_a = 32,
        "block_bytes"_a = std::size_t{1} << 20,
        "Measures sequential write and read rates of `dir` through NvmeStore (io_uring, O_DIRECT,\n"
        "checksummed extents), and lists spill directories that dead processes left there.");
  m.attr("HAVE_NVME") = true;
#else
  m.attr("HAVE_NVME") = false;
#endif
  m.def("default_rates", [] { return rates_dict(tiering::Rates{}); },
        "The update-phase PerfModel's default rates (bytes/s, params/s, bytes/param), keyed by field.");
  m.def("plan_update", &plan_update, "subgroup_params"_a, "policy"_a = "auto", "rates"_a = nb::none(),
        "static_fraction"_a = 0.0, "k"_a = nb::none(), "low_precision_bytes"_a = 2, "grads_on_host"_a = true,
        "gpu_slot_limit"_a = 3, "gpu_static_limit"_a = 0, "on_nvme"_a = nb::none(), "nvme_read_ahead"_a = 2,
        "The PerfModel's update-phase plan for `policy` (cpu, static, interleaved, auto): the one\n"
        "placement function. `static_fraction`: the GPU-resident share (static, interleaved, auto with k);\n"
        "`k`: the stride, one in every k subgroups on the GPU (interleaved: default 2; auto: None searches).\n\n"
        "`rates` overrides any of default_rates(). Returns policy, placement (one letter per subgroup:\n"
        "c CPU, g streamed GPU, s GPU-static), k, gpu_slots, gpu_streamed, static_residents and the\n"
        "prediction (total_ns, bound_ns, per-resource busy ns, busiest, bytes moved).");
  m.def("predict_update", &predict_update, "subgroup_params"_a, "placement"_a, "rates"_a = nb::none(),
        "low_precision_bytes"_a = 2, "grads_on_host"_a = true, "gpu_slot_limit"_a = 3,
        "The PerfModel's predicted update phase for `placement` (one letter per subgroup: c, g, s).");

  m.def("fit_host_budget", &fit_host_budget, "subgroup_params"_a, "host_budget_bytes"_a, "gpu_static_limit"_a = 0,
        "nvme_read_ahead"_a = 2,
        "Which subgroups must live on NVMe for the host state (16 B/param) to fit `host_budget_bytes`:\n"
        "the fewest, spread evenly, never among the last `gpu_static_limit` (one bool per subgroup).");
  m.attr("MAX_SUBGROUPS") = tiering::kMaxSubgroups;
  m.attr("USEFUL_SLOTS") = tiering::kUsefulSlots;
  m.def("fit_gpu_budget", &fit_gpu_budget, "subgroup_params"_a, "update_bytes"_a, "resident_bytes"_a,
        "grads_on_host"_a = true,
        "What a plan may hold: streamed slots in `update_bytes` (memory free during the update phase)\n"
        "and static residents in `resident_bytes` (free through the whole iteration). Returns\n"
        "gpu_slot_limit, gpu_static_limit, slot_bytes and resident_bytes (one resident).");

  nb::class_<PyUpdateEngine>(m, "UpdateEngine",
                             "The tiering engine of one device (tiering::UpdateEngine): it owns the host state (four\n"
                             "flat float32 arrays in the device's pinned, NUMA-bound HostArena), plans each step with\n"
                             "the PerfModel from the phase tracker's memory and the calibrated rates, and runs the\n"
                             "UpdateScheduler (a data-mode SimDevice without a GPU).")
      .def(nb::init<std::int64_t, const std::vector<std::pair<std::int64_t, std::int64_t>>&, std::int64_t, int,
                    std::optional<std::string>, std::int64_t, std::int64_t, double, double>(),
           "n"_a, "subgroups"_a, "low_precision_bytes"_a = 2, "device"_a = 0, "nvme_dir"_a = nb::none(),
           "host_budget"_a = 0, "nvme_read_ahead"_a = 2, "nvme_read_bytes_per_s"_a = 0.0,
           "nvme_write_bytes_per_s"_a = 0.0,
           "Host state for `n` params (zeroed), cut into `subgroups`, consecutive [start, end) ranges covering it.\n"
           "With `host_budget` (bytes, 0: none) smaller than the state (16 B/param), the fewest subgroups that\n"
           "fit it keep their params and moments on NVMe in a private spill directory under `nvme_dir`,\n"
           "streamed `nvme_read_ahead` subgroups ahead of each step (rates: planned with until measured).")
      .def("nvme_info", &PyUpdateEngine::nvme_info,
           "The NVMe tier: spilled (subgroups), spilled_params, on_nvme (per subgroup), file, file_bytes,\n"
           "staging_bytes, read/write_bytes_per_s (planned with), held (subgroups whose newest state only host\n"
           "memory holds after a failed write) and last (the last step's transfers).")
      .def("spill_host", &PyUpdateEngine::spill_host, "up_to"_a,
           "Writes spilled subgroups wholly below element `up_to` whose host range is the truth to NVMe and\n"
           "drops their host pages (the next step does it for all).")
      .def("nvme_round_trip", &PyUpdateEngine::nvme_round_trip,
           "Reads every spilled subgroup through staging and writes it back unchanged, in update order, no\n"
           "update between: the NVMe tier's I/O for one step alone, in ns on the engine's host clock.")
      .def("inject_nvme_faults", &PyUpdateEngine::inject_nvme_faults, "write_errno"_a = 0, "short_write"_a = false,
           "read_errno"_a = 0, "For tests: the NVMe tier's next write or read request fails as given.")
      .def("arrays", [](nb::handle self) { return nb::cast<PyUpdateEngine&>(self).arrays(self); },
           "(param, exp_avg, exp_avg_sq, grad): zero-copy float32 arrays over the host state (DLPack;\n"
           "torch.from_dlpack makes tensors of them). They keep the engine alive.")
      .def("plan", &PyUpdateEngine::plan, "policy"_a, "k"_a = nb::none(), "static_fraction"_a = 0.0,
           "The plan of `policy` (cpu, static, interleaved, auto) with stride `k` (one in every k subgroups on\n"
           "the GPU; None under auto: the PerfModel searches) and GPU-resident share `static_fraction`, sized\n"
           "from the phase tracker. Returns placement (c/g/s per subgroup), k, gpu_slots, gpu_streamed,\n"
           "static_residents, prediction, reason, and budget (update_bytes, resident_bytes, source,\n"
           "slot_bytes, slots_taken, residents_taken, phase_min_free per phase).")
      .def("step", &PyUpdateEngine::step, "placement"_a, "gpu_slots"_a, "predicted_ns"_a, "segments"_a,
           "grad_scale"_a = 1.0, "clip"_a = 1.0, "l2"_a = false, "skip_if_nonfinite"_a = false,
           "grads_finite"_a = nb::none(),
           "One update phase. segments: (subgroup, start, end, lr, beta1, beta2, eps, weight_decay, step)\n"
           "tuples; segments with the same hyperparameters share one scheduler run. `grads_finite`: the\n"
           "gradient path's verdict (finish_grads) when every gradient came through it (no host rescan).\n"
           "Returns nonfinite, skipped, measured_ns (clock: simulated on a SimDevice, else wall),\n"
           "predicted_ns, per-resource use and params updated per placement. The Calibration learns from\n"
           "every step.")
      .def("push_grad", &PyUpdateEngine::push_grad, "offset"_a, "address"_a, "dtype"_a, "n"_a, "stream"_a = 0,
           "Gradients of flattened elements [offset, offset + n) at device `address` (torch dtype name) are\n"
           "final on `stream` (a cudaStream_t as int): upcast and copied to the host gradient array on the\n"
           "engine's streams while backward goes on; `stream` waits until they have been read.")
      .def("finish_grads", &PyUpdateEngine::finish_grads,
           "Waits for every pushed gradient; True when all were finite (or none was pushed).")
      .def("wait_grads_pushed", &PyUpdateEngine::wait_grads_pushed,
           "Waits until every gradient pushed so far that goes to the host is there, without ending the\n"
           "pass (finish_grads does): for updates during backward. Callable from another thread.")
      .def("set_host_gradients", &PyUpdateEngine::set_host_gradients, "host"_a,
           "Per subgroup: its gradients go to host memory in the next backward whatever the plan says\n"
           "(updates during backward read them there); an empty list: as the plan says.")
      .def("grads_to_host", &PyUpdateEngine::grads_to_host,
           "Moves gradients the path kept on the GPU into the host array (before editing it).")
      .def_prop_ro("grad_bytes_to_host", &PyUpdateEngine::grad_bytes_to_host,
                   "Bytes the gradient path has copied to the host.")
      .def("host_changed", &PyUpdateEngine::host_changed,
           "The host arrays were changed outside step(): GPU-static residents are dropped and moved in\n"
           "again from the host on the next step.")
      .def("sync_host", &PyUpdateEngine::sync_host,
           "Copies the newest state of GPU-static residents into the host arrays (before reading them).")
      .def("model_params", [](nb::handle self, const std::string& dtype) {
             return nb::cast<PyUpdateEngine&>(self).model_params(self, dtype);
           }, "dtype"_a,
           "The model's 16-bit params (\"bf16\" or \"fp16\") for every element, in the engine's device memory,\n"
           "allocated on first call: from then on each step writes them inside the update phase. A CUDA array\n"
           "on a GPU, a CPU array over the SimDevice's memory otherwise; it keeps the engine alive.")
      .def("rates", &PyUpdateEngine::rates, "The Calibration's current rates.")
      .def("prediction_errors", &PyUpdateEngine::errors, "Recent (measured - predicted) / predicted of whole phases.")
      .def(
          "observe_pcie",
          [](PyUpdateEngine& self, double window_ns, double h2d_busy_ns, double d2h_busy_ns, double own_h2d_busy_ns,
             double own_d2h_busy_ns) {
            self.native().observe_pcie(
                tiering::PcieObservation{window_ns, h2d_busy_ns, d2h_busy_ns, own_h2d_busy_ns, own_d2h_busy_ns});
          },
          "window_ns"_a, "h2d_busy_ns"_a, "d2h_busy_ns"_a, "own_h2d_busy_ns"_a = 0.0, "own_d2h_busy_ns"_a = 0.0,
          "What CUPTI saw on the PCIe links during an update phase: the share others took is planned around.")
      .def("foreign_pcie_share", [](PyUpdateEngine& self) { return self.native().foreign_pcie_share(); },
           "The shares of H2D and D2H that traffic memtide did not issue takes (smoothed).")
      .def("iteration_errors", &PyUpdateEngine::iteration_errors,
           "The same for whole iterations (on a GPU: the passes as the last iteration ran them plus the planned\n"
           "update, against this iteration's).")
      .def_prop_ro("host_bytes", &PyUpdateEngine::host_bytes, "Pinned host bytes the state takes in the arena.")
      .def_prop_ro("resident_bytes", &PyUpdateEngine::resident_bytes, "Device bytes the engine holds between steps.")
      .def_prop_ro("device", &PyUpdateEngine::device)
      .def_prop_ro("device_name", &PyUpdateEngine::device_name)
      .def_prop_ro("simulated", &PyUpdateEngine::simulated);
}

}  // namespace memtide::bindings
