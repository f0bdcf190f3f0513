// The update phase of a large fp32 optimizer state on the device the runtime opens (CUDA when a
// GPU answers), under each policy: measured time against the PerfModel's prediction and against
// the resource bound, with every rate the model uses measured in the same run.
//
// Host state lives in the runtime's HostArena (NUMA-bound, registered slabs), the model's bf16
// params and the GPU slots in its CachingAllocator, and the phase runs on the UpdateScheduler:
// the path TieredAdamW's engine takes, minus torch. Gradients are taken as already checked
// (as when the gradient path checks them on the GPU during backward).
//
// Rates: PCIe each way and the GPU step from an all-GPU streamed phase, the CPU step from an
// all-CPU phase (both on the scheduler, second run of each), host DRAM from the step's memory
// roof (stream_probe: its 28 B/param streams on the same thread pool). On a simulated device the
// phases run on its virtual clock and DRAM is its model's figure (a smoke test of the program,
// not a measurement of this machine).
//
// Usage: memtide_bench_update_phase [--device auto|cuda|sim] [--params N] [--subgroup N]
//          [--steps N] [--k STRIDE] [--static-fraction F] [--headroom BYTES]
//          [--policies cpu,static,interleaved,auto] [--out FILE.md]
// --headroom caps the device memory the plans may use (slots and static residents), as the
// update phase of a training run leaves it; by default the device's free memory less 1 GiB.
// Exit: 0 done, 2 bad arguments, 1 a failure (named on stderr).

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/runtime/runtime.hpp"
#include "memtide/tiering/kernels/bandwidth_probe.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/engine/optimizer_state.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/tiering/engine/update_scheduler.hpp"

using namespace memtide;
using namespace memtide::tiering;

namespace {

struct Args {
  std::string device = "auto";
  std::size_t params = 2'000'000'000;
  std::size_t subgroup = 100'000'000;
  int steps = 3;
  double k = 2;
  double static_fraction = 0.2;
  std::uint64_t headroom = 0;  ///< device bytes the plan may use; 0 = free memory less 1 GiB
  std::string headroom_text;
  std::vector<Policy> policies{Policy::cpu, Policy::static_split, Policy::interleaved, Policy::automatic};
  std::string out;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "memtide_bench_update_phase: %s\n"
               "usage: memtide_bench_update_phase [--device auto|cuda|sim] [--params N] [--subgroup N] [--steps N]\n"
               "         [--k STRIDE] [--static-fraction F] [--headroom BYTES] [--policies cpu,static,interleaved,auto]\n"
               "         [--out FILE.md]\n",
               why.c_str());
  std::exit(2);
}

double number(const char* flag, const char* v) {
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (end == v || *end != '\0' || !std::isfinite(x)) usage(std::string(flag) + " needs a number, got '" + v + "'");
  return x;
}

Policy policy_of(const std::string& name) {
  if (name == "cpu") return Policy::cpu;
  if (name == "static") return Policy::static_split;
  if (name == "interleaved") return Policy::interleaved;
  if (name == "auto") return Policy::automatic;
  usage("--policies: '" + name + "' is not a policy (cpu, static, interleaved, auto)");
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::cpu: return "cpu";
    case Policy::static_split: return "static";
    case Policy::interleaved: return "interleaved";
    case Policy::automatic: return "auto";
  }
  return "?";
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--device") {
      a.device = value();
      if (a.device != "auto" && a.device != "cuda" && a.device != "sim") usage("--device must be auto, cuda or sim");
    } else if (flag == "--params" || flag == "--subgroup") {
      const double x = number(flag.c_str(), value());
      if (!(x >= 1 && x <= 1e12)) usage(flag + " must be in [1, 1e12]");
      (flag == "--params" ? a.params : a.subgroup) = static_cast<std::size_t>(x);
    } else if (flag == "--steps") {
      const double x = number("--steps", value());
      if (!(x >= 1 && x <= 100) || x != std::floor(x)) usage("--steps must be an integer in [1, 100]");
      a.steps = static_cast<int>(x);
    } else if (flag == "--k") {
      a.k = number("--k", value());
      if (!(a.k >= 1)) usage("--k (the stride: one in every k subgroups on the GPU) must be >= 1");
    } else if (flag == "--static-fraction") {
      a.static_fraction = number("--static-fraction", value());
      if (!(a.static_fraction >= 0 && a.static_fraction <= 1)) usage("--static-fraction must be in [0, 1]");
    } else if (flag == "--policies") {
      a.policies.clear();
      std::string list = value();
      for (std::size_t s = 0; s <= list.size();) {
        const std::size_t e = std::min(list.find(',', s), list.size());
        a.policies.push_back(policy_of(list.substr(s, e - s)));
        s = e + 1;
      }
    } else if (flag == "--headroom") {
      const char* v = value();
      const auto b = parse_bytes(v);
      if (!b || *b == 0) usage(std::string("--headroom needs a size such as 16GiB, got '") + v + "'");
      a.headroom = *b;
      a.headroom_text = v;
    } else if (flag == "--out") {
      a.out = value();
    } else {
      usage("unknown argument '" + flag + "'");
    }
  }
  if (a.subgroup > a.params) usage("--subgroup must not exceed --params");
  return a;
}

double wall_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

std::string placement_letters(const std::vector<Placement>& p) {
  std::string s;
  for (Placement x : p) s += x == Placement::cpu ? 'c' : x == Placement::gpu ? 'g' : 's';
  return s;
}

std::string fixed(double x, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Device memory the plans may use: `headroom`, or the device's free memory less a margin.
std::uint64_t plan_room(Device& device, std::uint64_t headroom) {
  constexpr std::uint64_t kMargin = 1ULL << 30;
  const std::uint64_t free = device.mem_info().free;
  const std::uint64_t room = free > kMargin ? free - kMargin : 0;
  return headroom > 0 ? std::min(room, headroom) : room;
}

// The resource bound of the workload: over the placements the planner can express (any number
// of static residents it may hold, any stride), the least busiest-resource time.
double resource_bound_ns(const PerfModel& model, const Workload& w, const Rates& r, std::string& where) {
  const std::size_t n = w.subgroup_params.size();
  double best = INFINITY;
  for (std::size_t statics = 0; statics <= std::min(w.gpu_static_limit, n); ++statics) {
    const std::size_t streamable = n - statics;
    for (std::size_t g = 0; g <= streamable; ++g) {
      if (g > 0 && w.gpu_slot_limit == 0) break;
      const double k = g == 0 ? 0 : static_cast<double>(streamable) / static_cast<double>(g);
      const auto placement = interleave(n, k, statics);
      const double b = model.predict(w, r, placement).bound_ns;
      if (b < best) best = b, where = placement_letters(placement);
    }
  }
  return best;
}

struct PolicyRow {
  Policy policy;
  Plan plan;
  double measured_ns = 0;
  double placement_bound_ns = 0;
  StepReport report;
};

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  ::setenv("MEMTIDE_DEVICE", args.device.c_str(), 1);
  try {
    if (args.device == "cuda" && !cuda_status().usable) {
      std::fprintf(stderr, "memtide_bench_update_phase: --device cuda, but CUDA is not usable here: %s\n",
                   cuda_status().reason.c_str());
      return 1;
    }
    Runtime& rt = Runtime::get();
    CachingAllocator& allocator = rt.allocator(0);
    Device& device = allocator.device();
    const DeviceProperties& props = device.properties();
    const bool simulated = props.backend != "cuda";
    ThreadPool& pool = default_pool();
    std::fprintf(stderr, "device %s (%s), %s of device memory; CPU: %zu threads, %s\n", props.name.c_str(),
                 props.backend.c_str(), format_bytes(props.total_memory).c_str(), pool.size(), adamw_isa());
    if (!device_ops_available(device)) {
      std::fprintf(stderr, "this build has no CUDA optimizer kernels: GPU placements cannot run\n");
      return 1;
    }

    // Host state: pinned, NUMA-bound slabs of the runtime's arena, one per subgroup.
    HostArena& arena = rt.host_arena(0);
    std::fprintf(stderr, "pinning %s of fp32 state (p, m, v, g) for %zuM params on NUMA node %d ...\n",
                 format_bytes(16ULL * args.params).c_str(), args.params / 1'000'000, rt.host_node(0));
    double t0 = wall_ns();
    auto state = OptimizerState::owned(device, arena, args.params, args.subgroup);
    const double pin_s = (wall_ns() - t0) / 1e9;
    const HostArenaStats hs = arena.stats();
    std::fprintf(stderr, "  %zu subgroups, %s pinned in %.1f s (map %.1f s, touch %.1f s, register %.1f s)\n",
                 state->size(), format_bytes(hs.reserved_bytes).c_str(), pin_s, hs.map_bind_seconds, hs.touch_seconds,
                 hs.register_seconds);
    void* model = allocator.allocate(args.params * 2, Stream{});
    state->set_model_params(model, DType::bf16);

    Workload w;
    for (std::size_t i = 0; i < state->size(); ++i) w.subgroup_params.push_back((*state)[i].n);
    w.low_precision_bytes = 2;
    w.grads_on_host = true;
    const std::uint64_t room = plan_room(device, args.headroom);
    fit_gpu_budget(w, GpuBudget{room, room});
    const std::size_t n = state->size();
    std::fprintf(stderr, "  device memory fits %zu streamed slots, %zu static residents\n", w.gpu_slot_limit,
                 w.gpu_static_limit);

    std::vector<PolicyRow> rows;
    Rates rates;
    double dram_roof_gbs = 0;
    std::string bound_where;
    double bound_ns = 0;
    {
      UpdateScheduler scheduler(*state, allocator, &pool);
      StepParams step;
      step.grads_finite = true;
      auto run = [&](const Plan& plan) {
        const StepReport r = scheduler.run(plan, step);
        ++step.step;
        return r;
      };

      // Rates, measured on the scheduler itself (second run of each: the first warms up).
      std::fprintf(stderr, "measuring rates ...\n");
      Plan all_cpu;
      all_cpu.placement = interleave(n, 0, 0);
      run(all_cpu);
      const Measurements cpu_m = run(all_cpu).measurements();
      Plan all_gpu;
      all_gpu.placement = interleave(n, 1, 0);
      all_gpu.gpu_slots = std::min(w.gpu_slot_limit, kUsefulSlots);
      Measurements gpu_m{};
      if (all_gpu.gpu_slots > 0) {
        run(all_gpu);
        gpu_m = run(all_gpu).measurements();
      }
      rates.cpu_update_params_per_s = cpu_m.cpu_update_params_per_ns * 1e9;
      if (gpu_m.h2d_bytes_per_ns > 0) rates.h2d_bytes_per_s = gpu_m.h2d_bytes_per_ns * 1e9;
      if (gpu_m.d2h_bytes_per_ns > 0) rates.d2h_bytes_per_s = gpu_m.d2h_bytes_per_ns * 1e9;
      if (gpu_m.gpu_update_params_per_ns > 0) rates.gpu_update_params_per_s = gpu_m.gpu_update_params_per_ns * 1e9;
      rates.cpu_dram_bytes_per_param = adamw_bytes_per_param(DType::fp32, DType::bf16);
      if (simulated) {
        rates.host_dram_bytes_per_s = SimConfig{}.host_dram_bytes_per_s;
      } else {
        // The step's memory roof: its streams with no arithmetic, on the same pool (best of 3).
        const std::size_t m = std::min<std::size_t>(args.subgroup, 1ULL << 27);
        auto* p = static_cast<float*>(arena.allocate(m * 4));
        auto* mm = static_cast<float*>(arena.allocate(m * 4));
        auto* v = static_cast<float*>(arena.allocate(m * 4));
        auto* g = static_cast<std::uint16_t*>(arena.allocate(m * 2));
        auto* o = static_cast<std::uint16_t*>(arena.allocate(m * 2));
        std::memset(g, 0, m * 2);
        double best = INFINITY;
        for (int rep = 0; rep < 4; ++rep) {
          const double s = wall_ns();
          stream_probe(p, mm, v, g, o, m, &pool);
          if (rep > 0) best = std::min(best, wall_ns() - s);
        }
        for (void* x : {static_cast<void*>(p), static_cast<void*>(mm), static_cast<void*>(v), static_cast<void*>(g),
                        static_cast<void*>(o)}) {
          arena.deallocate(x);
        }
        dram_roof_gbs = 28.0 * static_cast<double>(m) / best;
        // DRAM serves the CPU step and DMA together: at least what the CPU step alone moved.
        rates.host_dram_bytes_per_s =
            std::max(dram_roof_gbs * 1e9, rates.cpu_update_params_per_s * rates.cpu_dram_bytes_per_param);
      }

      const PerfModel perf;
      bound_ns = resource_bound_ns(perf, w, rates, bound_where);
      for (Policy policy : args.policies) {
        PolicyRow row;
        row.policy = policy;
        // auto searches unless told a stride; the fixed policies take the command's knobs.
        row.plan = policy == Policy::automatic ? perf.plan(w, rates, policy)
                                               : perf.plan(w, rates, policy, args.static_fraction, args.k);
        std::fprintf(stderr, "policy %-11s [%s] ...\n", policy_name(policy), placement_letters(row.plan.placement).c_str());
        run(row.plan);  // moves static residents in (a one-time cost, not part of the phase)
        std::vector<double> times;
        for (int s = 0; s < args.steps; ++s) {
          row.report = run(row.plan);
          times.push_back(row.report.phase_ns);
        }
        row.measured_ns = median(times);
        // The scheduler's own promises: a phase takes time, and nothing is allocated in its loop.
        if (!(row.measured_ns > 0) || row.report.loop_allocations != 0 || row.report.loop_device_allocs != 0) {
          throw std::runtime_error(std::string("policy ") + policy_name(policy) + ": phase of " +
                                   std::to_string(row.measured_ns) + " ns with " +
                                   std::to_string(row.report.loop_allocations) + " allocations inside the loop");
        }
        row.placement_bound_ns = row.plan.prediction.bound_ns;
        scheduler.release_residents();
        std::fprintf(stderr, "  measured %s, predicted %s, bound %s\n", format_duration_ns(row.measured_ns).c_str(),
                     format_duration_ns(row.plan.prediction.total_ns).c_str(),
                     format_duration_ns(row.placement_bound_ns).c_str());
        rows.push_back(row);
      }
    }
    allocator.deallocate(model, Stream{});

    // The report: Markdown to --out (and stdout).
    std::string md;
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    md += "# Update phase on " + props.name + " (" + std::to_string(args.params / 1'000'000) + "M fp32 params)\n\n";
    md += "Date " + std::string(date) + ". Command: `memtide_bench_update_phase --device " + args.device + " --params " +
          std::to_string(args.params) + " --subgroup " + std::to_string(args.subgroup) + " --steps " +
          std::to_string(args.steps) + " --k " + fixed(args.k, 2) + " --static-fraction " +
          fixed(args.static_fraction, 2) + (args.headroom ? " --headroom " + args.headroom_text : "") + "`";
    md += simulated ? " (simulated device: virtual clock; DRAM is the simulator's model, not measured)\n\n"
                    : " (real device: wall clock)\n\n";
    md += "- device: " + props.name + ", " + format_bytes(props.total_memory) + "; " + std::to_string(n) +
          " subgroups of up to " + std::to_string(state->largest_subgroup()) + " params, bf16 model params, fp32 grads on the host\n";
    md += "- host: " + std::to_string(pool.size()) + " CPU threads (" + adamw_isa() + "), state " +
          format_bytes(hs.reserved_bytes) + " pinned on NUMA node " + std::to_string(rt.host_node(0)) + " in " +
          fixed(pin_s, 1) + " s\n";
    md += "- the plan may use " + format_bytes(room) + " of device memory (" +
          (args.headroom ? std::string("--headroom, as a training run's update phase leaves it")
                         : std::string("free memory less 1 GiB")) +
          "): " + std::to_string(w.gpu_slot_limit) + " streamed slots or " + std::to_string(w.gpu_static_limit) +
          " static residents besides 3 slots\n\n";
    md += "## Rates measured in this run\n\n| rate | value | from |\n|---|---|---|\n";
    md += "| PCIe H2D | " + fixed(rates.h2d_bytes_per_s / 1e9, 1) + " GB/s | all-GPU streamed phase |\n";
    md += "| PCIe D2H | " + fixed(rates.d2h_bytes_per_s / 1e9, 1) + " GB/s | all-GPU streamed phase |\n";
    md += "| GPU AdamW step | " + fixed(rates.gpu_update_params_per_s / 1e9, 2) + " G params/s | all-GPU streamed phase |\n";
    md += "| CPU AdamW step (fused bf16 copy) | " + fixed(rates.cpu_update_params_per_s / 1e9, 2) +
          " G params/s | all-CPU phase |\n";
    md += "| host DRAM | " + fixed(rates.host_dram_bytes_per_s / 1e9, 1) + " GB/s | " +
          (simulated ? std::string("the simulator's model")
                     : "the step's memory roof (stream_probe, " + fixed(dram_roof_gbs, 1) + " GB/s)") +
          " |\n\n";
    md += "Resource bound of this workload (best placement the planner can express, `" + bound_where +
          "`): " + format_duration_ns(bound_ns) + ".\n\n";
    md += "## Policies\n\n"
          "| policy | placement | measured | predicted | pred/meas | busiest (predicted) | bound of placement | "
          "% of its bound | % of best bound | G params/s |\n|---|---|---|---|---|---|---|---|---|---|\n";
    for (const PolicyRow& r : rows) {
      md += "| " + std::string(policy_name(r.policy)) + " | `" + placement_letters(r.plan.placement) + "` | " +
            format_duration_ns(r.measured_ns) + " | " + format_duration_ns(r.plan.prediction.total_ns) + " | " +
            fixed(r.plan.prediction.total_ns / r.measured_ns, 2) + " | " + r.plan.prediction.busiest + " | " +
            format_duration_ns(r.placement_bound_ns) + " | " + fixed(100 * r.placement_bound_ns / r.measured_ns, 1) +
            "% | " + fixed(100 * bound_ns / r.measured_ns, 1) + "% | " +
            fixed(static_cast<double>(args.params) / r.measured_ns, 2) + " |\n";
    }
    md += "\nMeasured busy time per resource in the last step of each policy:\n\n"
          "| policy | CPU | GPU | H2D | D2H | H2D+D2H overlap | loop allocations |\n|---|---|---|---|---|---|---|\n";
    for (const PolicyRow& r : rows) {
      const StepReport& s = r.report;
      md += "| " + std::string(policy_name(r.policy)) + " | " + format_duration_ns(s.cpu.busy_ns) + " | " +
            format_duration_ns(s.gpu.busy_ns) + " | " + format_duration_ns(s.h2d.busy_ns) + " | " +
            format_duration_ns(s.d2h.busy_ns) + " | " + format_duration_ns(s.h2d_d2h_overlap_ns) + " | " +
            std::to_string(s.loop_allocations) + " |\n";
    }
    std::fputs(md.c_str(), stdout);
    if (!args.out.empty()) {
      FILE* f = std::fopen(args.out.c_str(), "w");
      if (f == nullptr || std::fputs(md.c_str(), f) < 0 || std::fclose(f) != 0) {
        std::fprintf(stderr, "cannot write %s: %s\n", args.out.c_str(), std::strerror(errno));
        return 1;
      }
      std::fprintf(stderr, "wrote %s\n", args.out.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memtide_bench_update_phase: %s\n", e.what());
    return 1;
  }
}
