#include "memtide/tiering/model/perf_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "memtide/core/assert.hpp"
#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "model_inputs.hpp"

namespace memtide::tiering {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The planner's search budget: full predictions (O(n) each) per plan. kEvaluatedSubgroups / n
// keeps a plan's cost O(n) however many subgroups there are; kMinEvaluations is what the
// largest workloads still get. Static counts up to kExhaustiveStaticCounts are all searched.
constexpr std::size_t kEvaluatedSubgroups = std::size_t{1} << 22;
constexpr std::size_t kMinEvaluations = 8;
constexpr std::size_t kExhaustiveStaticCounts = 32;
// Larger workloads are first planned as this many merged subgroups (see PerfModel::plan).
constexpr std::size_t kProxySubgroups = 2048;

// Per-subgroup costs, shared by the busy-time sums and the walk.
struct Costs {
  double cpu_s_per_param;       // update (+ separate downscale) on the CPU
  double cpu_dram_per_param;    // host DRAM bytes the CPU moves per param
  double lp_bytes_per_param;    // low-precision params sent H2D after a CPU update
  double grad_per_param;        // H2D bytes of a GPU update's gradient from the host (see grad_upload)
  double out_per_param;         // D2H bytes of a flush

  Costs(const Workload& w, const Rates& r) {
    const bool separate_downscale = r.cpu_downscale_params_per_s > 0;
    const double lp = static_cast<double>(w.low_precision_bytes);
    cpu_s_per_param = 1 / r.cpu_update_params_per_s + (separate_downscale ? 1 / r.cpu_downscale_params_per_s : 0);
    // A separate downscale pass reads the fp32 params again and writes the low-precision copy.
    cpu_dram_per_param = r.cpu_dram_bytes_per_param + (separate_downscale ? kGradBytesPerParam + lp : 0);
    lp_bytes_per_param = lp;
    const double grads = w.grads_on_host ? kGradBytesPerParam : 0;
    grad_per_param = grads;
    out_per_param = kStateBytesPerParam;
  }
};

// The gradient bytes per param a GPU update of `subgroup` must upload.
double grad_upload(const Workload& w, const Costs& c, std::size_t subgroup) {
  return !w.grad_on_device.empty() && w.grad_on_device[subgroup] ? 0.0 : c.grad_per_param;
}

// What each resource must carry for one placement: the resource bound's ingredients.
struct Loads {
  double cpu_params = 0;       // updated on the CPU
  double gpu_params = 0;       // updated on the GPU (streamed and static)
  double streamed_params = 0;  // state streamed H2D and flushed D2H
  double grad_bytes = 0;       // fp32 gradients uploaded for GPU updates
  double nvme_params = 0;      // read from and written back to the NVMe tier
  double other_h2d_bytes = 0;  // copied by others in the phase (Workload::phase_h2d_bytes)
};

// Whether subgroup `i`'s state lives on the NVMe tier.
bool spilled(const Workload& w, std::size_t i) { return !w.on_nvme.empty() && w.on_nvme[i]; }

// The busy time of each resource and the busiest one.
void busy_times(const Loads& l, const Rates& r, const Costs& c, Prediction& out) {
  out.h2d_bytes = l.cpu_params * c.lp_bytes_per_param + l.streamed_params * kStateBytesPerParam + l.grad_bytes +
                  l.other_h2d_bytes;
  out.d2h_bytes = l.streamed_params * c.out_per_param;
  out.nvme_bytes = 2 * l.nvme_params * kStateBytesPerParam;
  out.dram_bytes = l.cpu_params * c.cpu_dram_per_param + out.h2d_bytes + out.d2h_bytes + out.nvme_bytes;
  out.cpu_ns = l.cpu_params * c.cpu_s_per_param * 1e9;
  out.gpu_ns = l.gpu_params / r.gpu_update_params_per_s * 1e9;
  out.h2d_ns = out.h2d_bytes / r.h2d_bytes_per_s * 1e9;
  out.d2h_ns = out.d2h_bytes / r.d2h_bytes_per_s * 1e9;
  out.dram_ns = out.dram_bytes / r.host_dram_bytes_per_s * 1e9;
  out.nvme_ns = l.nvme_params > 0 ? l.nvme_params * kStateBytesPerParam *
                                        (1 / r.nvme_read_bytes_per_s + 1 / r.nvme_write_bytes_per_s) * 1e9
                                  : 0;
  const std::pair<double, const char*> resources[] = {{out.cpu_ns, "cpu"}, {out.gpu_ns, "gpu"},
                                                      {out.h2d_ns, "h2d"}, {out.d2h_ns, "d2h"},
                                                      {out.dram_ns, "dram"}, {out.nvme_ns, "nvme"}};
  out.bound_ns = 0;
  out.busiest = "cpu";
  for (const auto& [ns, name] : resources) {
    if (ns > out.bound_ns) {
      out.bound_ns = ns;
      out.busiest = name;
    }
  }
}

void busy_times(const Workload& w, const Rates& r, const Costs& c, const std::vector<Placement>& placement,
                Prediction& out) {
  Loads l;
  for (std::size_t i = 0; i < placement.size(); ++i) {
    const auto p = static_cast<double>(w.subgroup_params[i]);
    if (spilled(w, i) && placement[i] != Placement::gpu_static) l.nvme_params += p;
    switch (placement[i]) {
      case Placement::cpu: l.cpu_params += p; break;
      case Placement::gpu: l.streamed_params += p; l.gpu_params += p; l.grad_bytes += p * grad_upload(w, c, i); break;
      case Placement::gpu_static: l.gpu_params += p; l.grad_bytes += p * grad_upload(w, c, i); break;
      case Placement::done: break;
    }
  }
  l.other_h2d_bytes = w.phase_h2d_bytes;
  busy_times(l, r, c, out);
}

// The pipeline walk: a fluid event simulation over four queues (CPU, H2D, GPU, D2H). Every task
// becomes ready when another one completes, so the only events are completions: O(n) of them,
// each handled in O(1).
}  // namespace

std::vector<std::size_t> nvme_read_order(const std::vector<Placement>& placement, const std::vector<bool>& spilled,
                                         std::size_t slots) {
  std::vector<std::size_t> streamed, order;
  std::vector<std::size_t> streamed_index(placement.size(), 0);
  for (std::size_t i = 0; i < placement.size(); ++i) {
    if (placement[i] != Placement::gpu) continue;
    streamed_index[i] = streamed.size();
    streamed.push_back(i);
  }
  auto add = [&](std::size_t i) {
    if (i < spilled.size() && spilled[i]) order.push_back(i);
  };
  slots = std::min(slots, streamed.size());
  for (std::size_t j = 0; j < slots; ++j) add(streamed[j]);
  for (std::size_t i = 0; i < placement.size(); ++i) {
    if (placement[i] == Placement::cpu) {
      add(i);
    } else if (placement[i] == Placement::gpu && streamed_index[i] + slots < streamed.size()) {
      add(streamed[streamed_index[i] + slots]);
    }
  }
  return order;
}

namespace {

class Walk {
 public:
  Walk(const Workload& w, const Rates& r, const Costs& c, const std::vector<Placement>& placement,
       std::size_t slots)
      : w_(w), r_(r), c_(c), slots_(slots) {
    // Others' copies at the phase's start hold the H2D link first (a job that feeds no task).
    if (w.phase_h2d_bytes > 0) h2d_job_ = {true, w.phase_h2d_bytes, 0, false};
    cpu_before_.reserve(placement.size());
    for (std::size_t i = 0; i < placement.size(); ++i) {
      cpu_before_.push_back(cpu_tasks_.size());
      if (placement[i] == Placement::cpu) {
        cpu_tasks_.push_back(i);
      } else {
        if (placement[i] == Placement::gpu) streamed_subgroups_.push_back(i);
        gpu_tasks_.push_back({i, placement[i] == Placement::gpu});
      }
    }
    if (!w.on_nvme.empty()) {
      nvme_order_ = nvme_read_order(placement, w.on_nvme, slots);
      staging_ = nvme_staging_buffers(placement, w.on_nvme, slots, w.nvme_read_ahead);
    }
    if (!nvme_order_.empty()) read_done_at_.assign(placement.size(), kInf);
    lp_ready_at_.reserve(cpu_tasks_.size());
    input_ready_at_.assign(gpu_tasks_.size(), kInf);
    input_done_.assign(gpu_tasks_.size(), false);
    flush_queue_.reserve(gpu_tasks_.size());
    flush_done_at_.reserve(gpu_tasks_.size());
  }

  /// Runs every task; returns when the last one ends, in seconds.
  double run() {
    std::size_t guard = 8 * (cpu_tasks_.size() + gpu_tasks_.size() + nvme_order_.size()) + 16;
    for (;;) {
      start_ready();
      if (!cpu_job_.active && !h2d_job_.active && !gpu_job_.active && !d2h_job_.active && !nvme_job_.active) break;
      // Every step ends at least one task; more steps than tasks would be a bug in the walk.
      if (guard-- == 0) throw Error("PerfModel: internal error: the pipeline walk did not finish");
      step();
    }
    MEMTIDE_ASSERT(cpu_next_ == cpu_tasks_.size() && lp_next_ == cpu_tasks_.size());
    MEMTIDE_ASSERT(gpu_next_ == gpu_tasks_.size() && flush_next_ == flush_queue_.size());
    MEMTIDE_ASSERT(reads_started_ == nvme_order_.size() && writes_next_ == nvme_order_.size());
    return t_;
  }

 private:
  struct GpuTask {
    std::size_t subgroup;
    bool streamed;
  };
  struct Job {
    bool active = false;
    double remaining = 0;   // params (CPU, GPU) or bytes (copies)
    std::size_t task = 0;   // ordinal in cpu_tasks_ or gpu_tasks_
    bool is_input = false;  // H2D: a GPU input (else a CPU subgroup's low-precision params)
  };

  [[nodiscard]] double params(std::size_t subgroup) const {
    return static_cast<double>(w_.subgroup_params[subgroup]);
  }

  [[nodiscard]] double input_bytes(std::size_t j) const {
    const GpuTask& g = gpu_tasks_[j];
    return params(g.subgroup) * ((g.streamed ? kStateBytesPerParam : 0.0) + grad_upload(w_, c_, g.subgroup));
  }

  // When the scheduler's host loop reaches `subgroup`: once every CPU update before it is done
  // (the loop runs them inline). False while that is still unknown.
  bool host_reaches(std::size_t subgroup, double& at) const {
    const std::size_t need = cpu_before_[subgroup];
    if (need == 0) {
      at = 0;
      return true;
    }
    if (lp_ready_at_.size() < need) return false;
    at = lp_ready_at_[need - 1];
    return true;
  }

  // Issues GPU inputs in order as far as slots allow: an input is ready after the previous one
  // (one prefetch stream), and a streamed one only once the flush holding its slot has ended.
  // The host issues inputs from its loop: the first `slots` prefetches at the start, each later
  // one when the loop reaches the streamed subgroup whose slot it reuses, a static resident's
  // gradient when the loop reaches the resident.
  void issue_inputs() {
    while (input_issued_ < gpu_tasks_.size()) {
      const std::size_t j = input_issued_;
      double ready = j == 0 ? 0.0 : input_ready_at_[j - 1];
      double issued = 0;
      // A streamed subgroup on NVMe goes NVMe -> pinned host -> GPU: its read comes first. A
      // static resident's state stays on the GPU (only its gradient comes over): no read.
      if (gpu_tasks_[j].streamed) {
        if (!read_done(gpu_tasks_[j].subgroup)) return;
        if (!read_done_at_.empty() && spilled(w_, gpu_tasks_[j].subgroup)) {
          ready = std::max(ready, read_done_at_[gpu_tasks_[j].subgroup]);
        }
      }
      if (gpu_tasks_[j].streamed) {
        if (streamed_issued_ >= slots_) {
          const std::size_t holder = streamed_issued_ - slots_;  // the flush that frees our slot
          if (holder >= flush_done_at_.size()) return;
          if (!host_reaches(streamed_subgroups_[holder], issued)) return;
          ready = std::max({ready, flush_done_at_[holder], issued});
        }
        ++streamed_issued_;
      } else {
        if (!host_reaches(gpu_tasks_[j].subgroup, issued)) return;
        ready = std::max(ready, issued);
      }
      input_ready_at_[j] = ready;
      ++input_issued_;
    }
  }

  void start_ready() {
    if (!cpu_job_.active && cpu_next_ < cpu_tasks_.size() && read_done(cpu_tasks_[cpu_next_])) {
      const std::size_t k = cpu_next_++;
      cpu_job_ = {true, params(cpu_tasks_[k]), k, false};
    }
    issue_inputs();
    // A static resident whose grads are already on the GPU needs no copy.
    while (input_started_ < input_issued_ && input_bytes(input_started_) == 0) input_done_[input_started_++] = true;
    if (!h2d_job_.active) {
      const bool input = input_started_ < input_issued_;
      const bool lp = lp_next_ < lp_ready_at_.size();
      if (input && (!lp || input_ready_at_[input_started_] <= lp_ready_at_[lp_next_])) {
        const std::size_t j = input_started_++;
        h2d_job_ = {true, input_bytes(j), j, true};
      } else if (lp) {
        const std::size_t k = lp_next_++;
        h2d_job_ = {true, params(cpu_tasks_[k]) * c_.lp_bytes_per_param, k, false};
      }
    }
    if (!gpu_job_.active && gpu_next_ < gpu_tasks_.size() && input_done_[gpu_next_]) {
      const std::size_t j = gpu_next_++;
      gpu_job_ = {true, params(gpu_tasks_[j].subgroup), j, false};
    }
    if (!d2h_job_.active && flush_next_ < flush_queue_.size()) {
      const std::size_t j = flush_queue_[flush_next_++];
      d2h_job_ = {true, params(gpu_tasks_[j].subgroup) * c_.out_per_param, j, false};
    }
    // The NVMe drive: write-backs first (they free a staging buffer), else the next read in the
    // scheduler's order while a staging buffer is free.
    if (!nvme_job_.active) {
      if (writes_next_ < write_queue_.size()) {
        const std::size_t sg = write_queue_[writes_next_++];
        nvme_job_ = {true, params(sg) * kStateBytesPerParam, sg, false};
      } else if (reads_started_ < nvme_order_.size() && staged_ < staging_) {
        const std::size_t sg = nvme_order_[reads_started_++];
        ++staged_;
        nvme_job_ = {true, params(sg) * kStateBytesPerParam, sg, true};
      }
    }
  }

  // Whether `subgroup`'s state is in host memory: not on NVMe, or read back already.
  [[nodiscard]] bool read_done(std::size_t subgroup) const {
    return read_done_at_.empty() || !spilled(w_, subgroup) || read_done_at_[subgroup] < kInf;
  }
  // The update of `subgroup` is done (CPU) or its state flushed (GPU): on NVMe, it goes back.
  void written_back_after(std::size_t subgroup) {
    if (!read_done_at_.empty() && spilled(w_, subgroup)) write_queue_.push_back(subgroup);
  }

  // Advances the clock to the next completion and handles what completes there.
  void step() {
    // DMA takes the DRAM bandwidth it needs first (both engines scaled down if DRAM cannot feed
    // them); the CPU update gets what is left.
    double h2d_rate = h2d_job_.active ? r_.h2d_bytes_per_s : 0;
    double d2h_rate = d2h_job_.active ? r_.d2h_bytes_per_s : 0;
    double nvme_rate = !nvme_job_.active ? 0 : nvme_job_.is_input ? r_.nvme_read_bytes_per_s : r_.nvme_write_bytes_per_s;
    const double dma = h2d_rate + d2h_rate + nvme_rate;
    if (dma > r_.host_dram_bytes_per_s) {
      const double scale = r_.host_dram_bytes_per_s / dma;
      h2d_rate *= scale;
      d2h_rate *= scale;
      nvme_rate *= scale;
    }
    double cpu_rate = 0;  // params/s
    if (cpu_job_.active) {
      cpu_rate = 1 / c_.cpu_s_per_param;
      if (c_.cpu_dram_per_param > 0) {
        const double left = std::max(0.0, r_.host_dram_bytes_per_s - h2d_rate - d2h_rate - nvme_rate);
        cpu_rate = std::min(cpu_rate, left / c_.cpu_dram_per_param);
      }
    }
    const double gpu_rate = gpu_job_.active ? r_.gpu_update_params_per_s : 0;

    auto finish_in = [](const Job& job, double rate) {
      return job.active && rate > 0 ? job.remaining / rate : kInf;
    };
    const double t_cpu = finish_in(cpu_job_, cpu_rate);
    const double t_h2d = finish_in(h2d_job_, h2d_rate);
    const double t_gpu = finish_in(gpu_job_, gpu_rate);
    const double t_d2h = finish_in(d2h_job_, d2h_rate);
    const double t_nvme = finish_in(nvme_job_, nvme_rate);
    const double dt = std::min({t_cpu, t_h2d, t_gpu, t_d2h, t_nvme});
    MEMTIDE_ASSERT(dt < kInf);
    t_ += dt;
    // Jobs ending within rounding of this step end now, not after a step of a few ulps.
    const double tol = dt * 1e-12;
    auto advance = [&](Job& job, double rate, double t_done) {
      if (!job.active) return false;
      if (t_done <= dt + tol) {
        job.active = false;
        return true;
      }
      job.remaining -= rate * dt;
      return false;
    };
    if (advance(cpu_job_, cpu_rate, t_cpu)) {
      lp_ready_at_.push_back(t_);
      written_back_after(cpu_tasks_[cpu_job_.task]);
    }
    if (advance(h2d_job_, h2d_rate, t_h2d) && h2d_job_.is_input) input_done_[h2d_job_.task] = true;
    if (advance(gpu_job_, gpu_rate, t_gpu) && gpu_tasks_[gpu_job_.task].streamed) {
      flush_queue_.push_back(gpu_job_.task);
    }
    if (advance(d2h_job_, d2h_rate, t_d2h)) {
      flush_done_at_.push_back(t_);
      written_back_after(gpu_tasks_[d2h_job_.task].subgroup);
    }
    if (advance(nvme_job_, nvme_rate, t_nvme)) {
      if (nvme_job_.is_input) {
        read_done_at_[nvme_job_.task] = t_;
      } else {
        --staged_;  // written back: its staging buffer is free
      }
    }
  }

  const Workload& w_;
  const Rates& r_;
  const Costs& c_;
  std::size_t slots_;

  std::vector<std::size_t> cpu_tasks_;  // subgroup of each CPU task, in update order
  std::vector<GpuTask> gpu_tasks_;      // GPU tasks (streamed and static), in update order

  double t_ = 0;  // seconds
  Job cpu_job_, h2d_job_, gpu_job_, d2h_job_;
  Job nvme_job_;  // task: the subgroup; is_input: a read (else a write-back)

  std::size_t cpu_next_ = 0;          // next CPU task to start
  std::vector<double> lp_ready_at_;   // when each finished CPU task's copy became ready
  std::size_t lp_next_ = 0;           // next low-precision copy to start
  std::vector<std::size_t> cpu_before_;          // per subgroup: CPU tasks before it in update order
  std::vector<std::size_t> streamed_subgroups_;  // subgroup of each streamed GPU task

  std::size_t input_issued_ = 0;      // GPU inputs with a known ready time
  std::size_t streamed_issued_ = 0;   // ... of which streamed (each holds a slot)
  std::size_t input_started_ = 0;     // GPU inputs started on the H2D engine
  std::vector<double> input_ready_at_;
  std::vector<char> input_done_;  // char, not bool: read on every step
  std::size_t gpu_next_ = 0;          // next GPU task to start

  std::vector<std::size_t> flush_queue_;  // streamed GPU tasks done, awaiting their flush
  std::size_t flush_next_ = 0;
  std::vector<double> flush_done_at_;     // when each flush ended (frees a slot)

  std::vector<std::size_t> nvme_order_;   // subgroups on NVMe (not residents), in read order
  std::size_t staging_ = 0;               // staging buffers
  std::vector<double> read_done_at_;      // per subgroup: when its read ended; empty: no NVMe
  std::size_t reads_started_ = 0;
  std::size_t staged_ = 0;                // subgroups read and not yet written back
  std::vector<std::size_t> write_queue_;  // updated subgroups waiting for their write-back
  std::size_t writes_next_ = 0;
};

std::size_t useful_slots(const Workload& w) { return std::min(w.gpu_slot_limit, kUsefulSlots); }

// `prune_above`: when the bound alone exceeds it, the walk is skipped and total_ns is left at
// the bound (a lower bound of the true total), which is enough to lose against a plan that
// fully predicted `prune_above`.
Prediction predict_valid(const Workload& w, const Rates& r, const std::vector<Placement>& placement,
                         double prune_above = kInf) {
  const Costs costs(w, r);
  Prediction out;
  busy_times(w, r, costs, placement, out);
  if (out.bound_ns > prune_above) {
    out.total_ns = out.bound_ns;
    return out;
  }
  Walk walk(w, r, costs, placement, useful_slots(w));
  // The walk never beats the bound; max() only guards rounding.
  out.total_ns = std::max(walk.run() * 1e9, out.bound_ns);
  return out;
}

struct Counts {
  std::size_t streamed = 0;
  std::size_t statics = 0;
};

Counts count(const std::vector<Placement>& placement) {
  Counts c;
  for (Placement p : placement) {
    if (p == Placement::gpu) ++c.streamed;
    if (p == Placement::gpu_static) ++c.statics;
  }
  return c;
}

Plan make_plan(const Workload& w, const Rates& r, Policy policy, double k, std::size_t statics,
               double prune_above = kInf) {
  Plan plan;
  plan.policy = policy;
  plan.placement = interleave(w.subgroup_params.size(), k, statics);
  const Counts c = count(plan.placement);
  plan.gpu_streamed = c.streamed;
  plan.static_residents = c.statics;
  plan.k = c.streamed > 0 ? std::max(k, 1.0) : 0;
  plan.gpu_slots = c.streamed > 0 ? useful_slots(w) : 0;
  plan.prediction = predict_valid(w, r, plan.placement, prune_above);
  return plan;
}

// The stride that puts exactly `g` of `s` streamable subgroups on the GPU.
double stride_for(std::size_t s, std::size_t g) {
  double k = static_cast<double>(s) / static_cast<double>(g);
  // interleave() counts floor(s / k) GPU subgroups; s / (s / g) can round just below g.
  for (int i = 0; i < 8 && std::floor(static_cast<double>(s) / k) < static_cast<double>(g); ++i) {
    k = std::nextafter(k, 0.0);
  }
  return k;
}

// Lower predicted total wins; within a relative 1e-9 the plan with fewer GPU subgroups does.
bool better(const Plan& a, const Plan& b) {
  const double ta = a.prediction.total_ns;
  const double tb = b.prediction.total_ns;
  const double tol = 1e-9 * std::max(ta, tb);
  if (ta < tb - tol) return true;
  if (ta > tb + tol) return false;
  return a.gpu_streamed + a.static_residents < b.gpu_streamed + b.static_residents;
}

// The bound of interleave(n, stride_for(n - t, g), t) for t static residents and g streamed
// subgroups, in O(1) from prefix sums: exact for the residents (the last t subgroups) and, when
// the first n - t subgroups are of one size (in an engine's workload all but the last are), for
// the streamed ones too; otherwise those are counted at the mean size of the first n - t. The
// search ranks candidates with it; every plan it returns is predicted in full.
class BoundEstimate {
 public:
  BoundEstimate(const Workload& w, const Rates& r, const Costs& c) : r_(r), c_(c), other_h2d_(w.phase_h2d_bytes) {
    const std::size_t n = w.subgroup_params.size();
    params_.assign(n + 1, 0.0);
    grads_.assign(n + 1, 0.0);
    nvme_.assign(n + 1, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      const auto p = static_cast<double>(w.subgroup_params[i]);
      params_[i + 1] = params_[i] + p;
      grads_[i + 1] = grads_[i] + p * grad_upload(w, c, i);
      nvme_[i + 1] = nvme_[i] + (spilled(w, i) ? p : 0.0);
    }
  }

  [[nodiscard]] double operator()(std::size_t statics, std::size_t gpu) const {
    const std::size_t n = params_.size() - 1;
    const std::size_t s = n - statics;
    const double share = s == 0 ? 0.0 : static_cast<double>(gpu) / static_cast<double>(s);
    Loads l;
    l.streamed_params = params_[s] * share;
    l.cpu_params = params_[s] - l.streamed_params;
    l.gpu_params = l.streamed_params + (params_[n] - params_[s]);
    l.grad_bytes = grads_[s] * share + (grads_[n] - grads_[s]);
    l.nvme_params = nvme_[s];  // residents (the last t) keep their state on the GPU
    l.other_h2d_bytes = other_h2d_;
    Prediction out;
    busy_times(l, r_, c_, out);
    return out.bound_ns;
  }

  /// The GPU count in 0..last with the lowest bound for `statics` residents, the fewest on a tie.
  /// The bound is a maximum of functions linear in the GPU count (CPU time falls with it, copy
  /// and GPU time rise, DRAM moves one way), so it is valley-shaped: O(log n).
  [[nodiscard]] std::size_t valley(std::size_t statics, std::size_t last) const {
    std::size_t lo = 0, hi = last;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if ((*this)(statics, mid + 1) < (*this)(statics, mid)) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

 private:
  const Rates& r_;
  const Costs& c_;
  std::vector<double> params_;  // params_[i]: params of subgroups 0..i-1
  std::vector<double> grads_;   // grads_[i]: gradient bytes their GPU updates would upload
  std::vector<double> nvme_;    // nvme_[i]: params of those on the NVMe tier
  double other_h2d_ = 0;
};

// `w` with every `grain` consecutive subgroups merged into one (the last merges what is left):
// the same work in fewer, larger pieces. A merged subgroup's gradient counts as on the device
// only when all of its parts' are, and its state as on NVMe when any part's is; residents are
// limited to what whole merged ones hold.
Workload coarsen(const Workload& w, std::size_t grain) {
  Workload out = w;
  const std::size_t n = w.subgroup_params.size();
  const std::size_t m = (n + grain - 1) / grain;
  out.subgroup_params.assign(m, 0);
  if (!w.grad_on_device.empty()) out.grad_on_device.assign(m, true);
  if (!w.on_nvme.empty()) out.on_nvme.assign(m, false);
  for (std::size_t i = 0; i < n; ++i) {
    out.subgroup_params[i / grain] += w.subgroup_params[i];
    if (!w.grad_on_device.empty() && !w.grad_on_device[i]) out.grad_on_device[i / grain] = false;
    // A merged subgroup with a spilled part pays the drive for all of it: the proxy only seeds.
    if (!w.on_nvme.empty() && w.on_nvme[i]) out.on_nvme[i / grain] = true;
  }
  out.gpu_slot_limit = std::min(w.gpu_slot_limit, m);
  out.gpu_static_limit = std::min(w.gpu_static_limit / grain, m);
  return out;
}

}  // namespace

Prediction PerfModel::predict(const Workload& work, const Rates& rates, const std::vector<Placement>& placement) const {
  validate_model_inputs(work, rates);
  if (placement.size() != work.subgroup_params.size()) {
    throw InvalidArgument("PerfModel: placement has " + std::to_string(placement.size()) +
                          " entries: expected one per subgroup (" + std::to_string(work.subgroup_params.size()) + ")");
  }
  const Counts c = count(placement);
  if (c.streamed > 0 && work.gpu_slot_limit == 0) {
    throw InvalidArgument("PerfModel: placement streams " + std::to_string(c.streamed) +
                          " subgroups through the GPU but workload.gpu_slot_limit = 0: expected no Placement::gpu "
                          "entries, or at least one slot");
  }
  return predict_valid(work, rates, placement);
}

Plan PerfModel::plan(const Workload& work, const Rates& rates, Policy policy, double static_fraction,
                     std::optional<double> k) const {
  validate_model_inputs(work, rates);
  if (!(static_fraction >= 0 && static_fraction <= 1)) {
    throw InvalidArgument("PerfModel: static_fraction = " + show_number(static_fraction) +
                          " is not accepted: expected a number in [0, 1]");
  }
  if (k && !(*k >= 1 && std::isfinite(*k))) {
    throw InvalidArgument("PerfModel: k = " + show_number(*k) +
                          " is not accepted: expected a finite stride >= 1 (one in every k subgroups on the GPU)");
  }
  const std::size_t n = work.subgroup_params.size();
  const bool can_stream = work.gpu_slot_limit > 0;
  const std::size_t max_statics = std::min(work.gpu_static_limit, n);
  const auto wanted_statics = std::min(
      static_cast<std::size_t>(std::llround(static_fraction * static_cast<double>(n))), max_statics);
  constexpr double kDefaultStride = 2;

  auto cpu = [&](double prune_above = kInf) { return make_plan(work, rates, Policy::cpu, 0, 0, prune_above); };
  auto static_split = [&](double prune_above = kInf) {
    return make_plan(work, rates, Policy::static_split, 0, wanted_statics, prune_above);
  };
  auto interleaved = [&](Policy as, double prune_above = kInf) {
    return make_plan(work, rates, as, can_stream ? k.value_or(kDefaultStride) : 0, wanted_statics, prune_above);
  };

  switch (policy) {
    case Policy::cpu: return cpu();
    case Policy::static_split: return static_split();
    case Policy::interleaved: return interleaved(Policy::interleaved);
    case Policy::automatic:
      if (k) return interleaved(Policy::automatic);
      break;
  }

  // The search: rank placements (static count t, GPU count g) by their bound, which costs O(1)
  // each, and predict in full (O(n) each) only the few that can win, best-ranked first. A full
  // prediction is skipped once a placement's bound is above the best total found (it cannot
  // win), and their number is capped so that planning stays O(n log n): small workloads get an
  // effectively exhaustive search. A large workload is first planned at a coarser grain (a
  // proxy of kProxySubgroups merged subgroups), because its best total can lie far from the
  // valley of the bound (the host loop couples the CPU's progress to the prefetches); the
  // proxy's shares seed the full-size search.
  const Costs costs(work, rates);
  const BoundEstimate estimate(work, rates, costs);
  const std::size_t evaluations = std::max(kMinEvaluations, kEvaluatedSubgroups / n);
  std::size_t evaluated = 0;
  double incumbent = kInf;
  // Plans whose bound is this much above the best total are not walked: far enough above that
  // better()'s tie tolerance cannot pick one of them.
  const double slack = 1 + 1e-6;
  std::optional<Plan> best;
  // Keeps the better plan; false when `p` was pruned (its bound alone loses).
  auto consider = [&](Plan p) {
    // A pruned plan's total is its bound, above the incumbent: min() leaves the incumbent.
    incumbent = std::min(incumbent, p.prediction.total_ns);
    const bool pruned = p.prediction.bound_ns > incumbent * slack;
    if (!pruned) ++evaluated;
    if (!best || better(p, *best)) best = std::move(p);
    return !pruned;
  };
  auto evaluate = [&](std::size_t statics, std::size_t gpu) {
    // The estimate is exact for equal subgroups; the margin covers rounding in its sums.
    if (estimate(statics, gpu) > incumbent * slack * (1 + 1e-9)) return false;
    return consider(make_plan(work, rates, Policy::automatic, gpu == 0 ? 0 : stride_for(n - statics, gpu), statics,
                              incumbent * slack));
  };
  auto valley = [&](std::size_t statics) { return estimate.valley(statics, can_stream ? n - statics : 0); };
  auto lowest_bound = [&](std::size_t statics) { return estimate(statics, valley(statics)); };

  if (n > kProxySubgroups) {
    const std::size_t grain = (n + kProxySubgroups - 1) / kProxySubgroups;
    const Plan coarse = plan(coarsen(work, grain), rates, Policy::automatic, static_fraction);
    const std::size_t m = coarse.placement.size();
    const auto t = std::min(max_statics, static_cast<std::size_t>(std::llround(
                                             static_cast<double>(coarse.static_residents * n) / static_cast<double>(m))));
    const std::size_t last = can_stream ? n - t : 0;
    const double share = static_cast<double>(coarse.gpu_streamed) / static_cast<double>(m - coarse.static_residents);
    const auto g = std::min(last, static_cast<std::size_t>(std::llround(share * static_cast<double>(n - t))));
    evaluate(t, g);
    // The proxy places to within about one grain: a pattern search from that step down to one
    // subgroup, so a budget cut keeps the coarse moves, which gain the most.
    std::size_t at = g;
    for (std::size_t d = grain; d >= 1 && evaluated < evaluations; d /= 2) {
      for (int side : {-1, +1}) {
        if (side < 0 ? d > at : at + d > last) continue;
        const double before = best->prediction.total_ns;
        evaluate(t, side < 0 ? at - d : at + d);
        if (best->prediction.total_ns < before) {
          at = side < 0 ? at - d : at + d;
          break;
        }
      }
    }
  }

  // Static counts to search, the lowest bound first (the fewest residents on a tie): all of them
  // when few, else the valley of the lowest bound over t (it is convex in t too), its
  // neighbourhood at growing distances, and an even spread that guards against a total whose
  // shape the bound does not show.
  std::vector<std::size_t> statics;
  if (max_statics < kExhaustiveStaticCounts) {
    for (std::size_t t = 0; t <= max_statics; ++t) statics.push_back(t);
  } else {
    std::size_t lo = 0, hi = max_statics;
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (lowest_bound(mid + 1) < lowest_bound(mid)) lo = mid + 1;
      else hi = mid;
    }
    for (std::size_t d = 0; d <= max_statics; d = d == 0 ? 1 : 2 * d) {
      if (lo >= d) statics.push_back(lo - d);
      if (lo + d <= max_statics) statics.push_back(lo + d);
    }
    for (std::size_t i = 0; i <= kExhaustiveStaticCounts; ++i) {
      statics.push_back(static_cast<std::size_t>(std::llround(static_cast<double>(max_statics) *
                                                              static_cast<double>(i) / kExhaustiveStaticCounts)));
    }
    std::sort(statics.begin(), statics.end());
    statics.erase(std::unique(statics.begin(), statics.end()), statics.end());
  }
  std::vector<std::pair<double, std::size_t>> ranked;
  ranked.reserve(statics.size());
  for (std::size_t t : statics) ranked.emplace_back(lowest_bound(t), t);
  std::sort(ranked.begin(), ranked.end());

  // The best-ranked placement first, then the other policies' plans: they are candidates too,
  // and most of them are pruned by the best total so far.
  const std::size_t first = ranked.front().second;
  evaluate(first, valley(first));
  for (Plan p : {cpu(incumbent * slack), static_split(incumbent * slack),
                 interleaved(Policy::interleaved, incumbent * slack)}) {
    p.policy = Policy::automatic;
    consider(std::move(p));
  }
  // With a proxy's plan in hand, its search stands for this one's: only its seed's
  // neighbourhood (above), the valley of the bound and the other policies are predicted here.
  if (n > kProxySubgroups) ranked.clear();
  for (const auto& [lowest, t] : ranked) {
    if (evaluated >= evaluations || lowest > incumbent * slack) break;
    const std::size_t g0 = valley(t);
    const std::size_t last = can_stream ? n - t : 0;
    if (t != first) evaluate(t, g0);
    // Outwards from the valley while the bound can still beat the best total; everything further
    // out has a higher bound. Unit steps near the valley, then growing ones.
    for (int side : {-1, +1}) {
      for (std::size_t d = 1; evaluated < evaluations; d += d < 16 ? 1 : d / 8) {
        if (side < 0 ? d > g0 : g0 + d > last) break;
        if (!evaluate(t, side < 0 ? g0 - d : g0 + d)) break;
      }
    }
  }
  return std::move(*best);
}

IterationPrediction PerfModel::predict_iteration(const PassWork& forward, const PassWork& backward,
                                                 const Prediction& update) const {
  auto pass = [](const PassWork& w, const char* name) {
    const std::pair<const char*, double> fields[] = {{"compute_ns", w.compute_ns}, {"comm_ns", w.comm_ns},
                                                     {"lead_ns", w.lead_ns},       {"stall_ns", w.stall_ns},
                                                     {"async_ns", w.async_ns},     {"tail_ns", w.tail_ns}};
    for (const auto& [field, v] : fields) {
      if (!(v >= 0) || !std::isfinite(v)) {
        throw InvalidArgument(std::string("PerfModel::predict_iteration: ") + name + "." + field + " = " +
                              show_number(v) + " is not accepted: expected a finite time >= 0");
      }
    }
    return w.lead_ns + std::max({w.compute_ns + w.stall_ns + w.tail_ns, w.comm_ns, w.async_ns});
  };
  IterationPrediction out;
  out.forward_ns = pass(forward, "forward");
  out.backward_ns = pass(backward, "backward");
  out.update_ns = update.total_ns;
  out.total_ns = out.forward_ns + out.backward_ns + out.update_ns;
  return out;
}

Rates sim_rates(const SimConfig& c) {
  Rates r;
  r.h2d_bytes_per_s = c.h2d_bytes_per_s;
  r.d2h_bytes_per_s = c.d2h_bytes_per_s;
  r.cpu_update_params_per_s = c.cpu_update_params_per_s;
  r.gpu_update_params_per_s = c.gpu_update_params_per_s;
  r.host_dram_bytes_per_s = c.host_dram_bytes_per_s;
  r.cpu_dram_bytes_per_param = adamw_bytes_per_param(DType::fp32, DType::bf16);
  return r;
}

}  // namespace memtide::tiering
