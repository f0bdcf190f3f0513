// The update-phase sweep (update_sweep.hpp): each row one update phase of one GPU's shard on a
// phantom SimDevice, run twice so that the static residents' one-time move-in is not timed.
#include "memtide/simulator/update_sweep.hpp"

#include <chrono>
#include <cmath>
#include <memory>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/simulator/iteration_sim.hpp"
#include "memtide/tiering/engine/optimizer_state.hpp"
#include "memtide/tiering/engine/update_scheduler.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "sim_checks.hpp"

namespace memtide::tiering {
namespace {

// k = 1, 1.1, ..., 3 (where the optimum lies for these rates), then coarser; the plan's own k is
// added per model.
std::vector<double> sweep_ks() {
  std::vector<double> ks;
  for (int i = 10; i <= 30; ++i) ks.push_back(i / 10.0);
  for (double k : {4.0, 5.0, 6.0, 8.0}) ks.push_back(k);
  return ks;
}

SimConfig sim_config(const UpdateSweepSetup& setup) {
  SimConfig config;
  config.phantom = true;
  config.host_dram_bytes_per_s = setup.host_dram_bytes_per_s;
  return config;
}

Workload workload_of(const UpdateSweepSetup& setup, std::size_t shard, bool grads_on_gpu) {
  Workload w;
  for (std::size_t left = shard; left > 0; left -= std::min(left, setup.subgroup_params)) {
    w.subgroup_params.push_back(std::min(left, setup.subgroup_params));
  }
  w.low_precision_bytes = 2;
  w.grads_on_host = !grads_on_gpu;
  w.gpu_slot_limit = setup.gpu_slots;
  w.gpu_static_limit = 0;  // the sweep has no static residents either
  return w;
}

StepReport simulate_phase(const UpdateSweepSetup& setup, std::size_t shard, const Plan& plan, bool grads_on_gpu) {
  SimDevice dev(sim_config(setup));
  CachingAllocator allocator(dev);
  auto state = OptimizerState::phantom(dev, shard, setup.subgroup_params);
  void* model = allocator.allocate(shard * 2, Stream{});
  state->set_model_params(model, DType::bf16);
  std::vector<void*> kept;
  if (grads_on_gpu) {
    for (std::size_t i = 0; i < state->size(); ++i) {
      if (plan.placement[i] == Placement::cpu) continue;
      kept.push_back(allocator.allocate((*state)[i].n * 4, Stream{}));
      (*state)[i].device_grad = static_cast<const float*>(kept.back());
    }
  }
  StepReport report;
  {
    UpdateScheduler sched(*state, allocator, nullptr);
    StepParams params;
    params.grads_finite = true;  // checked on the GPU by the gradient path during backward
    (void)sched.run(plan, params);  // the first phase moves the static residents in
    params.step = 2;
    report = sched.run(plan, params);
    sched.release_residents();
  }
  for (void* p : kept) allocator.deallocate(p, Stream{});
  allocator.deallocate(model, Stream{});
  return report;
}

}  // namespace

void UpdateSweepSetup::validate() const {
  using sim::require;
  require(host_dram_bytes_per_s > 0 && std::isfinite(host_dram_bytes_per_s),
          "update sweep: host_dram_bytes_per_s must be a positive rate, got " + std::to_string(host_dram_bytes_per_s));
  require(gpus >= 1 && gpus <= 1024, "update sweep: gpus must be 1 to 1024, got " + std::to_string(gpus));
  require(gpu_slots >= 1 && gpu_slots <= 1024, "update sweep: gpu_slots must be 1 to 1024, got " + std::to_string(gpu_slots));
  require(subgroup_params >= 1, "update sweep: subgroup_params must be positive");
  for (const std::string& name : models) (void)ModelShape::table2(name);  // names the accepted ones
}

UpdateSweep simulate_update_sweep(const UpdateSweepSetup& setup) {
  setup.validate();
  const std::vector<std::string> names =
      setup.models.empty() ? std::vector<std::string>{"7B", "8.3B", "10B", "13B", "20B"} : setup.models;
  const Rates rates = sim_rates(sim_config(setup));
  const PerfModel model;
  UpdateSweep out;
  for (const std::string& name : names) {
    const double params = ModelShape::table2(name).nominal_params;
    const auto shard = static_cast<std::size_t>(params / setup.gpus);
    const std::size_t n = (shard + setup.subgroup_params - 1) / setup.subgroup_params;
    double cpu_s = 0;
    auto row = [&](const char* policy, const Plan& plan, bool grads_on_gpu) {
      std::size_t on_gpu = 0;
      for (Placement p : plan.placement) on_gpu += p != Placement::cpu;
      Workload w = workload_of(setup, shard, grads_on_gpu);
      w.gpu_slot_limit = plan.gpu_slots;
      w.gpu_static_limit = plan.static_residents;
      const Prediction pred = model.predict(w, rates, plan.placement);
      const auto t0 = std::chrono::steady_clock::now();
      const StepReport s = simulate_phase(setup, shard, plan, grads_on_gpu);
      UpdateSweepRow r;
      r.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      r.model = name;
      r.policy = policy;
      r.params = params;
      r.shard_params = shard;
      r.subgroups = n;
      r.k = plan.k;
      r.statics = plan.static_residents;
      r.slots = plan.gpu_slots;
      r.gpu_fraction = static_cast<double>(on_gpu) / static_cast<double>(n);
      r.grads_on_gpu = grads_on_gpu;
      r.update_s = s.phase_ns / 1e9;
      if (cpu_s == 0) cpu_s = r.update_s;
      r.predicted_s = pred.total_ns / 1e9;
      r.bound_s = pred.bound_ns / 1e9;
      r.throughput_gps = params / r.update_s / 1e9;
      r.speedup_vs_cpu = cpu_s / r.update_s;
      r.cpu_busy_s = s.cpu.busy_ns / 1e9;
      r.gpu_busy_s = s.gpu.busy_ns / 1e9;
      r.h2d_busy_s = s.h2d.busy_ns / 1e9;
      r.d2h_busy_s = s.d2h.busy_ns / 1e9;
      r.h2d_d2h_overlap_s = s.h2d_d2h_overlap_ns / 1e9;
      out.rows.push_back(r);
      return r.update_s;
    };
    auto fixed = [&](std::vector<Placement> placement, double k, std::size_t statics) {
      Plan p;
      p.placement = std::move(placement);
      p.k = k;
      p.static_residents = statics;
      p.gpu_slots = setup.gpu_slots;
      return p;
    };
    (void)row("cpu", fixed(interleave(n, 0, 0), 0, 0), false);
    const auto statics = static_cast<std::size_t>(std::lround(0.2 * static_cast<double>(n)));
    const double static_s = row("static20", fixed(interleave(n, 0, statics), 0, statics), false);
    for (const bool grads_on_gpu : {false, true}) {
      // The plan first, so that its k joins the sweep.
      const Plan plan = model.plan(workload_of(setup, shard, grads_on_gpu), rates, Policy::automatic);
      UpdateSweepVerdict v;
      v.model = name;
      v.grads_on_gpu = grads_on_gpu;
      v.cpu_s = cpu_s;
      v.static20_s = static_s;
      v.plan_k = plan.k;
      v.plan_predicted_s = plan.prediction.total_ns / 1e9;
      v.plan_s = row("auto", plan, grads_on_gpu);
      std::vector<double> ks = sweep_ks();
      if (plan.k > 0) ks.push_back(plan.k);
      v.best_s = INFINITY;
      for (double k : ks) {
        const double t = row("interleaved", fixed(interleave(n, k, 0), k, 0), grads_on_gpu);
        if (t < v.best_s) v.best_s = t, v.best_k = k;
      }
      v.within_tolerance = v.plan_s <= v.best_s * (1 + UpdateSweep::tolerance);
      out.verdicts.push_back(v);
    }
  }
  return out;
}

}  // namespace memtide::tiering
