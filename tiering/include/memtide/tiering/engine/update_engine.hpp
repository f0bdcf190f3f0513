#pragma once
/// @file
/// UpdateEngine: the optimizer's tiering engine on one device. It owns the host state (four flat
/// fp32 arrays in the device's HostArena, cut into subgroups), plans each update phase with the
/// PerfModel from the memory the phase tracker says is free, runs the UpdateScheduler and feeds
/// what it measured back into the Calibration: plan -> schedule -> calibrate. Its residents,
/// device memory budget, lending and NVMe tier are described in docs/architecture.md
/// ("UpdateEngine"). Every public call holds the engine's own lock: callers on several threads (a front end, the
/// updates during backward) need no lock of their own.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/checkpoint/frozen_state.hpp"
#include "memtide/tiering/checkpoint/state_snapshot.hpp"
#include "memtide/tiering/engine/engine_types.hpp"
#include "memtide/tiering/engine/grad_sink.hpp"
#include "memtide/tiering/engine/param_layout.hpp"
#include "memtide/tiering/model/calibration.hpp"
#include "memtide/tiering/nvme/spill_tier.hpp"

namespace memtide::tiering {

struct EngineConfig {
  std::size_t low_precision_bytes = 2;   ///< the model's copy: 2 (fp16/bf16) or 4 (fp32)
  std::size_t resident_hold_steps = 20;  ///< steps over which a change of the resident set must pay for its copies
  CalibrationConfig calibration = CalibrationConfig::from_options();
  Rates defaults{};  ///< rates before anything is measured
  NvmeTierConfig nvme{};
};

class UpdateEngine {
 public:
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;  ///< [start, end) element ranges

  /// Host state for `n` params from `arena` (zeroed), cut into `subgroups` (consecutive, covering
  /// [0, n)); `pool`: the CPU step's threads (null: the caller only). On a phantom device the
  /// engine only times its work. Throws InvalidArgument naming the bad subgroup or value.
  UpdateEngine(CachingAllocator& allocator, HostArena& arena, std::size_t n, Ranges subgroups, ThreadPool* pool,
               EngineConfig config = {});
  /// Drops device copies, gives the host arrays back to the arena.
  ~UpdateEngine();
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] float* param() const noexcept { return arrays_[0]; }
  [[nodiscard]] float* exp_avg() const noexcept { return arrays_[1]; }
  [[nodiscard]] float* exp_avg_sq() const noexcept { return arrays_[2]; }
  [[nodiscard]] float* grad() const noexcept { return arrays_[3]; }
  [[nodiscard]] const Ranges& subgroups() const noexcept { return subgroups_; }
  [[nodiscard]] Device& device() noexcept { return device_; }
  /// Pinned host bytes the arrays take in the arena (what was asked for, rounded to its alignment).
  [[nodiscard]] std::uint64_t host_bytes() const;

  // ---- the step an optimizer asks for ---------------------------------------------------------
  /// Where the optimizer's params lie; drops the current plan. Throws InvalidArgument unless it covers the engine.
  void set_layout(ParamLayout layout);
  [[nodiscard]] ParamLayout& layout() noexcept { return layout_; }
  /// The policy step(const StepRequest&) plans with; drops the current plan.
  void set_policy(PolicyChoice choice);
  [[nodiscard]] const PolicyChoice& policy() const noexcept { return policy_; }
  /// The plan the next step runs: made under the policy when there is none (every step under auto
  /// without k). A copy: another thread's step may plan anew meanwhile.
  EnginePlan current_plan();
  /// Copy the residents' newest state into the host arrays after every step (params that are views of them).
  void set_sync_after_step(bool on);
  /// The optimizer's step: segmented by the layout, planned under the policy, run, counted unless skipped.
  EngineStep step(const StepRequest& request);
  /// The segments step(request) would run; only subgroup `only` when given.
  [[nodiscard]] std::vector<Segment> segments(const StepRequest& request, std::optional<std::size_t> only = {}) const;

  // ---- the engine's parts, for callers that plan themselves -----------------------------------
  /// The plan for the next step under `policy` (see PerfModel::plan), sized to the device memory available now.
  EnginePlan plan(Policy policy, double static_fraction = 0, std::optional<double> k = std::nullopt);
  /// Steps `segments` under `placement` with `gpu_slots` slots after one check of every gradient (the
  /// path's verdict if given and grad_scale * clip <= 1); one scheduler phase per hyper-parameters.
  EngineStep step(const std::vector<Placement>& placement, std::size_t gpu_slots, const std::vector<Segment>& segments,
                  double grad_scale, double clip, bool l2, bool skip_if_nonfinite, double predicted_ns = 0,
                  std::optional<bool> path_verdict = std::nullopt, const std::vector<GradSource>& sources = {});

  /// Gradients [offset, offset + n) at `source` are final on `producer`: to the host array (GradSink).
  void push_grad(std::size_t offset, const void* source, DType dtype, std::size_t n, Stream producer);
  /// Waits until every pushed gradient is in place; whether all were finite (kept ones stay on the device).
  bool finish_grads();
  /// Waits until the gradients pushed so far that go to host memory are there (from any thread).
  void wait_grads_pushed();
  /// Moves gradients kept on the device into the host array (before the host copy is edited).
  void grads_to_host();
  /// Bytes of fp32 gradients kept in device memory now; bytes the gradient path copied to the host so far.
  [[nodiscard]] std::uint64_t kept_grad_bytes() const noexcept { return sink_ ? sink_->kept_bytes() : 0; }
  [[nodiscard]] double grad_bytes_to_host() const noexcept { return sink_ ? sink_->bytes_to_host() : 0; }

  /// The model's fp16/bf16 params in device memory (made on first call; every step writes them).
  void* model_params(DType dtype);
  [[nodiscard]] DType model_dtype() const noexcept { return model_dtype_; }
  /// The CPU step's threads (null: the caller only).
  [[nodiscard]] ThreadPool* pool() const noexcept { return pool_; }

  /// The host arrays were changed outside step(): device copies of residents are stale.
  void host_changed();
  /// Copies the newest state of static residents (and spilled subgroups) into the host arrays.
  void sync_host();

  // ---- checkpoints while training goes on ---------------------------------------------------
  /// Starts saving the host state (params, exp_avg, exp_avg_sq) to `target` while steps go on
  /// (StateSnapshot): brings residents' state to the host first, then every step protects the
  /// subgroups whose host state it changes. One save at a time: a running one is waited for.
  /// `buffer_bytes` bounds the copy-on-write buffer (0: two of the largest subgroup); `meta` is
  /// saved beside the state; `part` makes it one process's part of a sharded checkpoint. Throws
  /// InvalidArgument with the NVMe tier (its spilled subgroups are not saved this way yet) and
  /// for a bad target.
  std::shared_ptr<StateSnapshot> save_async(const std::filesystem::path& target, std::uint64_t buffer_bytes,
                                            std::string meta,
                                            std::optional<StateSnapshot::Config::Part> part = std::nullopt);
  /// Freezes the host state for a reader that is not memtide's (torch.distributed.checkpoint's
  /// writer, through memtide.optim.StateWriter): as save_async, a running save is waited for and
  /// the residents' state brought home, then every step protects the subgroups whose host state
  /// it changes until the reader has read `needed` or closes the FrozenState. Throws
  /// InvalidArgument with the NVMe tier: the host ranges of spilled subgroups are let go between
  /// steps, so the reader would not find their state there.
  std::shared_ptr<FrozenState> freeze(std::vector<FrozenState::Range> needed, std::uint64_t buffer_bytes, double stall_s,
                                      std::string target);
  /// Starts a save that is not a StateSnapshot (the simulator's, on its device's clock), as
  /// save_async does: a running save is waited for and the residents' state brought home first,
  /// then `start()` makes the save the steps protect from then on.
  void start_save(const std::function<std::shared_ptr<SaveTarget>()>& start);
  /// The running save (null when none, or once it is over).
  [[nodiscard]] std::shared_ptr<SaveTarget> running_save();
  /// Before the host state of `subgroup` changes outside step() (updates during backward): keeps
  /// a running save's view of it.
  void protect_host(std::size_t subgroup);

  [[nodiscard]] Rates rates() const { return calibration_.rates(); }
  [[nodiscard]] PredictionErrors prediction_errors() const { return calibration_.error_summary(); }
  /// A whole iteration predicted (PerfModel::predict_iteration) and measured; returns the error.
  double observe_iteration(double predicted_ns, double measured_ns);
  [[nodiscard]] PredictionErrors iteration_errors() const { return calibration_.iteration_error_summary(); }
  /// What CUPTI saw on the PCIe links in the last update phase (Calibration::observe_pcie).
  void observe_pcie(const PcieObservation& o) { calibration_.observe_pcie(o); }
  /// What the PCIe links did in [from_ns, to_ns) of the host clock; nullopt when nobody watches.
  using TrafficSource = std::function<std::optional<LinkTraffic>(double from_ns, double to_ns)>;
  /// After each step(StepRequest) on a host-clock device, asks `source` about the previous phase.
  void set_traffic_source(TrafficSource source) { traffic_ = std::move(source); }
  /// Bytes others copy H2D at the start of each update phase (Workload::phase_h2d_bytes); >= 0.
  void set_phase_h2d_bytes(double bytes);
  /// Subgroups updated before the coming update phase (empty: none): planned as Placement::done.
  void set_done_before_phase(std::vector<bool> done);
  /// Subgroups whose gradients the next backward sends to host memory whatever the plan says.
  void set_host_gradients(std::vector<bool> host);
  [[nodiscard]] std::pair<double, double> foreign_pcie_share() const { return calibration_.foreign_pcie_share(); }
  /// Bytes of device memory the engine holds between steps (static residents, small buffers).
  [[nodiscard]] std::uint64_t resident_bytes() const;

  /// Per subgroup: its params and moments live on NVMe (empty: no NVMe tier).
  [[nodiscard]] const std::vector<bool>& on_nvme() const noexcept;
  [[nodiscard]] NvmeTierInfo nvme_info() const;
  /// Writes spilled subgroups wholly below element `up_to` to NVMe and drops their host pages.
  void spill_host(std::size_t up_to);
  /// The NVMe tier (null: none), for its benchmark and test hooks.
  [[nodiscard]] SpillTier* nvme_tier() noexcept { return nvme_.get(); }

 private:
  struct Entry;  // a cached scheduler over exactly some ranges of the flat arrays
  UpdateScheduler& scheduler_for(const Ranges& ranges);
  /// Moves an entry's residents back into the host arrays and frees them.
  void retire(Entry& e);
  /// The `j`th subgroup of a cached scheduler's state.
  Subgroup& scheduler_state(UpdateScheduler& scheduler, std::size_t j);
  void observe(const StepReport& r, double predicted_ns);
  void observe_iteration_of_this_step(double update_predicted_ns, double update_measured_ns);

  CachingAllocator& allocator_;
  Device& device_;
  HostArena& arena_;
  ThreadPool* pool_;
  EngineConfig config_;
  std::size_t n_;
  Ranges subgroups_;
  float* arrays_[4] = {};
  void* blocks_[4] = {};  ///< the arena blocks arrays_ start in (see kArraySkew)
  PerfModel model_;
  Calibration calibration_;
  std::list<Entry> cache_;  // most recently used first
  void* model_params_ = nullptr;       // the model's low-precision params (device memory)
  std::unique_ptr<OptimizerState> grad_state_;  // the subgroups, for the gradient path
  std::unique_ptr<GradSink> sink_;
  bool grads_open_ = false;            // pushed since the last finish_grads
  std::vector<Placement> last_placement_;  // the last plan's, for the gradients of the next backward
  std::uint64_t grad_keep_bytes_ = 0;  // device memory the next backward may keep gradients in
  std::uint64_t last_kept_bytes_ = 0;  // kept in the last backward (an engine loan, like slots)
  DType model_dtype_ = DType::none;
  std::size_t current_statics_ = 0;    // static residents of the last plan
  void* phantom_host_ = nullptr;       // the arrays' phantom range on a phantom device
  std::size_t phantom_bytes_ = 0;

  // Public calls hold api_mutex_ and count busy_ (a Busy): the lender (lend()) gives back only between calls.
  struct Busy;
  struct SaveGuard;
  void lend();
  [[nodiscard]] std::vector<bool> per_subgroup(const char* what, std::vector<bool> flags) const;
  EnginePlan plan_subset(Policy policy, double static_fraction, std::optional<double> k,
                         const std::vector<std::size_t>& index);
  mutable std::recursive_mutex api_mutex_;
  mutable int busy_ = 0;
  std::uint64_t lender_id_ = 0;

  double phase_h2d_bytes_ = 0;
  std::vector<bool> done_before_phase_;
  std::vector<bool> host_gradients_;
  std::unique_ptr<SpillTier> nvme_;  // the NVMe tier (null: none)
  std::shared_ptr<SaveTarget> save_;  // the running checkpoint save (null: none)
  // Its copy-on-write memory, kept for the next save (CopyBuffers says why).
  std::shared_ptr<CopyBuffers> save_buffers_ = std::make_shared<CopyBuffers>();
  void prepare_save(bool spill = true);
  void sync_residents();

  // The optimizer's step (step(const StepRequest&)).
  ParamLayout layout_;
  PolicyChoice policy_;
  std::optional<EnginePlan> plan_;
  bool sync_after_step_ = false;
  TrafficSource traffic_;
  double last_phase_[2] = {0, 0};  // the last update phase, host clock ns
  double last_own_[2] = {0, 0};    // its H2D and D2H busy time from the engine's own copies
  void observe_traffic(const StepReport& r);
};

}  // namespace memtide::tiering
