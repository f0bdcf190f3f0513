#include "memtide/tiering/engine/update_engine.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/engine/optimizer_state.hpp"
#include "plan_budget.hpp"

namespace memtide::tiering {
namespace {

constexpr std::size_t kCacheEntries = 4;

// Segments stepped with the same hyper-parameters share one scheduler phase (StepParams holds one
// set): a step with several param groups, or params at different step counts, is one phase each.
using HyperKey = std::tuple<double, double, double, double, double, std::int64_t>;
HyperKey key_of(const StepParams& p) { return {p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.step}; }

void add_use(ResourceUse& into, const ResourceUse& from) {
  into.busy_ns += from.busy_ns;
  into.bytes += from.bytes;
  into.params += from.params;
  into.ops += from.ops;
}

// The NVMe tier sees a run's segments only as their subgroups (it knows nothing of Segment).
std::vector<std::size_t> subgroups_of(const std::vector<Segment>& list) {
  std::vector<std::size_t> out;
  out.reserve(list.size());
  for (const Segment& s : list) out.push_back(s.subgroup);
  return out;
}

}  // namespace

struct UpdateEngine::Entry {
  Ranges ranges;
  std::unique_ptr<OptimizerState> state;
  std::unique_ptr<UpdateScheduler> scheduler;
};

// While a checkpoint save runs, every cached scheduler tells it before writing a subgroup's host
// state (UpdateScheduler::set_before_host_write), for as long as the guard lives.
struct UpdateEngine::SaveGuard {
  explicit SaveGuard(UpdateEngine& e) : engine(e), save(e.running_save()) {
    for (Entry& entry : engine.cache_) arm(entry);
  }
  ~SaveGuard() {
    if (!save) return;
    for (Entry& entry : engine.cache_) entry.scheduler->set_before_host_write(nullptr);
  }
  SaveGuard(const SaveGuard&) = delete;
  SaveGuard& operator=(const SaveGuard&) = delete;
  void arm(Entry& entry) const {
    if (!save) return;
    std::vector<std::size_t> index;  // the engine's subgroup of each of the scheduler's ranges
    for (const auto& r : entry.ranges) {
      auto it = std::upper_bound(engine.subgroups_.begin(), engine.subgroups_.end(), r.first,
                                 [](std::size_t at, const std::pair<std::size_t, std::size_t>& g) { return at < g.first; });
      index.push_back(static_cast<std::size_t>(it - engine.subgroups_.begin()) - 1);
    }
    entry.scheduler->set_before_host_write(
        [s = save, index = std::move(index)](std::size_t j, const float* p, const float* m, const float* v) {
          s->protect(index.at(j), p, m, v);
        });
  }
  UpdateEngine& engine;
  std::shared_ptr<SaveTarget> save;
};

// Every public call holds one: the allocator's lender gives back only when no call is running.
struct UpdateEngine::Busy {
  explicit Busy(const UpdateEngine& e) : engine(e) {
    engine.api_mutex_.lock();
    ++engine.busy_;
  }
  ~Busy() {
    --engine.busy_;
    engine.api_mutex_.unlock();
  }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;
  const UpdateEngine& engine;
};

UpdateEngine::UpdateEngine(CachingAllocator& allocator, HostArena& arena, std::size_t n,
                           Ranges subgroups, ThreadPool* pool,
                           EngineConfig config)
    : allocator_(allocator), device_(allocator.device()), arena_(arena), pool_(pool), config_(config), n_(n),
      subgroups_(std::move(subgroups)), calibration_(config.defaults, config.calibration) {
  if (config_.low_precision_bytes != 2 && config_.low_precision_bytes != 4) {
    throw InvalidArgument("UpdateEngine: low_precision_bytes must be 2 (fp16/bf16 model) or 4 (fp32 model), got " +
                          std::to_string(config_.low_precision_bytes));
  }
  if (n_ == 0) throw InvalidArgument("UpdateEngine: n must be > 0");
  if (subgroups_.empty()) throw InvalidArgument("UpdateEngine: subgroups is empty; at least one [start, end) is needed");
  if (subgroups_.size() > kMaxSubgroups) {
    throw InvalidArgument("UpdateEngine: " + std::to_string(subgroups_.size()) + " subgroups, at most " +
                          std::to_string(kMaxSubgroups) + ": make the subgroups larger");
  }
  std::size_t expect = 0;
  for (auto [s, e] : subgroups_) {
    if (s != expect || e <= s || e > n_) {
      throw InvalidArgument("UpdateEngine: subgroup [" + std::to_string(s) + ", " + std::to_string(e) +
                            ") is not the next non-empty range of the " + std::to_string(n_) +
                            " params (expected to start at " + std::to_string(expect) + ")");
    }
    expect = e;
  }
  if (expect != n_) {
    throw InvalidArgument("UpdateEngine: the subgroups end at " + std::to_string(expect) + ", not at n = " +
                          std::to_string(n_));
  }
  if (n_ > std::numeric_limits<std::size_t>::max() / sizeof(float)) {
    throw InvalidArgument("UpdateEngine: n = " + std::to_string(n_) + " params do not fit in memory");
  }
  nvme_ = SpillTier::make(device_, arena_, n_, subgroups_, config_.nvme, config_.defaults, api_mutex_);
  if (is_phantom(device_)) {
    // Timing only (the iteration simulator): the arrays are phantom addresses registered with
    // the device, never dereferenced, so a 20B-parameter state costs no host memory.
    phantom_bytes_ = 4 * n_ * sizeof(float);
    phantom_host_ = reserve_phantom_host(phantom_bytes_);
    device_.host_register(phantom_host_, phantom_bytes_);
    for (std::size_t i = 0; i < 4; ++i) arrays_[i] = static_cast<float*>(phantom_host_) + i * n_;
    lend();
    return;
  }
  std::size_t made = 0;
  if (nvme_) {
    // The param and moment arrays are the NVMe tier's mappings.
    for (; made < 3; ++made) arrays_[made] = nvme_->array(made);
  }
  // p, m, v and g are streamed together: array k starts k * kStreamSkew bytes into its block.
  constexpr std::size_t kArraySkew = kStreamSkew;
  try {
    for (; made < 4; ++made) {
      blocks_[made] = arena_.allocate(n_ * sizeof(float) + 3 * kArraySkew);
      arrays_[made] = reinterpret_cast<float*>(static_cast<char*>(blocks_[made]) + made * kArraySkew);
      std::memset(arrays_[made], 0, n_ * sizeof(float));  // a reused arena block is not zero
    }
  } catch (...) {
    for (std::size_t i = nvme_ ? 3 : 0; i < made; ++i) arena_.deallocate(blocks_[i]);
    throw;
  }
  lend();
}

// The allocator asks for the engine's loans back when an allocation would otherwise fail (torch
// running out in forward while residents sit on the GPU): residents go back to the host, kept
// gradients too. Not while the engine is at work itself (the allocation may be its own, mid-step)
// or another thread is in it: then it gives nothing.
void UpdateEngine::lend() {
  Lender lender;
  lender.name = "the update engine's residents and kept gradients";
  lender.borrowed = [this] {
    std::unique_lock lock(api_mutex_, std::try_to_lock);
    return lock ? resident_bytes() + kept_grad_bytes() : std::uint64_t{0};
  };
  lender.give_back = [this](std::uint64_t) -> std::uint64_t {
    std::unique_lock lock(api_mutex_, std::try_to_lock);
    if (!lock || busy_ > 0) return 0;
    const std::uint64_t before = resident_bytes() + kept_grad_bytes();
    grads_to_host();
    for (Entry& e : cache_) retire(e);
    current_statics_ = 0;
    const std::uint64_t after = resident_bytes() + kept_grad_bytes();
    if (before > after) {
      MEMTIDE_LOG(info, "UpdateEngine: gave back " + format_bytes(before - after) +
                            " of device memory (residents and kept gradients moved to the host) for an allocation");
    }
    return before > after ? before - after : 0;
  };
  lender_id_ = allocator_.add_lender(std::move(lender));
}

UpdateEngine::~UpdateEngine() {
  allocator_.remove_lender(lender_id_);  // first: the allocator must not call into a dying engine
  Busy busy(*this);
  if (save_) {
    // A save asked for reads the host arrays until it is written: it finishes before they go.
    try {
      save_->wait();
    } catch (const std::exception&) {
      // Already logged by the save; the target is as it was.
    }
  }
  try {
    // The host arrays hold every step's result (and maybe later changes): drop the residents'
    // device copies first, so the schedulers' destructors do not copy stale ones back.
    for (Entry& e : cache_) e.scheduler->discard_residents();
    cache_.clear();
    sink_.reset();
    if (model_params_ != nullptr) allocator_.deallocate(model_params_, Stream{});
    if (phantom_host_ != nullptr) {
      device_.host_unregister(phantom_host_);
    } else {
      for (std::size_t k = nvme_ ? 3 : 0; k < 4; ++k) arena_.deallocate(blocks_[k]);
    }
    nvme_.reset();
  } catch (const Error& e) {
    // Destructors never throw; the runtime may be shutting down.
    MEMTIDE_LOG(warn, std::string("UpdateEngine: ") + e.what());
  }
}

std::uint64_t UpdateEngine::host_bytes() const {
  if (phantom_host_ != nullptr) return 0;
  std::uint64_t total = 0;
  for (std::size_t k = nvme_ ? 3 : 0; k < 4; ++k) total += arena_.allocation_size(blocks_[k]);
  if (nvme_) total += nvme_->host_bytes();
  return total;
}

void UpdateEngine::spill_host(std::size_t up_to) {
  Busy busy(*this);
  if (nvme_) nvme_->spill(up_to);
}

const std::vector<bool>& UpdateEngine::on_nvme() const noexcept {
  static const std::vector<bool> none;
  return nvme_ ? nvme_->on_nvme() : none;
}

NvmeTierInfo UpdateEngine::nvme_info() const { return nvme_ ? nvme_->info() : NvmeTierInfo{}; }

std::uint64_t UpdateEngine::resident_bytes() const {
  std::uint64_t total = 0;
  for (const Entry& e : cache_) total += e.scheduler->held_bytes();
  return total;
}

void* UpdateEngine::model_params(DType dtype) {
  Busy busy(*this);
  if (dtype != DType::fp16 && dtype != DType::bf16) {
    throw InvalidArgument(std::string("UpdateEngine::model_params: dtype must be fp16 or bf16, got ") + dtype_name(dtype));
  }
  if (model_params_ != nullptr) {
    if (dtype != model_dtype_) {
      throw InvalidArgument(std::string("UpdateEngine::model_params: the model's params are ") + dtype_name(model_dtype_) +
                            ", not " + dtype_name(dtype));
    }
    return model_params_;
  }
  model_params_ = allocator_.allocate(n_ * dtype_size(dtype), Stream{});
  model_dtype_ = dtype;
  // Schedulers built before have no model params: rebuild them (the host arrays hold every result).
  for (Entry& e : cache_) e.scheduler->discard_residents();
  cache_.clear();
  return model_params_;
}

// ---- planning -------------------------------------------------------------------------------

void UpdateEngine::set_phase_h2d_bytes(double bytes) {
  if (!(bytes >= 0) || !std::isfinite(bytes)) {
    throw InvalidArgument("UpdateEngine::set_phase_h2d_bytes: bytes must be finite and >= 0, got " + std::to_string(bytes));
  }
  phase_h2d_bytes_ = bytes;
}

// A flag per subgroup, or none at all.
std::vector<bool> UpdateEngine::per_subgroup(const char* what, std::vector<bool> flags) const {
  if (!flags.empty() && flags.size() != subgroups_.size()) {
    throw InvalidArgument(std::string("UpdateEngine::") + what + ": " + std::to_string(flags.size()) +
                          " entries, there are " + std::to_string(subgroups_.size()) + " subgroups");
  }
  return flags;
}

void UpdateEngine::set_done_before_phase(std::vector<bool> done) {
  Busy busy(*this);
  done_before_phase_ = per_subgroup("set_done_before_phase", std::move(done));
}

void UpdateEngine::set_host_gradients(std::vector<bool> host) {
  Busy busy(*this);
  host_gradients_ = per_subgroup("set_host_gradients", std::move(host));
}

EnginePlan UpdateEngine::plan(Policy policy, double static_fraction, std::optional<double> k) {
  Busy busy(*this);
  // Subgroups already updated are left out: the rest is planned as a workload of its own, and
  // the placement is widened again at the end with them marked done.
  std::vector<std::size_t> kept_index;  // planned subgroup -> engine subgroup
  for (std::size_t g = 0; g < subgroups_.size(); ++g) {
    if (done_before_phase_.empty() || !done_before_phase_[g]) kept_index.push_back(g);
  }
  if (kept_index.empty()) {
    EnginePlan all_done;
    all_done.plan.policy = policy;
    all_done.plan.placement.assign(subgroups_.size(), Placement::done);
    all_done.reason = "every subgroup was updated before the phase";
    last_placement_ = all_done.plan.placement;
    return all_done;
  }
  EnginePlan out = plan_subset(policy, static_fraction, k, kept_index);
  if (kept_index.size() != subgroups_.size()) {
    std::vector<Placement> wide(subgroups_.size(), Placement::done);
    for (std::size_t j = 0; j < kept_index.size(); ++j) wide[kept_index[j]] = out.plan.placement[j];
    out.plan.placement = std::move(wide);
    last_placement_ = out.plan.placement;
  }
  return out;
}

EnginePlan UpdateEngine::plan_subset(Policy policy, double static_fraction, std::optional<double> k,
                                     const std::vector<std::size_t>& index) {
  EnginePlan out;
  Workload w;
  for (std::size_t g : index) w.subgroup_params.push_back(subgroups_[g].second - subgroups_[g].first);
  w.low_precision_bytes = config_.low_precision_bytes;
  w.grads_on_host = true;
  w.phase_h2d_bytes = phase_h2d_bytes_;
  if (grad_state_ != nullptr && sink_ && sink_->kept_bytes() > 0) {
    // Gradients the path kept on the device (the plan is made after backward): no upload.
    w.grad_on_device.resize(index.size());
    for (std::size_t j = 0; j < index.size(); ++j) w.grad_on_device[j] = (*grad_state_)[index[j]].device_grad != nullptr;
  }
  std::uint64_t own_slots = 0;  // an engine loan, as its residents and kept gradients are
  for (const Entry& e : cache_) own_slots = std::max(own_slots, e.scheduler->last_slot_bytes());
  out.budget = plan_budget(allocator_, w, EngineLoans{resident_bytes(), own_slots, last_kept_bytes_});
  if (config_.nvme.host_budget_bytes > 0 && config_.nvme.device_memory_in_budget &&
      device_.properties().host_addressable) {
    // The device's memory is host memory (a SimDevice): residents, which hold state between
    // steps, count against the host budget beside the host state (kept subgroups, gradients,
    // staging). The update phase's streamed slots (at most kUsefulSlots) are outside it.
    const std::uint64_t left = sat_sub(config_.nvme.host_budget_bytes, host_bytes());
    GpuBudget& g = out.budget.budget;
    if (left < g.resident_bytes) {
      g.resident_bytes = left;
      out.budget.source += "; residents capped at the " + format_bytes(left) +
                           " the host budget leaves (the device's memory is host memory)";
    }
  }
  fit_gpu_budget(w, out.budget.budget);
  if (!device_ops_available(device_)) {
    // A GPU placement would throw half-way through a step: plan none.
    w.gpu_slot_limit = 0;
    w.gpu_static_limit = 0;
    out.reason = "this build has no CUDA optimizer kernels: every subgroup on the CPU";
  }
  // The links as far as memtide can count on them: less what others were seen to take.
  Rates rates = calibration_.rates_for_planning();
  const std::size_t n = index.size();
  if (nvme_) nvme_->plan_with(w, rates, index);
  out.plan = model_.plan(w, rates, policy, static_fraction, k);

  if (out.reason.empty() && policy != Policy::cpu && !(policy == Policy::automatic && !k)) {
    const auto wanted = static_cast<std::size_t>(std::llround(static_fraction * static_cast<double>(n)));
    if (out.plan.static_residents < wanted) {
      out.reason = "device memory through the iteration fits " + count_words(w.gpu_static_limit, "static resident") +
                   ", the policy asked for " + std::to_string(wanted);
    }
    if (policy != Policy::static_split && w.gpu_slot_limit == 0) {
      out.reason += (out.reason.empty() ? "" : "; ") + std::string("the update phase's memory fits no GPU slot: nothing streamed");
    }
  }

  // Hysteresis: moving residents in or out costs their state's copies (12 B/param each way).
  // Keep the current count while the new plan does not win that back within resident_hold_steps.
  if (policy == Policy::automatic && !k && out.plan.static_residents != current_statics_ &&
      current_statics_ <= w.gpu_static_limit && current_statics_ <= n) {
    std::vector<Placement> keep = interleave(n, out.plan.gpu_streamed > 0 ? out.plan.k : 0, current_statics_);
    if (std::count(keep.begin(), keep.end(), Placement::gpu) > 0 && w.gpu_slot_limit == 0) {
      keep = interleave(n, 0, current_statics_);
    }
    const Prediction kept = model_.predict(w, rates, keep);
    const std::size_t lo = std::min(current_statics_, out.plan.static_residents);
    const std::size_t hi = std::max(current_statics_, out.plan.static_residents);
    double moved = 0;
    for (std::size_t i = n - hi; i < n - lo; ++i) moved += static_cast<double>(w.subgroup_params[i]) * 12;
    const double rate = out.plan.static_residents > current_statics_ ? rates.h2d_bytes_per_s : rates.d2h_bytes_per_s;
    const double change_ns = moved / rate * 1e9 / static_cast<double>(std::max<std::size_t>(config_.resident_hold_steps, 1));
    if (out.plan.prediction.total_ns + change_ns >= kept.total_ns) {
      Plan held;
      held.policy = Policy::automatic;
      held.placement = keep;
      held.static_residents = current_statics_;
      held.gpu_streamed = static_cast<std::size_t>(std::count(keep.begin(), keep.end(), Placement::gpu));
      held.k = held.gpu_streamed > 0 ? out.plan.k : 0;
      held.gpu_slots = held.gpu_streamed > 0 ? std::min(w.gpu_slot_limit, kUsefulSlots) : 0;
      held.prediction = kept;
      out.reason = "kept " + count_words(current_statics_, "static resident") + ": moving to " +
                   std::to_string(out.plan.static_residents) + " would save less than its copies cost over " +
                   std::to_string(config_.resident_hold_steps) + " steps";
      out.plan = std::move(held);
    }
  }
  const std::size_t largest = *std::max_element(w.subgroup_params.begin(), w.subgroup_params.end());
  out.budget.slots_taken = out.plan.gpu_slots * gpu_slot_bytes(largest, w.grads_on_host);
  out.budget.residents_taken = resident_packs(largest).bytes_for(out.plan.static_residents);
  // Gradients kept on the GPU live from backward through the update phase, beside the slots:
  // they get what both phases leave, and nothing while no backward has been measured.
  last_placement_ = out.plan.placement;
  const auto bwd = static_cast<int>(Phase::backward);
  const auto upd = static_cast<int>(Phase::update);
  grad_keep_bytes_ = 0;
  if (out.budget.phase_seen[bwd] && out.budget.phase_seen[upd] && device_ops_available(device_)) {
    const std::uint64_t margin = allocator_.headroom_margin();
    // The plan's residents stay through backward and the update phase, its slots through the
    // update phase: kept gradients get what is left of both (the phase figures count the
    // engine's loans as free).
    const std::uint64_t residents = out.budget.residents_taken;
    const std::uint64_t bwd_left = sat_sub(out.budget.phase_min_unreserved[bwd], residents);
    const std::uint64_t upd_left = sat_sub(out.budget.phase_min_free[upd], out.budget.slots_taken + residents);
    grad_keep_bytes_ = sat_sub(std::min(bwd_left, upd_left), margin);
  }
  return out;
}

// ---- stepping -------------------------------------------------------------------------------

UpdateScheduler& UpdateEngine::scheduler_for(const Ranges& ranges) {
  for (auto it = cache_.begin(); it != cache_.end(); ++it) {
    if (it->ranges == ranges) {
      if (it != cache_.begin()) cache_.splice(cache_.begin(), cache_, it);
      return *cache_.front().scheduler;
    }
  }
  std::vector<ExternalSubgroup> ext;
  ext.reserve(ranges.size());
  for (auto [s, e] : ranges) {
    void* model =
        model_params_ == nullptr ? nullptr : static_cast<unsigned char*>(model_params_) + s * dtype_size(model_dtype_);
    ext.push_back(ExternalSubgroup{param() + s, exp_avg() + s, exp_avg_sq() + s, grad() + s, e - s, model});
  }
  Entry entry;
  entry.ranges = ranges;
  entry.state = OptimizerState::external(device_, ext, model_dtype_);
  if (nvme_) nvme_->route(*entry.state, ranges);
  entry.scheduler = std::make_unique<UpdateScheduler>(*entry.state, allocator_, pool_);
  if (nvme_) nvme_->attach(*entry.scheduler);
  cache_.push_front(std::move(entry));
  return *cache_.front().scheduler;
}

EngineStep UpdateEngine::step(const std::vector<Placement>& placement, std::size_t gpu_slots,
                              const std::vector<Segment>& segments, double grad_scale, double clip, bool l2,
                              bool skip_if_nonfinite, double predicted_ns, std::optional<bool> path_verdict,
                              const std::vector<GradSource>& sources) {
  Busy busy(*this);
  if (placement.size() != subgroups_.size()) {
    throw InvalidArgument("UpdateEngine::step: placement has " + std::to_string(placement.size()) +
                          " entries, there are " + std::to_string(subgroups_.size()) + " subgroups");
  }
  for (const Segment& s : segments) {
    if (s.subgroup >= subgroups_.size() || s.start < subgroups_[s.subgroup].first ||
        s.end > subgroups_[s.subgroup].second || s.end <= s.start) {
      throw InvalidArgument("UpdateEngine::step: segment [" + std::to_string(s.start) + ", " + std::to_string(s.end) +
                            ") is empty or not inside subgroup " + std::to_string(s.subgroup));
    }
  }
  // A running save keeps its view of each subgroup just before a scheduler writes its host state
  // (not all at the start): the step's work on the subgroups already saved overlaps the writer's.
  SaveGuard guard(*this);  // another scheduler's residents may be retired below
  EngineStep out;
  out.predicted_ns = predicted_ns;
  out.placement = placement;
  // What the host holds of spilled subgroups (a checkpoint read or load) goes back to NVMe
  // first: the step reads them from there.
  if (nvme_) nvme_->before_step();
  // One check of every gradient before anything is stepped: the gradient path's verdict, or a
  // scan of the host arrays. The verdict was taken on the gradients as they came; a factor of
  // magnitude <= 1 cannot make a finite one overflow (a negative scale is maximize=True).
  const bool trust_path = path_verdict.has_value() && std::abs(grad_scale) * clip <= 1.0;
  if (trust_path) out.nonfinite = !*path_verdict;
  auto kept = [&](std::size_t subgroup) {
    return grad_state_ != nullptr && (*grad_state_)[subgroup].device_grad != nullptr;
  };
  bool any_kept = false;
  for (const Segment& s : segments) any_kept = any_kept || kept(s.subgroup);
  // Without a loss scaler nothing waits for the verdict: when every segment is updated on the
  // CPU, the fused kernel's own flag (raised in the same pass that updates) replaces a separate
  // scan of every gradient, which cost one more read of the gradients (4 B/param on top of 28).
  bool every_cpu = true;
  for (const Segment& s : segments) every_cpu = every_cpu && placement[s.subgroup] == Placement::cpu;
  const bool flag_from_kernel = !trust_path && !skip_if_nonfinite && every_cpu;
  if (!sources.empty()) {
    if (!every_cpu || !(trust_path || flag_from_kernel) || any_kept) {
      throw InvalidArgument("UpdateEngine::step: gradients read where they lie need a step whose every segment is "
                            "updated on the CPU and whose NaN/Inf verdict needs no scan (the path's verdict, or no "
                            "skip_if_nonfinite)");
    }
    std::size_t at = 0;
    for (const GradSource& g : sources) {
      if (g.start < at || g.n == 0 || g.start + g.n > n_ || g.data == nullptr ||
          (g.dtype != DType::fp32 && g.dtype != DType::fp16 && g.dtype != DType::bf16)) {
        throw InvalidArgument("UpdateEngine::step: gradient source [" + std::to_string(g.start) + ", " +
                              std::to_string(g.start + g.n) + ") is empty, overlaps the one before, is past the " +
                              std::to_string(n_) + " params, is null or is not fp32/fp16/bf16");
      }
      at = g.start + g.n;
    }
  }
  if (!trust_path && !flag_from_kernel) {
    // The host arrays are scanned, so they must hold every gradient, kept ones included.
    if (any_kept) {
      grads_to_host();
      any_kept = false;
    }
    for (const Segment& s : segments) {
      device_.run_host_work(HostWork{static_cast<double>(s.end - s.start) * 4, 0}, [&] {
        out.nonfinite = !grads_finite(grad() + s.start, DType::fp32, s.end - s.start, grad_scale, clip, pool_);
      });
      if (out.nonfinite) break;
    }
  }
  out.skipped = out.nonfinite && skip_if_nonfinite;
  if (out.skipped || segments.empty()) return out;

  std::map<HyperKey, std::vector<Segment>> by_key;
  for (const Segment& s : segments) {
    std::vector<Segment>& list = by_key[key_of(s.params)];
    // Adjacent parts of one subgroup with the same hyper-parameters (param groups that agree)
    // run as one range: one scheduler entry, and for a spilled subgroup one use of its staging.
    if (!list.empty() && list.back().subgroup == s.subgroup && list.back().end == s.start) {
      list.back().end = s.end;
    } else {
      list.push_back(s);
    }
  }
  std::vector<UpdateScheduler*> used;
  for (auto& [key, list] : by_key) {
    Ranges ranges;
    Plan plan;
    plan.gpu_slots = gpu_slots;
    for (const Segment& s : list) {
      ranges.emplace_back(s.start, s.end);
      Placement where = placement[s.subgroup];
      // Part of a spilled subgroup goes through the CPU: its staging buffer holds the whole
      // subgroup, and a GPU slot would take it for one range only (the result is the same).
      const bool whole = s.start == subgroups_[s.subgroup].first && s.end == subgroups_[s.subgroup].second;
      if (nvme_ && nvme_->spilled(s.subgroup) && where != Placement::cpu && !whole) where = Placement::cpu;
      plan.placement.push_back(where);
    }
    UpdateScheduler& scheduler = scheduler_for(ranges);
    for (Entry& e : cache_) {
      if (e.scheduler.get() == &scheduler) guard.arm(e);  // new, or moved to the front
    }
    // A gradient kept on the device is read there when its segment is the whole subgroup; a
    // part of a subgroup reads the host array, so such a subgroup's gradient goes there first.
    if (any_kept) {
      for (std::size_t j = 0; j < list.size(); ++j) {
        const Segment& sg = list[j];
        if (!kept(sg.subgroup)) continue;
        const bool whole = sg.start == subgroups_[sg.subgroup].first && sg.end == subgroups_[sg.subgroup].second;
        if (!whole) {
          grads_to_host();
          any_kept = false;
          break;
        }
      }
      for (std::size_t j = 0; j < list.size() && any_kept; ++j) {
        const Segment& sg = list[j];
        if (kept(sg.subgroup)) scheduler_state(scheduler, j).device_grad = (*grad_state_)[sg.subgroup].device_grad;
      }
    }
    // Residents of another scheduler may hold newer state than the host arrays this one reads.
    for (Entry& e : cache_) {
      if (e.scheduler.get() != &scheduler && std::find(used.begin(), used.end(), e.scheduler.get()) == used.end()) {
        retire(e);
      }
    }
    StepParams params = list.front().params;
    params.grad_scale = grad_scale;
    params.clip = clip;
    params.l2 = l2;
    params.grads_finite = true;  // checked above, once for the whole step
    const std::vector<std::size_t> left =
        nvme_ ? nvme_->move_residents(scheduler, subgroups_of(list), plan.placement) : std::vector<std::size_t>{};
    if (!sources.empty()) {
      for (std::size_t j = 0; j < list.size(); ++j) {
        // The sources inside this range, cut to it (both lists are sorted).
        std::vector<GradPiece> pieces;
        auto it = std::lower_bound(sources.begin(), sources.end(), list[j].start,
                                   [](const GradSource& g, std::size_t at) { return g.start + g.n <= at; });
        for (; it != sources.end() && it->start < list[j].end; ++it) {
          const std::size_t b = std::max(it->start, list[j].start);
          const std::size_t e = std::min(it->start + it->n, list[j].end);
          const void* data = static_cast<const unsigned char*>(it->data) + (b - it->start) * dtype_size(it->dtype);
          pieces.push_back(GradPiece{b - list[j].start, e - list[j].start, data, it->dtype});
        }
        scheduler.set_grad_pieces(j, std::move(pieces));
      }
    }
    const StepReport r = scheduler.run(plan, params);
    if (flag_from_kernel) out.nonfinite = out.nonfinite || r.cpu_nonfinite;
    // Residents that left were copied back into their host ranges by the run (as they were before
    // this step): NVMe has their new state, the pages go.
    for (std::size_t g : left) nvme_->drop_pages(g);
    for (std::size_t j = 0; j < list.size(); ++j) scheduler_state(scheduler, j).device_grad = nullptr;
    used.push_back(&scheduler);
    ++out.runs;
    StepReport& t = out.total;
    if (out.runs == 1) t.phase_start_ns = r.phase_start_ns;
    for (TieringOp op : r.ops) {  // scheduler-local subgroup -> the engine's, on the first run's clock
      op.subgroup = list[op.subgroup].subgroup;
      op.start_ns += r.phase_start_ns - t.phase_start_ns;
      op.end_ns += r.phase_start_ns - t.phase_start_ns;
      t.ops.push_back(op);
    }
    t.phase_ns += r.phase_ns;
    add_use(t.cpu, r.cpu);
    add_use(t.gpu, r.gpu);
    add_use(t.h2d, r.h2d);
    add_use(t.d2h, r.d2h);
    t.h2d_d2h_overlap_ns += r.h2d_d2h_overlap_ns;
    t.params_cpu += r.params_cpu;
    t.params_gpu += r.params_gpu;
    t.params_gpu_static += r.params_gpu_static;
    t.setup_allocations += r.setup_allocations;
    t.loop_allocations += r.loop_allocations;
    t.loop_device_allocs += r.loop_device_allocs;
    t.nvme += r.nvme;
    t.nvme_transfers.insert(t.nvme_transfers.end(), r.nvme_transfers.begin(), r.nvme_transfers.end());
  }
  if (nvme_) nvme_->after_step(out.total.nvme);
  if (sink_ && sink_->kept_bytes() > 0) sink_->release();  // read by this step; gone before the next forward
  // The residents of this step's schedulers now hold the newest state of their subgroups; the
  // host arrays get it when someone reads them (sync_host), not on every step.
  std::size_t statics = 0;
  for (Placement p : placement) statics += p == Placement::gpu_static;
  current_statics_ = statics;
  // This step's schedulers are at the front (most recently used); older ones make room.
  while (cache_.size() > std::max(kCacheEntries, used.size())) {
    retire(cache_.back());
    cache_.pop_back();
  }
  observe(out.total, predicted_ns);
  return out;
}

void UpdateEngine::set_layout(ParamLayout layout) {
  Busy busy(*this);
  const std::size_t covered = layout.params().empty() ? 0 : layout.params().back().end;
  if (covered != n_) {
    throw InvalidArgument("UpdateEngine::set_layout: the layout covers " + std::to_string(covered) +
                          " elements, the engine has " + std::to_string(n_));
  }
  layout_ = std::move(layout);
  plan_.reset();
}

void UpdateEngine::set_policy(PolicyChoice choice) {
  Busy busy(*this);
  if (!(choice.static_fraction >= 0 && choice.static_fraction <= 1)) {
    throw InvalidArgument("UpdateEngine::set_policy: static_fraction must be in [0, 1], got " +
                          std::to_string(choice.static_fraction));
  }
  if (choice.k && !(*choice.k >= 1 && std::isfinite(*choice.k))) {
    throw InvalidArgument("UpdateEngine::set_policy: the stride k must be finite and >= 1, got " +
                          std::to_string(*choice.k));
  }
  policy_ = choice;
  plan_.reset();
}

EnginePlan UpdateEngine::current_plan() {
  Busy busy(*this);
  if (!plan_) plan_ = plan(policy_.policy, policy_.static_fraction, policy_.k);
  return *plan_;
}

void UpdateEngine::set_sync_after_step(bool on) {
  Busy busy(*this);
  sync_after_step_ = on;
}

std::vector<Segment> UpdateEngine::segments(const StepRequest& request, std::optional<std::size_t> only) const {
  Busy busy(*this);
  return layout_.segments(request.groups, request.has_grad, only);
}

EngineStep UpdateEngine::step(const StepRequest& request) {
  Busy busy(*this);
  if (!request.done.empty() && request.done.size() != subgroups_.size()) {
    throw InvalidArgument("UpdateEngine::step: " + std::to_string(request.done.size()) + " done flags, there are " +
                          std::to_string(subgroups_.size()) + " subgroups");
  }
  if (layout_.size() == 0) {
    throw InvalidArgument("UpdateEngine::step: no params laid out; call set_layout before the first step");
  }
  std::vector<Segment> all = layout_.segments(request.groups, request.has_grad);
  if (all.empty()) return EngineStep{};
  // Under auto without a stride the memory and the rates decide, and both move: plan anew.
  if (policy_.policy == Policy::automatic && !policy_.k) plan_.reset();
  const EnginePlan planned = current_plan();
  std::vector<Placement> placement = planned.plan.placement;
  if (!request.done.empty()) {
    // Updated during backward: the run leaves them as they are, and the scheduler cached for the
    // whole placement stays the one a full step uses, with its residents where they are.
    for (std::size_t g = 0; g < placement.size(); ++g) {
      if (request.done[g]) placement[g] = Placement::done;
    }
  }
  EngineStep out = step(placement, planned.plan.gpu_slots, all, request.grad_scale, request.clip, /*l2=*/false,
                        request.skip_if_nonfinite, planned.plan.prediction.total_ns, request.path_verdict,
                        request.grad_sources);
  observe_traffic(out.total);
  if (out.skipped) return out;
  if (sync_after_step_) sync_host();
  layout_.advance(request.has_grad);
  return out;
}

// The previous phase's records have arrived by now: the links' busy time less the engine's own
// copies tells the next plans what others take.
double UpdateEngine::observe_iteration(double predicted_ns, double measured_ns) {
  Busy busy(*this);
  return calibration_.observe_iteration(predicted_ns, measured_ns);
}

void UpdateEngine::observe_traffic(const StepReport& r) {
  if (!traffic_ || device_.properties().virtual_clock) return;  // a tracer watches the host's clock
  if (last_phase_[1] > last_phase_[0]) {
    if (const std::optional<LinkTraffic> seen = traffic_(last_phase_[0], last_phase_[1])) {
      calibration_.observe_pcie(PcieObservation{last_phase_[1] - last_phase_[0], seen->h2d_busy_ns,
                                                seen->d2h_busy_ns, last_own_[0], last_own_[1]});
    }
  }
  last_phase_[0] = r.phase_start_ns;
  last_phase_[1] = r.phase_start_ns + r.phase_ns;
  last_own_[0] = r.h2d.busy_ns;
  last_own_[1] = r.d2h.busy_ns;
}

void UpdateEngine::push_grad(std::size_t offset, const void* source, DType dtype, std::size_t n, Stream producer) {
  Busy busy(*this);
  if (offset > n_ || n > n_ - offset) {
    throw InvalidArgument("UpdateEngine::push_grad: elements [" + std::to_string(offset) + ", " +
                          std::to_string(offset + n) + ") are past the " + std::to_string(n_) + " params");
  }
  if (dtype != DType::fp32 && dtype != DType::fp16 && dtype != DType::bf16) {
    throw InvalidArgument(std::string("UpdateEngine::push_grad: gradients must be fp32, fp16 or bf16, got ") + dtype_name(dtype));
  }
  if (n == 0) return;
  if (!sink_) {
    std::vector<ExternalSubgroup> ext;
    for (auto [s, e] : subgroups_) ext.push_back(ExternalSubgroup{param() + s, exp_avg() + s, exp_avg_sq() + s, grad() + s, e - s});
    grad_state_ = OptimizerState::external(device_, ext);
    sink_ = std::make_unique<GradSink>(*grad_state_, allocator_);
  }
  if (!grads_open_) {
    std::vector<Placement> place = last_placement_;
    if (place.size() != subgroups_.size()) place.assign(subgroups_.size(), Placement::cpu);  // no plan yet
    for (std::size_t g = 0; g < host_gradients_.size(); ++g) {
      if (host_gradients_[g]) place[g] = Placement::cpu;  // updated on the CPU during this backward
    }
    sink_->begin(place, grad_keep_bytes_);
    last_kept_bytes_ = sink_->kept_bytes();
    grads_open_ = true;
  }
  sink_->push(offset, source, dtype, n, producer);
  device_.stream_wait_event(producer, sink_->consumed());
}

bool UpdateEngine::finish_grads() {
  Busy busy(*this);
  if (!grads_open_) return true;
  grads_open_ = false;
  return sink_->finish();
}

void UpdateEngine::wait_grads_pushed() {
  Event landed{};
  {
    Busy busy(*this);
    if (!sink_ || !grads_open_) return;
    landed = device_.create_event();
    sink_->record_landed(landed);
  }
  device_.event_synchronize(landed);  // backward may push meanwhile
  Busy busy(*this);
  device_.destroy_event(landed);
}

void UpdateEngine::grads_to_host() {
  Busy busy(*this);
  if (!sink_ || sink_->kept_bytes() == 0) return;
  if (grads_open_) finish_grads();
  const Stream s{};
  for (std::size_t k = 0; k < grad_state_->size(); ++k) {
    const Subgroup& g = (*grad_state_)[k];
    if (g.device_grad != nullptr) device_.copy_async(g.grad, g.device_grad, g.n * sizeof(float), CopyKind::device_to_host, s);
  }
  device_.stream_synchronize(s);
  sink_->release();
}

void UpdateEngine::host_changed() {
  Busy busy(*this);
  for (Entry& e : cache_) {
    // A spilled resident whose host range was never filled has its only copy on the device:
    // kept (to the host range, then NVMe) rather than dropped. The others' ranges are the truth.
    if (nvme_) nvme_->keep_unfilled_residents(e.ranges, *e.scheduler);
    e.scheduler->discard_residents();
  }
  if (nvme_) nvme_->host_changed();
}

void UpdateEngine::sync_host() {
  Busy busy(*this);
  sync_residents();
  if (nvme_) nvme_->load_all();
}

void UpdateEngine::sync_residents() {
  SaveGuard guard(*this);  // residents come back over their host ranges
  for (Entry& e : cache_) {
    if (e.scheduler->resident_count() == 0) continue;
    e.scheduler->sync_to_host();
    if (nvme_) nvme_->synced(e.ranges, *e.scheduler);
  }
}

std::shared_ptr<StateSnapshot> UpdateEngine::save_async(const std::filesystem::path& target, std::uint64_t buffer_bytes,
                                                        std::string meta, std::optional<StateSnapshot::Config::Part> part) {
  Busy busy(*this);
  if (nvme_ && !nvme_->readable_beside()) {
    throw InvalidArgument("UpdateEngine::save_async: the NVMe tier is simulated (a phantom device): there is no "
                          "state to save");
  }
  prepare_save();
  StateSnapshot::Config c;
  c.target = target;
  c.param = arrays_[0];
  c.exp_avg = arrays_[1];
  c.exp_avg_sq = arrays_[2];
  c.n = n_;
  c.subgroups = subgroups_;
  c.buffer_bytes = buffer_bytes;
  c.meta = std::move(meta);
  c.part = std::move(part);
  c.buffers = save_buffers_;
  if (nvme_) {
    c.elsewhere = nvme_->on_nvme();
    c.read_elsewhere = [tier = nvme_.get()](std::size_t i, void* dst) { return tier->read_beside(i, dst); };
  }
  std::shared_ptr<StateSnapshot> snapshot = StateSnapshot::start(std::move(c));
  save_ = snapshot;
  return snapshot;
}

void UpdateEngine::prepare_save(bool spill) {
  if (std::shared_ptr<SaveTarget> previous = running_save()) {
    try {
      previous->wait();  // one at a time, never interleaved
    } catch (const IoError&) {
      // It failed and said so where it was asked for (its wait() or log); this save is not it.
    }
  }
  sync_residents();  // their newest state, in the host ranges the save reads
  // Every spilled subgroup's state on NVMe, where the writer reads it: not loaded into host memory.
  if (spill && nvme_ && nvme_->readable_beside()) nvme_->spill(n_);
}

std::shared_ptr<FrozenState> UpdateEngine::freeze(std::vector<FrozenState::Range> needed, std::uint64_t buffer_bytes,
                                                  double stall_s, std::string target) {
  Busy busy(*this);
  if (nvme_) {
    throw InvalidArgument("UpdateEngine::freeze: the optimizer spills to NVMe, and a spilled subgroup's host range is let go "
                          "between steps; save it with TieredAdamW.save_checkpoint, which reads the spill file");
  }
  FrozenState::Config c;
  for (std::size_t k = 0; k < 3; ++k) c.arrays[k] = arrays_[k];
  c.n = n_;
  c.subgroups = subgroups_;
  c.needed = std::move(needed);
  c.buffer_bytes = buffer_bytes;
  c.buffers = save_buffers_;
  c.stall = std::chrono::duration<double>(stall_s);
  c.target = std::move(target);
  std::shared_ptr<FrozenState> frozen = FrozenState::start(std::move(c));  // checks before anything waits
  prepare_save(false);
  save_ = frozen;
  return frozen;
}

void UpdateEngine::start_save(const std::function<std::shared_ptr<SaveTarget>()>& start) {
  Busy busy(*this);
  prepare_save();
  save_ = start();
}

std::shared_ptr<SaveTarget> UpdateEngine::running_save() {
  Busy busy(*this);
  if (save_ && save_->done()) save_.reset();
  return save_;
}

void UpdateEngine::protect_host(std::size_t subgroup) {
  if (std::shared_ptr<SaveTarget> s = running_save()) s->protect(subgroup, nullptr, nullptr, nullptr);
}

Subgroup& UpdateEngine::scheduler_state(UpdateScheduler& scheduler, std::size_t j) {
  for (Entry& e : cache_) {
    if (e.scheduler.get() == &scheduler) return (*e.state)[j];
  }
  throw Error("UpdateEngine: scheduler not in the cache (internal error)");
}

void UpdateEngine::retire(Entry& e) {
  if (e.scheduler->resident_count() == 0) return;
  e.scheduler->sync_to_host();
  // A spilled resident's newest state is now in its host range only: on to NVMe before anything
  // reads it from there (the run that retired it may be about to).
  const std::vector<std::size_t> spilled = nvme_ ? nvme_->residents(e.ranges, *e.scheduler) : std::vector<std::size_t>{};
  e.scheduler->discard_residents();
  if (nvme_ && nvme_->copied_to_host(spilled)) spill_host(n_);
}

void UpdateEngine::observe(const StepReport& r, double predicted_ns) {
  if (r.cpu.busy_ns > 0 && r.cpu.params > 0) {
    calibration_.observe_cpu_update(static_cast<std::size_t>(r.cpu.params), r.cpu.busy_ns);
  }
  if (r.gpu.busy_ns > 0 && r.gpu.params > 0) {
    calibration_.observe_gpu_update(static_cast<std::size_t>(r.gpu.params), r.gpu.busy_ns);
  }
  if (r.h2d.busy_ns > 0 && r.h2d.bytes > 0) {
    calibration_.observe_copy(CopyKind::host_to_device, static_cast<std::size_t>(r.h2d.bytes), r.h2d.busy_ns);
  }
  if (r.d2h.busy_ns > 0 && r.d2h.bytes > 0) {
    calibration_.observe_copy(CopyKind::device_to_host, static_cast<std::size_t>(r.d2h.bytes), r.d2h.busy_ns);
  }
  if (predicted_ns > 0 && r.phase_ns > 0 && std::isfinite(predicted_ns)) {
    calibration_.observe_update_phase(predicted_ns, r.phase_ns);
    observe_iteration_of_this_step(predicted_ns, r.phase_ns);
  }
}

// On a GPU the phase tracker and the scheduler share the wall clock, so the whole iteration can
// be checked too: predicted from the passes as the last iteration ran them and the update as
// planned (PerfModel::predict_iteration), measured as this iteration's passes and its update.
// (On a SimDevice the scheduler's clock is virtual; the iteration simulator observes it there.)
void UpdateEngine::observe_iteration_of_this_step(double update_predicted_ns, double update_measured_ns) {
  if (device_.properties().virtual_clock) return;
  const PhaseReport report = allocator_.phase_report();
  if (report.history.empty()) return;
  const auto& last = report.history.back().phases;
  const auto& now = report.running.phases;
  const auto fwd = static_cast<int>(Phase::forward);
  const auto bwd = static_cast<int>(Phase::backward);
  if (!last[fwd].seen || !last[bwd].seen || !now[fwd].seen || !now[bwd].seen) return;
  PassWork forward, backward;
  forward.compute_ns = last[fwd].duration_ns;
  backward.compute_ns = last[bwd].duration_ns;
  Prediction update;
  update.total_ns = update_predicted_ns;
  const double predicted = model_.predict_iteration(forward, backward, update).total_ns;
  const double measured = now[fwd].duration_ns + now[bwd].duration_ns + update_measured_ns;
  if (predicted > 0 && measured > 0) calibration_.observe_iteration(predicted, measured);
}

}  // namespace memtide::tiering
