// memtide._memtide: the engine TieredAdamW drives (tiering::UpdateEngine) and the typed results
// that cross into Python: Plan, StepReport, Segment and their parts. Conversion only.

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/engine/backward_updates.hpp"
#include "memtide/tiering/engine/grad_entry.h"
#include "memtide/tiering/engine/step_protocol.hpp"
#include "memtide/tiering/engine/update_engine.hpp"
#include "common.hpp"

#include <nanobind/operators.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/tuple.h>

namespace memtide::bindings {
namespace {

using FloatArray = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// A gradient's dtype as torch names it ("float32", "float16", "bfloat16"); ValueError naming `who` else.
tiering::DType grad_dtype(const std::string& name, const char* who) {
  if (name == "float32") return tiering::DType::fp32;
  if (name == "float16") return tiering::DType::fp16;
  if (name == "bfloat16") return tiering::DType::bf16;
  value_error(std::string(who) + ": a gradient's dtype must be float32, float16 or bfloat16, got \"" + name + "\"");
}

/// The Python face of tiering::UpdateEngine on one of the runtime's devices. The engine locks its
/// own calls; the GIL is released while it works.
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
    ThreadPool& pool = rt.host_pool(device);  // on a GPU: its share of the local cpus
    engine_ = std::make_unique<tiering::UpdateEngine>(a, arena, count, std::move(ranges), &pool, config);
    // The process's CUPTI tracer (when it runs) tells the engine what others do on the links.
    engine_->set_traffic_source([](double from_ns, double to_ns) -> std::optional<tiering::LinkTraffic> {
      const auto use = cupti::ProcessTrace::pcie(from_ns, to_ns);
      if (!use) return std::nullopt;
      return tiering::LinkTraffic{use->h2d.busy_ns, use->d2h.busy_ns};
    });
    device_ = device;
  }

  // The four host arrays as zero-copy arrays that keep this engine alive.
  nb::tuple arrays(nb::handle self) {
    const std::size_t shape[1] = {engine_->size()};
    auto view = [&](float* p) { return FloatArray(p, 1, shape, self); };
    return nb::make_tuple(view(engine_->param()), view(engine_->exp_avg()), view(engine_->exp_avg_sq()),
                          view(engine_->grad()));
  }

  void set_layout(const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges,
                  const std::vector<std::int64_t>& groups, const std::vector<bool>& low_precision) {
    if (groups.size() != ranges.size() || low_precision.size() != ranges.size()) {
      value_error("UpdateEngine.set_layout: " + std::to_string(ranges.size()) + " ranges, " +
                  std::to_string(groups.size()) + " groups and " + std::to_string(low_precision.size()) +
                  " precision flags; one of each per param");
    }
    std::vector<tiering::ParamSlot> params(ranges.size());
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      params[i].start = count_arg("start", ranges[i].first);
      params[i].end = count_arg("end", ranges[i].second);
      params[i].group = count_arg("group", groups[i]);
      params[i].low_precision = low_precision[i];
    }
    engine_->set_layout(tiering::ParamLayout(std::move(params), engine_->subgroups()));
  }

  void set_policy(const std::string& policy, std::optional<double> k, double static_fraction) {
    const tiering::PolicyChoice choice{policy_arg(policy), static_fraction, k};
    nb::gil_scoped_release nogil;
    engine_->set_policy(choice);
  }

  tiering::EnginePlan plan() {
    nb::gil_scoped_release nogil;
    return engine_->current_plan();
  }

  static tiering::StepRequest request(std::vector<tiering::StepParams> groups, const nb::bytes& has_grad,
                                      double grad_scale, double clip, bool skip_if_nonfinite,
                                      std::optional<bool> grads_finite, std::vector<bool> done) {
    tiering::StepRequest r;
    r.groups = std::move(groups);
    const auto* flags = static_cast<const std::uint8_t*>(has_grad.data());
    r.has_grad.assign(flags, flags + has_grad.size());
    r.grad_scale = grad_scale;
    r.clip = clip;
    r.skip_if_nonfinite = skip_if_nonfinite;
    r.path_verdict = grads_finite;
    r.done = std::move(done);
    return r;
  }

  tiering::EngineStep step(std::vector<tiering::StepParams> groups, const nb::bytes& has_grad, double grad_scale,
                           double clip, bool skip_if_nonfinite, std::optional<bool> grads_finite,
                           std::vector<bool> done,
                           const std::vector<std::tuple<std::int64_t, std::int64_t, std::uintptr_t, std::string>>& grad_sources) {
    tiering::StepRequest r =
        request(std::move(groups), has_grad, grad_scale, clip, skip_if_nonfinite, grads_finite, std::move(done));
    for (const auto& [start, n, address, dtype] : grad_sources) {
      const tiering::DType dt = grad_dtype(dtype, "UpdateEngine.step");
      r.grad_sources.push_back(tiering::GradSource{count_arg("grad source start", start), count_arg("grad source n", n),
                                                   reinterpret_cast<const void*>(address), dt});
    }
    nb::gil_scoped_release nogil;
    return engine_->step(r);
  }

  std::vector<tiering::Segment> segments(std::vector<tiering::StepParams> groups, const nb::bytes& has_grad,
                                         std::optional<std::size_t> only) {
    const tiering::StepRequest r = request(std::move(groups), has_grad, 1.0, 1.0, false, std::nullopt, {});
    return engine_->segments(r, only);
  }

  // The step count of every param (float32, writable: a checkpoint load sets them).
  FloatArray steps(nb::handle self) {
    const std::size_t shape[1] = {engine_->layout().size()};
    return FloatArray(engine_->layout().steps(), 1, shape, self);
  }

  void set_sync_after_step(bool on) {
    engine_->set_sync_after_step(on);
  }

  // nvme_info() is a report for people and JSON: its last step's transfers as a dict too.
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
    engine_->spill_host(at);
  }

  double nvme_round_trip() {
    nb::gil_scoped_release nogil;
    tiering::SpillTier* tier = engine_->nvme_tier();
    return tier != nullptr ? tier->round_trip() : 0;
  }

  void inject_nvme_faults(int write_errno, bool short_write, int read_errno) {
    tiering::SpillTier* tier = engine_->nvme_tier();
    if (tier != nullptr) tier->inject_faults(tiering::NvmeFaults{write_errno, short_write, read_errno});
  }

  void host_changed() {
    nb::gil_scoped_release nogil;
    engine_->host_changed();
  }

  void push_grad(std::int64_t offset, std::uintptr_t address, const std::string& dtype, std::int64_t n,
                 std::uintptr_t stream) {
    const tiering::DType dt = grad_dtype(dtype, "UpdateEngine.push_grad");
    const std::size_t at = count_arg("offset", offset);
    const std::size_t count = count_arg("n", n);
    nb::gil_scoped_release nogil;
    engine_->push_grad(at, reinterpret_cast<const void*>(address), dt, count, Stream{reinterpret_cast<void*>(stream)});
  }

  bool finish_grads() {
    nb::gil_scoped_release nogil;
    return engine_->finish_grads();
  }

  // An update during backward waits here on a worker thread while backward goes on pushing (the
  // engine locks itself only to mark the point).
  void wait_grads_pushed() {
    nb::gil_scoped_release nogil;
    engine_->wait_grads_pushed();
  }

  void set_host_gradients(const std::vector<bool>& host) {
    engine_->set_host_gradients(host);
  }

  double grad_bytes_to_host() const { return engine_->grad_bytes_to_host(); }

  void grads_to_host() {
    nb::gil_scoped_release nogil;
    engine_->grads_to_host();
  }

  void sync_host() {
    nb::gil_scoped_release nogil;
    engine_->sync_host();
  }

  std::shared_ptr<tiering::StateSnapshot> save_async(
      const std::string& target, std::uint64_t buffer_bytes, const nb::bytes& meta,
      const std::optional<std::tuple<std::string, std::vector<std::string>, std::size_t>>& part) {
    std::string bytes(meta.c_str(), meta.size());
    std::optional<tiering::StateSnapshot::Config::Part> p;
    if (part) p = tiering::StateSnapshot::Config::Part{std::get<0>(*part), std::get<1>(*part), std::get<2>(*part)};
    nb::gil_scoped_release nogil;  // a running save is waited for first
    return engine_->save_async(target, buffer_bytes, std::move(bytes), std::move(p));
  }

  // The running save as its own type (StateSnapshot or FrozenState), or None.
  nb::object running_save() {
    std::shared_ptr<tiering::SaveTarget> s;
    {
      // The engine's lock may be held by a step waiting in protect() for DCP's writer, a Python
      // thread that needs the GIL to read on.
      nb::gil_scoped_release nogil;
      s = engine_->running_save();
    }
    if (auto snapshot = std::dynamic_pointer_cast<tiering::StateSnapshot>(s)) return nb::cast(snapshot);
    if (auto frozen = std::dynamic_pointer_cast<tiering::FrozenState>(s)) return nb::cast(frozen);
    return nb::none();
  }

  std::shared_ptr<tiering::FrozenState> freeze(const std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>& needed,
                                               std::uint64_t buffer_bytes, double stall_s, const std::string& target) {
    std::vector<tiering::FrozenState::Range> ranges;
    ranges.reserve(needed.size());
    for (const auto& [array, first, end] : needed) ranges.push_back({array, first, end});
    nb::gil_scoped_release nogil;  // a running save is waited for first
    return engine_->freeze(std::move(ranges), buffer_bytes, stall_s, target);
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
        p = engine_->model_params(dt);
    }
    const std::size_t shape[1] = {engine_->size()};
    const auto code = static_cast<std::uint8_t>(dt == tiering::DType::bf16 ? nb::dlpack::dtype_code::Bfloat
                                                                            : nb::dlpack::dtype_code::Float);
    const nb::dlpack::dtype d{code, 16, 1};
    const bool host = host_memory();
    return nb::ndarray<>(p, 1, shape, self, nullptr, d, host ? nb::device::cpu::value : nb::device::cuda::value,
                         host ? 0 : device_);
  }

  tiering::Rates rates() const { return engine_->rates(); }
  tiering::PredictionErrors errors() const { return engine_->prediction_errors(); }
  tiering::PredictionErrors iteration_errors() const { return engine_->iteration_errors(); }
  std::uint64_t host_bytes() const { return engine_->host_bytes(); }
  tiering::UpdateEngine& native() { return *engine_; }

  std::uint64_t resident_bytes() const { return engine_->resident_bytes(); }
  std::string device_name() const { return engine_->device().properties().name; }
  int device() const { return device_; }
  // For reports: which clock the measurements are on.
  bool simulated() const { return engine_->device().properties().virtual_clock; }
  // Where its device memory is: host memory (a SimDevice) or a GPU's.
  bool host_memory() const { return engine_->device().properties().host_addressable; }

 private:
  std::unique_ptr<tiering::UpdateEngine> engine_;
  int device_ = 0;
};

}  // namespace

namespace {
void bind_results(nb::module_& m) {
  nb::enum_<tiering::Placement>(m, "Placement", "Where a subgroup is updated in one update phase.")
      .value("cpu", tiering::Placement::cpu, "on the host; its low-precision params go H2D")
      .value("gpu", tiering::Placement::gpu, "streamed H2D into a GPU slot, updated there, flushed D2H")
      .value("gpu_static", tiering::Placement::gpu_static, "resident on the GPU between steps")
      .value("done", tiering::Placement::done, "updated before the phase (during backward)");

  nb::class_<tiering::StepParams>(m, "StepParams", "One param group's AdamW hyper-parameters for a step.")
      .def(nb::init<>())
      .def("__init__",
           [](tiering::StepParams* p, double lr, double beta1, double beta2, double eps, double weight_decay) {
             new (p) tiering::StepParams{};
             p->lr = lr;
             p->beta1 = beta1;
             p->beta2 = beta2;
             p->eps = eps;
             p->weight_decay = weight_decay;
           },
           "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a)
      .def_ro("lr", &tiering::StepParams::lr)
      .def_ro("beta1", &tiering::StepParams::beta1)
      .def_ro("beta2", &tiering::StepParams::beta2)
      .def_ro("eps", &tiering::StepParams::eps)
      .def_ro("weight_decay", &tiering::StepParams::weight_decay)
      .def_ro("step", &tiering::StepParams::step);

  nb::class_<tiering::Segment>(m, "Segment",
                               "A run [start, end) of one subgroup's elements stepped with one group's\n"
                               "hyper-parameters at one step count.")
      .def_ro("subgroup", &tiering::Segment::subgroup)
      .def_ro("start", &tiering::Segment::start)
      .def_ro("end", &tiering::Segment::end)
      .def_prop_ro("lr", [](const tiering::Segment& s) { return s.params.lr; })
      .def_prop_ro("beta1", [](const tiering::Segment& s) { return s.params.beta1; })
      .def_prop_ro("beta2", [](const tiering::Segment& s) { return s.params.beta2; })
      .def_prop_ro("eps", [](const tiering::Segment& s) { return s.params.eps; })
      .def_prop_ro("weight_decay", [](const tiering::Segment& s) { return s.params.weight_decay; })
      .def_prop_ro("step", [](const tiering::Segment& s) { return s.params.step; })
      .def_ro("low_precision", &tiering::Segment::low_precision)
      .def(nb::self == nb::self)  // NOLINT(misc-redundant-expression): nanobind's operator binding
      .def("__repr__", [](const tiering::Segment& s) {
        return "Segment(subgroup=" + std::to_string(s.subgroup) + ", [" + std::to_string(s.start) + ", " +
               std::to_string(s.end) + "), step=" + std::to_string(s.params.step) + ")";
      });

  nb::class_<tiering::Prediction>(m, "Prediction", "The PerfModel's prediction of one update phase.")
      .def_ro("total_ns", &tiering::Prediction::total_ns)
      .def_ro("bound_ns", &tiering::Prediction::bound_ns, "the busiest resource's time")
      .def_ro("cpu_ns", &tiering::Prediction::cpu_ns)
      .def_ro("gpu_ns", &tiering::Prediction::gpu_ns)
      .def_ro("h2d_ns", &tiering::Prediction::h2d_ns)
      .def_ro("d2h_ns", &tiering::Prediction::d2h_ns)
      .def_ro("dram_ns", &tiering::Prediction::dram_ns)
      .def_ro("nvme_ns", &tiering::Prediction::nvme_ns)
      .def_ro("busiest", &tiering::Prediction::busiest)
      .def_ro("h2d_bytes", &tiering::Prediction::h2d_bytes)
      .def_ro("d2h_bytes", &tiering::Prediction::d2h_bytes)
      .def_ro("dram_bytes", &tiering::Prediction::dram_bytes)
      .def_ro("nvme_bytes", &tiering::Prediction::nvme_bytes)
      .def("as_dict", [](const tiering::Prediction& p) { return prediction_dict(p); }, "For JSON output.");

  nb::class_<tiering::EngineBudget>(m, "PlanBudget", "The device memory a plan was made with and what it took.")
      .def_prop_ro("update_bytes", [](const tiering::EngineBudget& b) { return b.budget.update_bytes; },
                   "for streamed slots: what the update phase leaves")
      .def_prop_ro("resident_bytes", [](const tiering::EngineBudget& b) { return b.budget.resident_bytes; },
                   "for static residents: what the whole iteration leaves")
      .def_ro("source", &tiering::EngineBudget::source)
      .def_ro("slot_bytes", &tiering::EngineBudget::slot_bytes)
      .def_ro("slots_taken", &tiering::EngineBudget::slots_taken)
      .def_ro("residents_taken", &tiering::EngineBudget::residents_taken)
      .def_prop_ro("phase_min_free",
                   [](const tiering::EngineBudget& b) {
                     std::vector<std::pair<std::string, std::optional<std::uint64_t>>> out;
                     for (int p = 0; p < kPhaseCount; ++p) {
                       out.emplace_back(phase_name(static_cast<Phase>(p)),
                                        b.phase_seen[p] ? std::optional<std::uint64_t>(b.phase_min_free[p])
                                                        : std::nullopt);
                     }
                     return out;
                   },
                   "(phase, lowest free bytes or None where the phase was not seen) in phase order");

  nb::class_<tiering::EnginePlan>(m, "Plan", "The engine's plan of one update phase.")
      .def(nb::init<>(), "An empty plan: no subgroups (an optimizer with nothing to update).")
      .def_prop_ro("policy", [](const tiering::EnginePlan& p) { return std::string(policy_key(p.plan.policy)); })
      .def_prop_ro("placement", [](const tiering::EnginePlan& p) { return p.plan.placement; },
                   "one Placement per subgroup")
      .def_prop_ro("marks", [](const tiering::EnginePlan& p) { return placement_string(p.plan.placement); },
                   "the placement as one letter per subgroup, for people: c CPU, g streamed GPU, s GPU-static, d done")
      .def_prop_ro("k", [](const tiering::EnginePlan& p) { return p.plan.k; }, "the stride (0: none)")
      .def_prop_ro("gpu_slots", [](const tiering::EnginePlan& p) { return p.plan.gpu_slots; })
      .def_prop_ro("gpu_streamed", [](const tiering::EnginePlan& p) { return p.plan.gpu_streamed; })
      .def_prop_ro("static_residents", [](const tiering::EnginePlan& p) { return p.plan.static_residents; })
      .def_prop_ro("prediction", [](const tiering::EnginePlan& p) { return p.plan.prediction; })
      .def_ro("budget", &tiering::EnginePlan::budget)
      .def_ro("reason", &tiering::EnginePlan::reason, "why it differs from what the policy asked for ('' if not)")
      .def("as_dict",
           [](const tiering::EnginePlan& p) {
             nb::dict d = plan_dict(p.plan);
             d["reason"] = p.reason;
             return d;
           },
           "For JSON output.");

  nb::class_<tiering::PredictionErrors>(m, "PredictionErrors",
                                        "(measured - predicted) / predicted over the remembered phases.")
      .def_ro("count", &tiering::PredictionErrors::count)
      .def_ro("last", &tiering::PredictionErrors::last)
      .def_ro("mean_abs", &tiering::PredictionErrors::mean_abs)
      .def_ro("max_abs", &tiering::PredictionErrors::max_abs);

  nb::class_<tiering::Rates>(m, "Rates", "The rates the PerfModel plans with (bytes/s, params/s).")
      .def_ro("h2d_bytes_per_s", &tiering::Rates::h2d_bytes_per_s)
      .def_ro("d2h_bytes_per_s", &tiering::Rates::d2h_bytes_per_s)
      .def_ro("cpu_update_params_per_s", &tiering::Rates::cpu_update_params_per_s)
      .def_ro("gpu_update_params_per_s", &tiering::Rates::gpu_update_params_per_s)
      .def_ro("cpu_downscale_params_per_s", &tiering::Rates::cpu_downscale_params_per_s)
      .def_ro("host_dram_bytes_per_s", &tiering::Rates::host_dram_bytes_per_s)
      .def_ro("cpu_dram_bytes_per_param", &tiering::Rates::cpu_dram_bytes_per_param)
      .def_ro("nvme_read_bytes_per_s", &tiering::Rates::nvme_read_bytes_per_s)
      .def_ro("nvme_write_bytes_per_s", &tiering::Rates::nvme_write_bytes_per_s)
      .def("as_dict", [](const tiering::Rates& r) { return rates_dict(r); }, "For JSON output.");

  nb::class_<tiering::ResourceUse>(m, "ResourceUse", "What one resource did in an update phase.")
      .def_ro("busy_ns", &tiering::ResourceUse::busy_ns)
      .def_ro("bytes", &tiering::ResourceUse::bytes)
      .def_ro("params", &tiering::ResourceUse::params)
      .def_ro("ops", &tiering::ResourceUse::ops);

  nb::class_<tiering::NvmeUse>(m, "NvmeUse", "What the NVMe tier moved in an update phase.")
      .def_ro("read_bytes", &tiering::NvmeUse::read_bytes)
      .def_ro("write_bytes", &tiering::NvmeUse::write_bytes)
      .def_ro("read_busy_ns", &tiering::NvmeUse::read_busy_ns)
      .def_ro("write_busy_ns", &tiering::NvmeUse::write_busy_ns)
      .def_ro("stall_ns", &tiering::NvmeUse::stall_ns)
      .def_ro("stall_wall_ns", &tiering::NvmeUse::stall_wall_ns)
      .def_ro("reads", &tiering::NvmeUse::reads)
      .def_ro("writes", &tiering::NvmeUse::writes);

  using Step = tiering::EngineStep;
  nb::class_<Step>(m, "StepReport", "What one step of the engine did.")
      .def_ro("nonfinite", &Step::nonfinite, "a gradient was NaN or Inf (after scale and clip)")
      .def_ro("skipped", &Step::skipped, "non-finite with skip_if_nonfinite: nothing changed")
      .def_ro("runs", &Step::runs, "scheduler runs (one per distinct set of hyper-parameters)")
      .def_ro("predicted_ns", &Step::predicted_ns)
      .def_ro("placement", &Step::placement, "what ran (Placement.done for subgroups updated before)")
      .def_prop_ro("measured_ns", [](const Step& s) { return s.total.phase_ns; },
                   "the update phase, on the engine's clock (simulated on a SimDevice)")
      .def_prop_ro("cpu", [](const Step& s) { return s.total.cpu; })
      .def_prop_ro("gpu", [](const Step& s) { return s.total.gpu; })
      .def_prop_ro("h2d", [](const Step& s) { return s.total.h2d; })
      .def_prop_ro("d2h", [](const Step& s) { return s.total.d2h; })
      .def_prop_ro("h2d_d2h_overlap_ns", [](const Step& s) { return s.total.h2d_d2h_overlap_ns; })
      .def_prop_ro("params_cpu", [](const Step& s) { return s.total.params_cpu; })
      .def_prop_ro("params_gpu", [](const Step& s) { return s.total.params_gpu; })
      .def_prop_ro("params_gpu_static", [](const Step& s) { return s.total.params_gpu_static; })
      .def_prop_ro("loop_allocations", [](const Step& s) { return s.total.loop_allocations; })
      .def_prop_ro("loop_device_allocs", [](const Step& s) { return s.total.loop_device_allocs; })
      .def_prop_ro("nvme", [](const Step& s) { return s.total.nvme; })
      .def_prop_ro("nvme_transfers", [](const Step& s) { return nvme_transfer_list(s.total.nvme_transfers); },
                   "The NVMe tier's transfers and waits: (what, subgroup, queued_s, start_s, end_s, bytes), what\n"
                   "\"read\", \"write\" or \"wait\" (for a read), in s on the steady clock (time.monotonic()).");
}
nb::dict progress_dict(const tiering::SnapshotProgress& p) {
  nb::dict d;
  d["bytes_total"] = p.bytes_total;
  d["bytes_written"] = p.bytes_written;
  d["elapsed_s"] = p.elapsed_s;
  d["committed_s"] = p.committed_s;
  d["write_s"] = p.write_s;
  d["waited_s"] = p.waited_s;
  d["copied_bytes"] = p.copied_bytes;
  d["copy_s"] = p.copy_s;
  d["peak_buffer_bytes"] = p.peak_buffer_bytes;
  d["buffer_bound"] = p.buffer_bound;
  d["done"] = p.done;
  d["committed"] = p.committed;
  d["error"] = p.error;
  d["direct_bytes"] = p.direct_bytes;
  return d;
}
}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<tiering::StateSnapshot>(m, "StateSnapshot",
                                     "A checkpoint save running beside training (UpdateEngine.save_async).")
      .def("wait", &tiering::StateSnapshot::wait, nb::call_guard<nb::gil_scoped_release>(),
           "Blocks until the save is committed; OSError when it failed (the target is then as it was).")
      .def("cancel", &tiering::StateSnapshot::cancel, "Stops the save; its partial folder is removed.")
      .def_prop_ro("target", [](const tiering::StateSnapshot& s) { return s.target().string(); })
      .def("progress", [](const tiering::StateSnapshot& s) { return progress_dict(s.progress()); },
           "bytes written of the total, seconds elapsed and spent writing, seconds training waited, the\n"
           "copy-on-write buffer's bytes (copied in all, peak, bound) and seconds spent copying, done,\n"
           "committed, error, bytes written with O_DIRECT.");
  nb::class_<tiering::FrozenState>(m, "FrozenState",
                                   "The host state frozen for a reader that is not memtide's (UpdateEngine.freeze).")
      .def("read", [](tiering::FrozenState& f, std::size_t array, std::size_t first, std::size_t end, std::uintptr_t dst) {
             f.read({array, first, end}, reinterpret_cast<float*>(dst));
           }, "array"_a, "first"_a, "end"_a, "dst"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Copies elements [first, end) of array (0 params, 1 exp_avg, 2 exp_avg_sq) as frozen into the\n"
           "float32 memory at address dst. ValueError outside the frozen ranges; RuntimeError once closed.")
      .def("keep_only", [](tiering::FrozenState& f, const std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>& ranges) {
             std::vector<tiering::FrozenState::Range> r;
             r.reserve(ranges.size());
             for (const auto& [array, first, end] : ranges) r.push_back({array, first, end});
             nb::gil_scoped_release nogil;
             f.keep_only(r);
           }, "ranges"_a,
           "The reader will read only within these (array, first, end) ranges: every subgroup none of\n"
           "them falls in is let go.")
      .def("close", &tiering::FrozenState::close, "error"_a = "", nb::call_guard<nb::gil_scoped_release>(),
           "The reader is done (or failed: error says why); steps keep nothing from now on.")
      .def("wait", &tiering::FrozenState::wait, nb::call_guard<nb::gil_scoped_release>(),
           "Blocks until closed; OSError when closed with an error or given up on.")
      .def_prop_ro("target", [](const tiering::FrozenState& f) { return f.target(); })
      .def("progress", [](const tiering::FrozenState& f) { return progress_dict(f.progress()); },
           "As StateSnapshot.progress(): bytes_written is what was read.");
  m.def("read_checkpoint_manifest", [](const std::string& folder, bool verify) {
        tiering::SnapshotManifest man;
        {
          nb::gil_scoped_release nogil;
          man = tiering::StateSnapshot::read_manifest(folder, verify);
        }
        nb::dict d;
        d["params"] = man.params;
        d["offsets"] = std::vector<std::uint64_t>{man.offsets[0], man.offsets[1], man.offsets[2]};
        d["file_bytes"] = man.file_bytes;
        d["subgroups"] = man.subgroups;
        d["data"] = tiering::StateSnapshot::kData;
        d["meta"] = tiering::StateSnapshot::kMeta;
        return d;
      }, "folder"_a, "verify"_a = true,
      "A checkpoint folder's manifest ({params, subgroups, data, meta}); with verify every subgroup's\n"
      "checksum is checked. OSError naming what is missing, cut short or corrupt.");
  m.def("read_checkpoint_parts", [](const std::string& folder) {
        nb::gil_scoped_release nogil;
        return tiering::StateSnapshot::read_parts(folder);
      }, "folder"_a,
      "The part folders of a checkpoint saved in parts ([] for a whole one), each checked to be there.\n"
      "OSError naming what is missing.");

  bind_results(m);

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
      .def("set_layout", &PyUpdateEngine::set_layout, "ranges"_a, "groups"_a, "low_precision"_a,
           "Where the optimizer's params lie: per param its [start, end) of the flat arrays (consecutive from\n"
           "0, covering them), its param group and whether the model's copy is fp16/bf16. Step counts start at 0.")
      .def("set_policy", &PyUpdateEngine::set_policy, "policy"_a, "k"_a = nb::none(), "static_fraction"_a = 0.0,
           "The policy step() plans with (cpu, static, interleaved, auto), its stride `k` (one in every k\n"
           "subgroups on the GPU; None under auto: the PerfModel searches) and GPU-resident share.")
      .def_prop_ro("plan", &PyUpdateEngine::plan,
                   "The Plan the next step runs (made now if there is none; under auto without k, every step\n"
                   "plans anew from the phase tracker's memory and the calibrated rates).")
      .def("step", &PyUpdateEngine::step, "groups"_a, "has_grad"_a, "grad_scale"_a = 1.0, "clip"_a = 1.0,
           "skip_if_nonfinite"_a = false, "grads_finite"_a = nb::none(), "done"_a = std::vector<bool>{},
           "grad_sources"_a = std::vector<std::tuple<std::int64_t, std::int64_t, std::uintptr_t, std::string>>{},
           "The optimizer's step: `groups` the StepParams of each param group, `has_grad` a byte per param.\n"
           "The engine cuts it into segments, plans it under its policy, runs it (subgroups flagged in `done`\n"
           "were updated during backward and are left as they are), learns from what it measured and counts\n"
           "a step per param with a gradient. `grads_finite`: the gradient path's verdict when every\n"
           "gradient came through it. `grad_sources`: (start, n, address, dtype) of gradients the CPU update\n"
           "reads where they lie (CPU tensors; dtype float32, float16 or bfloat16) instead of the gradient array;\n"
           "only for an all-CPU step whose verdict needs no scan. Returns a StepReport.")
      .def("segments", &PyUpdateEngine::segments, "groups"_a, "has_grad"_a, "only"_a = nb::none(),
           "The Segments step() would run with these arguments (only subgroup `only` when given).")
      .def("steps", [](nb::handle self) { return nb::cast<PyUpdateEngine&>(self).steps(self); },
           "Every param's step count: a float32 DLPack array over the engine's own (torch.from_dlpack makes\n"
           "a tensor of it; writable; it keeps the engine alive).")
      .def("set_sync_after_step", &PyUpdateEngine::set_sync_after_step, "on"_a,
           "Copy GPU-static residents' newest state into the host arrays after every step.")
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
      .def("save_async", &PyUpdateEngine::save_async, "target"_a, "buffer_bytes"_a, "meta"_a, "part"_a = nb::none(),
           "Starts saving params, exp_avg and exp_avg_sq to the folder `target` while steps go on (a\n"
           "StateSnapshot); `meta` is saved beside them as meta.pt. A running save is waited for first.\n"
           "`part` (id, names, index): this process's part of a checkpoint saved in parts.")
      .def("running_save", &PyUpdateEngine::running_save, "The running save (a StateSnapshot or FrozenState), or None.")
      .def("freeze", &PyUpdateEngine::freeze, "needed"_a, "buffer_bytes"_a = 0, "stall_s"_a = 300.0, "target"_a = "",
           "Freezes params, exp_avg and exp_avg_sq for a reader that is not memtide's (a FrozenState): until\n"
           "the reader has read `needed` ((array, first, end) ranges, each as often as given) or closes\n"
           "it, every step keeps what it changes (a copy within buffer_bytes, 0: two of the largest\n"
           "subgroup, else a wait for the reader). A running save is waited for first. ValueError with\n"
           "the NVMe tier.")
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
      .def_prop_ro("simulated", &PyUpdateEngine::simulated, "Its times are on a virtual clock (a SimDevice).")
      .def_prop_ro("host_memory", &PyUpdateEngine::host_memory,
                   "Its device memory is host memory (a SimDevice in data mode): CPU tensors reach it.");

  nb::class_<tiering::BackwardStats>(m, "BackwardStats", "What the updates during backward have done so far.")
      .def_ro("speculated", &tiering::BackwardStats::speculated)
      .def_ro("kept", &tiering::BackwardStats::kept)
      .def_ro("redone", &tiering::BackwardStats::redone)
      .def_ro("rolled_back", &tiering::BackwardStats::rolled_back);
  nb::class_<tiering::BackwardChoice>(m, "BackwardChoice", "How the subgroups for the next backward were chosen.")
      .def_ro("rule", &tiering::BackwardChoice::rule, "count (untimed) or time")
      .def_ro("subgroups", &tiering::BackwardChoice::subgroups)
      .def_ro("candidates", &tiering::BackwardChoice::candidates)
      .def_ro("ns_per_param", &tiering::BackwardChoice::ns_per_param)
      .def_ro("backward_tail_s", &tiering::BackwardChoice::backward_tail_s);

  using BU = tiering::BackwardUpdates;
  nb::class_<BU>(m, "BackwardUpdates",
                 "Updates during backward (tiering::BackwardUpdates): speculative, bit-exact CPU updates of the\n"
                 "subgroups whose gradients are complete, on memtide's own worker, while backward goes on.")
      .def("__init__",
           [](BU* self, PyUpdateEngine& engine, std::size_t max_subgroups) {
             new (self) BU(engine.native(), max_subgroups);
           },
           "engine"_a, "max_subgroups"_a, nb::keep_alive<1, 2>())
      .def_static("default_max_subgroups", &BU::default_max_subgroups, "subgroups"_a,
                  "The bound update_during_backward=True asks for: a quarter of the subgroups, at least one.")
      .def("rebuild", &BU::rebuild, "takes_part"_a, nb::call_guard<nb::gil_scoped_release>(),
           "The layout changed: per param, whether its gradient arrives by the hook. Rolls back, chooses.")
      .def("set_model_copy",
           [](BU& self, std::uintptr_t address, const std::string& dtype) {
             tiering::DType dt = tiering::DType::none;
             if (dtype == "bfloat16") dt = tiering::DType::bf16;
             else if (dtype == "float16") dt = tiering::DType::fp16;
             else if (address != 0) value_error("BackwardUpdates.set_model_copy: dtype must be float16 or bfloat16");
             self.set_model_copy(reinterpret_cast<void*>(address), dt);
           },
           "address"_a, "dtype"_a = "",
           "The model's fp16/bf16 params in host memory when they are not the engine's buffer (0: none).")
      .def("choose", &BU::choose, "ns_per_param"_a = nb::none(), nb::call_guard<nb::gil_scoped_release>(),
           "Chooses the subgroups of the next backward (ns_per_param: the worker's cost per param to assume).")
      .def_prop_rw("max_subgroups", &BU::max_subgroups, &BU::set_max_subgroups)
      .def_prop_ro("ready_ns", &BU::ready_ns, "When each subgroup's gradients were complete in the last backward.")
      .def("backward_started", &BU::backward_started)
      .def("backward_ended", &BU::backward_ended)
      .def("grad_ready", &BU::grad_ready, "param"_a,
           "Param i's gradient is in place; returns the chosen subgroups it completed (submit them).")
      .def(
          "submit",
          [](BU& self, std::size_t g, std::vector<tiering::StepParams> groups, const nb::bytes& has_grad,
             double grad_scale) {
            tiering::StepRequest r = PyUpdateEngine::request(std::move(groups), has_grad, grad_scale, 1.0, false,
                                                             std::nullopt, {});
            self.submit(g, r);
          },
          "subgroup"_a, "groups"_a, "has_grad"_a, "grad_scale"_a,
          "Starts the subgroup's update on the worker with the step's inputs of this moment.")
      .def("settle", &BU::settle, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for every update begun; when one failed, puts every one back and raises.")
      .def(
          "accept",
          [](BU& self, std::vector<tiering::StepParams> groups, const nb::bytes& has_grad, double grad_scale, double clip,
             const std::vector<bool>& stale, bool scaler) {
            const tiering::StepRequest r =
                PyUpdateEngine::request(std::move(groups), has_grad, grad_scale, clip, false, std::nullopt, {});
            nb::gil_scoped_release nogil;
            return self.accept(r, stale, scaler);
          },
          "groups"_a, "has_grad"_a, "grad_scale"_a, "clip"_a, "stale"_a, "scaler"_a,
          "Per subgroup: the step takes its update as done; the others are put back now.")
      .def_prop_ro("nonfinite", &BU::nonfinite)
      .def("publish", &BU::publish, nb::call_guard<nb::gil_scoped_release>(),
           "The step stands: the kept updates' new params take their place.")
      .def("finish", &BU::finish, nb::call_guard<nb::gil_scoped_release>(),
           "The step is over: the next backward starts afresh, the choice is made anew.")
      .def("rollback", &BU::rollback, nb::call_guard<nb::gil_scoped_release>(),
           "Puts back every update begun since the last step.")
      .def_prop_ro("pending", &BU::pending)
      .def_prop_ro("stats", &BU::stats)
      .def_prop_ro("last_choice", &BU::last_choice)
      .def_prop_ro("chosen", &BU::chosen);

  nb::enum_<tiering::GradRoute>(m, "GradRoute", "How a gradient reaches the engine (tiering::GradRoute).")
      .value("device_path", tiering::GradRoute::device_path,
             "device memory: the engine's gradient path (upcast on the device, D2H, checked on the way)")
      .value("host_copy", tiering::GradRoute::host_copy,
             "host memory: copied (upcast) into the gradient array now, checked in the same pass")
      .value("in_place", tiering::GradRoute::in_place,
             "host memory: read where it lies by the step (keep the tensor alive until the step ends)");

  using SO = tiering::StepOutcome;
  nb::class_<SO>(m, "StepOutcome", "What one step of the StepProtocol decided and did.")
      .def_ro("any_gradient", &SO::any_gradient, "some param had a gradient (else nothing was decided)")
      .def_ro("nonfinite", &SO::nonfinite, "a gradient was NaN or Inf (on any rank, where that was asked)")
      .def_ro("skipped", &SO::skipped, "nothing changed (a loss scaler's overflow, a non-finite norm)")
      .def_ro("ran", &SO::ran, "the engine stepped")
      .def_ro("grad_norm", &SO::grad_norm, "the global gradient norm (unscaled) when clipping, else None")
      .def_ro("clip", &SO::clip, "the factor every gradient was multiplied by")
      .def_ro("kept_from_backward", &SO::kept_from_backward,
              "subgroups whose update during backward the step took as done")
      .def_ro("verdict", &SO::verdict, "the kernels' NaN/Inf verdict on every gradient, None where none gave one")
      .def_ro("engine", &SO::engine, "the engine's StepReport (meaningful when ran)");

  using SP = tiering::StepProtocol;
  nb::class_<SP>(m, "StepProtocol",
                 "The step's decisions (tiering::StepProtocol): the NaN/Inf verdict from the kernels' flags, the\n"
                 "gradient norm, the cross-rank agreement, the clip factor, skip or step, and the updates made\n"
                 "during backward taken or put back. One call per gradient arrival, one per step.")
      .def("__init__",
           [](SP* self, PyUpdateEngine& engine, std::optional<double> max_grad_norm, bool loss_scaler,
              std::vector<bool> sharded, std::optional<nb::callable> sum_sharded, std::optional<nb::callable> any,
              BU* backward_updates) {
             tiering::ProtocolOptions o;
             o.max_grad_norm = max_grad_norm;
             o.loss_scaler = loss_scaler;
             o.sharded = std::move(sharded);
             // The step runs without the GIL; the process groups' reductions are Python calls.
             if (sum_sharded) {
               o.collective.sum_sharded = [f = *sum_sharded](double v) {
                 nb::gil_scoped_acquire gil;
                 return nb::cast<double>(f(v));
               };
             }
             if (any) {
               o.collective.any = [f = *any](bool flag) {
                 nb::gil_scoped_acquire gil;
                 return nb::cast<bool>(f(flag));
               };
             }
             new (self) SP(engine.native(), std::move(o), backward_updates);
           },
           "engine"_a, "max_grad_norm"_a = nb::none(), "loss_scaler"_a = false, "sharded"_a = std::vector<bool>{},
           "sum_sharded"_a = nb::none(), "any"_a = nb::none(), "backward_updates"_a = nb::none(),
           nb::keep_alive<1, 2>(), nb::keep_alive<1, 8>(),
           "Over `engine`'s layout. `sharded`: per param, its squares sum over the ranks through\n"
           "`sum_sharded(value) -> float`; `any(flag) -> bool`: whether a flag is set on any rank.")
      .def(
          "grad_ready",
          [](SP& self, std::size_t param, std::uintptr_t address, const std::string& dtype, std::int64_t n,
             tiering::GradRoute how, std::uintptr_t stream, bool speculate) {
            tiering::GradArrival g;
            g.data = reinterpret_cast<const void*>(address);
            g.dtype = grad_dtype(dtype, "StepProtocol.grad_ready");
            g.n = count_arg("n", n);
            g.how = how;
            g.producer = Stream{reinterpret_cast<void*>(stream)};
            nb::gil_scoped_release nogil;
            return self.grad_ready(param, g, speculate);
          },
          "param"_a, "address"_a, "dtype"_a, "n"_a, "how"_a, "stream"_a = 0, "speculate"_a = false,
          "Param's gradient is final: sent on its way, its verdict kept. Returns the subgroups of the updates\n"
          "during backward it completed (start each with BackwardUpdates.submit).")
      .def_prop_ro(
          "grad_entry",
          [](SP& self) {
            return std::make_tuple(reinterpret_cast<std::uintptr_t>(&memtide_step_protocol_grad_ready),
                                   reinterpret_cast<std::uintptr_t>(&self));
          },
          "(function, protocol): the addresses of grad_ready's C entry (memtide/tiering/engine/grad_entry.h)\n"
          "and of this protocol, for gradient hooks in C++; valid while this object lives.")
      .def("grad_written", &SP::grad_written, "param"_a,
           "The front end wrote param's gradient into the engine's array itself (no verdict).")
      .def("collect", &SP::collect, "stale"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Before the step: waits for the gradient path and forgets the stale params' arrivals.")
      .def(
          "step",
          [](SP& self, std::vector<tiering::StepParams> groups, const nb::bytes& has_grad, double grad_scale,
             const std::vector<bool>& stale) {
            const tiering::StepRequest r =
                PyUpdateEngine::request(std::move(groups), has_grad, grad_scale, 1.0, false, std::nullopt, {});
            nb::gil_scoped_release nogil;
            return self.step(r, stale);
          },
          "groups"_a, "has_grad"_a, "grad_scale"_a, "stale"_a = std::vector<bool>{},
          "The step: decides, runs the engine, returns a StepOutcome. Every arrival is forgotten after.")
      .def("rollback", &SP::rollback, nb::call_guard<nb::gil_scoped_release>(),
           "Puts back every update made during backward; the arrivals stay.")
      .def("reset", &SP::reset, "Forgets the arrivals: the next backward sends its own.")
      .def("set_max_grad_norm", &SP::set_max_grad_norm, "max_grad_norm"_a.none(),
           "What the next steps clip the global gradient norm to (None: no clipping).")
      .def("set_loss_scaler", &SP::set_loss_scaler, "on"_a, "Whether a loss scaler decides from now on.")
      .def_prop_ro("in_place_count", &SP::in_place_count, "Gradients the step reads where they lie now.");
}

}  // namespace memtide::bindings
