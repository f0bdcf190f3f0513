#pragma once
/// @file
/// UpdateEngine: the optimizer's tiering engine on one device. It owns the host state, plans
/// each update phase with the PerfModel from the device memory the phase tracker says is free,
/// runs the UpdateScheduler and feeds what it measured back into the Calibration.
///
/// The host state is four flat fp32 arrays (master params, exp_avg, exp_avg_sq, gradients) of
/// exact size in the device's HostArena (NUMA-bound, registered slabs), cut into subgroups by
/// the caller. A front end (TieredAdamW) reads and writes them directly; the engine only steps
/// them. Static residents stay on the device between steps and hold the newest state of their
/// subgroups: sync_host() copies it into the arrays before anyone reads them (a checkpoint, a
/// model whose params are views of the masters), so a step moves only the bytes its plan counts.
/// When the arrays change outside step() (a checkpoint load), host_changed() drops the residents'
/// device copies.
///
/// Device memory for a plan (GpuBudget): streamed slots may use what the update phase leaves
/// until the next forward; static residents stay through forward and backward, so they must fit
/// the lowest free memory of the whole iteration. Both leave out memory the engine itself holds
/// (its residents, and its slots in the update phase), so its own loans do not shrink the next
/// plan. Changing the resident set costs its copies; a plan that changes it must win by more
/// than that cost over `resident_hold_steps` steps (hysteresis).
///
/// The NVMe tier (EngineConfig::nvme with a host budget the state does not fit): the subgroups
/// fit_host_budget picks keep their params and moments (12 B/param) on NVMe, in a private spill
/// directory, and each step streams them through pinned staging (NvmeStaging). Their ranges of
/// the param, exp_avg and exp_avg_sq arrays hold no memory between steps (unregistered,
/// discarded pages that read as zeros): sync_host() reads them back for a reader (a checkpoint),
/// and host_changed() makes what is there the truth, written to NVMe before the next step.
/// Gradients stay in host memory.
///
/// Device memory the engine holds between steps (static residents, kept gradients) is lent, not
/// owned: when an allocation on its device would fail, the allocator asks for it back (the
/// residents' state goes to the host arrays, kept gradients too) unless an engine call is running.
///
/// Not thread-safe: one caller at a time (the Python binding serializes).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/model/calibration.hpp"
#include "memtide/tiering/engine/grad_sink.hpp"
#include "memtide/tiering/engine/param_layout.hpp"
#include "memtide/tiering/nvme/nvme_store.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/tiering/engine/update_scheduler.hpp"

namespace memtide::tiering {

/// How the engine places subgroups when it plans a step itself (see PerfModel::plan).
struct PolicyChoice {
  Policy policy = Policy::automatic;
  double static_fraction = 0;
  std::optional<double> k;  ///< the stride of streamed GPU updates; none under auto: the model chooses
};

/// What an optimizer's step asks of the engine once a ParamLayout is set (see set_layout).
struct StepRequest {
  std::vector<StepParams> groups;      ///< per param group: lr, betas, eps, weight decay (step is the engine's)
  std::vector<std::uint8_t> has_grad;  ///< per param: it has a gradient this step
  double grad_scale = 1.0;             ///< multiplies every gradient (1 / loss scale)
  double clip = 1.0;                   ///< the global clipping factor
  bool skip_if_nonfinite = false;      ///< a non-finite gradient leaves everything untouched
  std::optional<bool> path_verdict;    ///< finish_grads()'s verdict when every gradient came through it
  /// Per subgroup (empty: none): already updated for this step (during backward). The step
  /// counts them as stepped and leaves their state as it is.
  std::vector<bool> done;
};

/// The device memory a plan was made with and what it took.
struct EngineBudget {
  GpuBudget budget;                 ///< what the plan could use (engine's own loans included)
  std::string source;               ///< "phase tracker (N iterations)" or "device free memory"
  std::uint64_t slot_bytes = 0;     ///< one streamed slot / static resident
  std::uint64_t slots_taken = 0;    ///< bytes of the plan's streamed slots
  std::uint64_t residents_taken = 0;  ///< bytes of the plan's static residents
  /// Lowest free memory seen per phase over the remembered iterations (forward, backward,
  /// update, other; engine loans added back), 0 where a phase was not seen.
  std::uint64_t phase_min_free[kPhaseCount] = {};
  /// As phase_min_free, but beside the peak reserved bytes (cached blocks count as taken): what
  /// memory held across phases (residents, kept gradients) may use, since a phase's large blocks
  /// need whole segments.
  std::uint64_t phase_min_unreserved[kPhaseCount] = {};
  bool phase_seen[kPhaseCount] = {};
};

struct EnginePlan {
  Plan plan;
  EngineBudget budget;
  std::string reason;  ///< why the plan differs from what the policy asked for; empty if it does not
};

/// What one step did.
struct EngineStep {
  bool nonfinite = false;  ///< a gradient was NaN or Inf (after scale and clip)
  bool skipped = false;    ///< nonfinite with skip_if_nonfinite: nothing was changed
  std::size_t runs = 0;    ///< scheduler phases (one per distinct set of hyper-parameters)
  StepReport total;        ///< summed over the runs
  double predicted_ns = 0;
  /// The placement the step ran (Placement::done for subgroups updated before it).
  std::vector<Placement> placement;
};

/// The NVMe tier of an engine: used when the host state (16 B/param) does not fit
/// `host_budget_bytes` (0: no budget, nothing spilled).
struct NvmeTierConfig {
  std::filesystem::path dir;          ///< where the private spill directory is made
  std::uint64_t host_budget_bytes = 0;
  std::size_t read_ahead = 2;         ///< staging buffers beyond those GPU-bound subgroups hold
  NvmeConfig io = io_from_options();  ///< queue depth and request size (MEMTIDE_NVME_QUEUE_DEPTH, _BLOCK_SIZE)
  static NvmeConfig io_from_options();
  /// Rates to plan with until the tier's own transfers are measured (0: measured at setup from
  /// the first spill; required on a phantom device, which only times them).
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
};

/// What the NVMe tier holds.
struct NvmeTierInfo {
  std::size_t spilled = 0;               ///< subgroups on NVMe
  std::uint64_t spilled_params = 0;
  std::filesystem::path file;            ///< the spill file (empty on a phantom device)
  std::uint64_t file_bytes = 0;
  std::uint64_t staging_bytes = 0;       ///< pinned staging buffers
  double read_bytes_per_s = 0;           ///< planned with (measured once transfers ran)
  double write_bytes_per_s = 0;
  std::vector<std::size_t> held;         ///< subgroups whose state only host memory holds (a failed write)
  NvmeUse last;                          ///< the last step's transfers
};

struct EngineConfig {
  std::size_t low_precision_bytes = 2;  ///< the model's copy: 2 (fp16/bf16) or 4 (fp32)
  /// Steps over which a change of the resident set must pay for its copies.
  std::size_t resident_hold_steps = 20;
  CalibrationConfig calibration = CalibrationConfig::from_options();
  Rates defaults{};  ///< rates before anything is measured
  NvmeTierConfig nvme{};
};

class UpdateEngine {
 public:
  /// Host state for `n` params from `arena` (zeroed), cut into `subgroups` ([start, end),
  /// consecutive, covering [0, n)). `pool`: the CPU step's threads (null: the caller only).
  /// On a device that stores no data (a phantom SimDevice) the arrays are phantom addresses,
  /// never dereferenced, and the engine only times its work (the iteration simulator).
  /// Throws InvalidArgument naming the bad subgroup or value.
  UpdateEngine(CachingAllocator& allocator, HostArena& arena, std::size_t n,
               std::vector<std::pair<std::size_t, std::size_t>> subgroups, ThreadPool* pool, EngineConfig config = {});
  /// Drops device copies, gives the host arrays back to the arena.
  ~UpdateEngine();
  UpdateEngine(const UpdateEngine&) = delete;
  UpdateEngine& operator=(const UpdateEngine&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return n_; }
  [[nodiscard]] float* param() const noexcept { return arrays_[0]; }
  [[nodiscard]] float* exp_avg() const noexcept { return arrays_[1]; }
  [[nodiscard]] float* exp_avg_sq() const noexcept { return arrays_[2]; }
  [[nodiscard]] float* grad() const noexcept { return arrays_[3]; }
  [[nodiscard]] const std::vector<std::pair<std::size_t, std::size_t>>& subgroups() const noexcept {
    return subgroups_;
  }
  [[nodiscard]] Device& device() noexcept { return device_; }
  /// Pinned host bytes the arrays take in the arena (what was asked for, rounded to its alignment).
  [[nodiscard]] std::uint64_t host_bytes() const;

  // ---- the step an optimizer asks for ---------------------------------------------------------
  /// Where the optimizer's params lie (their step counts start from the layout's). Drops the
  /// current plan. Throws InvalidArgument when it does not cover the engine's elements.
  void set_layout(ParamLayout layout);
  [[nodiscard]] ParamLayout& layout() noexcept { return layout_; }
  /// The policy step(const StepRequest&) plans with; drops the current plan.
  void set_policy(PolicyChoice choice);
  [[nodiscard]] const PolicyChoice& policy() const noexcept { return policy_; }
  /// The plan the next step(const StepRequest&) runs: made under the policy when there is none,
  /// and before every step under auto without a stride (memory and rates move).
  const EnginePlan& current_plan();
  /// Copy the newest state of static residents into the host arrays after every step (a front
  /// end that reads them between steps: params that are views of the fp32 masters).
  void set_sync_after_step(bool on) noexcept { sync_after_step_ = on; }
  /// The optimizer's step: cuts it into segments from the layout, plans it under the policy,
  /// runs it (as step() below, subgroups in `request.done` left as they are), feeds the
  /// Calibration with the plan's own prediction, and counts a step for every param with a
  /// gradient unless it was skipped.
  EngineStep step(const StepRequest& request);
  /// The segments step(request) would run; only subgroup `only` when given.
  [[nodiscard]] std::vector<Segment> segments(const StepRequest& request,
                                              std::optional<std::size_t> only = std::nullopt) const {
    return layout_.segments(request.groups, request.has_grad, only);
  }

  // ---- the engine's parts, for callers that plan themselves -----------------------------------
  /// The plan for the next step under `policy` (see PerfModel::plan for `static_fraction` and
  /// the stride `k`), sized to the device memory available now (see the file comment).
  EnginePlan plan(Policy policy, double static_fraction = 0, std::optional<double> k = std::nullopt);

  /// Steps `segments` (each inside its subgroup; any order) under `placement` (one entry per
  /// subgroup) with `gpu_slots` streamed slots. The gradients are checked first (grad_scale and
  /// clip applied): a non-finite one sets `nonfinite`, and with `skip_if_nonfinite` nothing is
  /// stepped. `path_verdict` is the verdict of the gradient path (finish_grads) when every
  /// gradient came through it: then the host arrays are not scanned again, unless grad_scale *
  /// clip > 1 could overflow a finite gradient. Segments sharing hyper-parameters run in one
  /// scheduler phase. Measurements feed the Calibration; `predicted_ns` > 0 is compared with the
  /// measured phase.
  EngineStep step(const std::vector<Placement>& placement, std::size_t gpu_slots, const std::vector<Segment>& segments,
                  double grad_scale, double clip, bool l2, bool skip_if_nonfinite, double predicted_ns = 0,
                  std::optional<bool> path_verdict = std::nullopt);

  /// The gradient path of backward: gradients [offset, offset + n) of the flattened params, at
  /// `source` in device memory (fp16, bf16 or fp32), are final on `producer` (the stream backward runs on).
  /// They are upcast on the device and copied D2H into the host gradient array on the engine's
  /// own streams while backward goes on, checked for NaN/Inf on the way (GradSink). `producer`
  /// then waits until the source has been read, so backward may overwrite it (accumulation).
  /// A later push of the same range overwrites it: pushing the accumulated gradient after every
  /// micro-batch leaves the last, complete one.
  void push_grad(std::size_t offset, const void* source, DType dtype, std::size_t n, Stream producer);
  /// Waits until every pushed gradient is in place; whether all were finite (true when nothing
  /// was pushed since the last call). Subgroups the last plan put on the GPU keep their fp32
  /// gradient in device memory, as far as the memory backward and the update phase leave allows
  /// (the step reads it there: no 4 B/param there and back); the rest are in the host array.
  bool finish_grads();
  /// Waits until every gradient pushed so far that goes to host memory is there (the kept ones
  /// aside), without ending the pass as finish_grads() does: for an update of a subgroup whose
  /// gradients are complete while backward goes on. Safe from another thread than the one that
  /// pushes: the engine is locked only to mark the point, not while waiting.
  void wait_grads_pushed();
  /// Moves gradients kept on the device into the host array (before the host copy is edited).
  void grads_to_host();
  /// Bytes of fp32 gradients kept in device memory now.
  [[nodiscard]] std::uint64_t kept_grad_bytes() const noexcept { return sink_ ? sink_->kept_bytes() : 0; }
  /// Bytes the gradient path has copied to the host since it was made.
  [[nodiscard]] double grad_bytes_to_host() const noexcept { return sink_ ? sink_->bytes_to_host() : 0; }

  /// The model's low-precision params (fp16 or bf16) for all n elements, in device memory the
  /// engine allocates on first call (the same buffer after): from then on every step writes them
  /// inside the update phase, the GPU-updated subgroups on the device and the CPU-updated ones
  /// through pinned staging and an upload, as the PerfModel counts them. The front end makes the
  /// model's params views of it. Throws InvalidArgument for another dtype, or a second dtype.
  void* model_params(DType dtype);
  [[nodiscard]] DType model_dtype() const noexcept { return model_dtype_; }
  /// The CPU step's threads (null: the caller only).
  [[nodiscard]] ThreadPool* pool() const noexcept { return pool_; }

  /// The host arrays were changed outside step(): device copies of residents are stale.
  void host_changed();
  /// Copies the newest state of static residents into the host arrays (they stay resident).
  void sync_host();

  [[nodiscard]] Rates rates() const { return calibration_.rates(); }
  [[nodiscard]] PredictionErrors prediction_errors() const { return calibration_.error_summary(); }
  /// A whole iteration was predicted to take `predicted_ns` (PerfModel::predict_iteration) and
  /// took `measured_ns`: remembered beside the update phase's errors. Returns the error.
  double observe_iteration(double predicted_ns, double measured_ns) {
    return calibration_.observe_iteration(predicted_ns, measured_ns);
  }
  [[nodiscard]] PredictionErrors iteration_errors() const { return calibration_.iteration_error_summary(); }
  /// What CUPTI saw on the PCIe links during the last update phase (see Calibration::observe_pcie):
  /// the next plans count only on what others leave.
  void observe_pcie(const PcieObservation& o) { calibration_.observe_pcie(o); }
  /// What the PCIe links did in [from_ns, to_ns) of the host clock; nullopt when nobody watches.
  using TrafficSource = std::function<std::optional<LinkTraffic>(double from_ns, double to_ns)>;
  /// After each step(const StepRequest&) on a device with the host's clock, the engine asks
  /// `source` what the links did during its previous update phase and observes it (observe_pcie)
  /// beside its own copies. Null: nothing is asked.
  void set_traffic_source(TrafficSource source) { traffic_ = std::move(source); }
  /// Bytes others copy host -> device at the start of each update phase (the layer window's
  /// first blocks of the next forward): the plans count them on the H2D link
  /// (Workload::phase_h2d_bytes). Throws InvalidArgument for a negative or non-finite value.
  void set_phase_h2d_bytes(double bytes);
  /// Subgroups updated before the coming update phase (on the CPU during backward; empty: none).
  /// plan() leaves them out of the workload and marks them Placement::done, so the rest is
  /// planned on its own. Throws InvalidArgument when the size is not the number of subgroups.
  void set_done_before_phase(std::vector<bool> done);
  /// Subgroups whose gradients the next backward sends to host memory whatever the plan says
  /// (empty: as the plan says): those to be updated on the CPU during that backward.
  void set_host_gradients(std::vector<bool> host);
  [[nodiscard]] std::pair<double, double> foreign_pcie_share() const { return calibration_.foreign_pcie_share(); }
  /// Bytes of device memory the engine holds between steps (static residents, small buffers).
  [[nodiscard]] std::uint64_t resident_bytes() const;

  /// Per subgroup: its params and moments live on NVMe (empty: no NVMe tier).
  [[nodiscard]] const std::vector<bool>& on_nvme() const noexcept { return on_nvme_; }
  [[nodiscard]] NvmeTierInfo nvme_info() const;
  /// Writes spilled subgroups wholly below element `up_to` whose host range is the truth (after
  /// host_changed, or never written) to NVMe and drops their host pages: a caller filling the
  /// arrays in order keeps at most a subgroup of them in memory. step() does it for the rest.
  void spill_host(std::size_t up_to);
  /// Reads every spilled subgroup through the staging pipeline and writes it back unchanged, in
  /// update order, with no update between: the tier's I/O time for one step alone (benchmarks
  /// set a phase against it). Returns the host clock's ns (0 without a tier).
  double nvme_round_trip();
  /// For tests: the NVMe tier's next transfers fail as `faults` says (no tier: ignored).
  void inject_nvme_faults(const NvmeFaults& faults);

 private:
  struct Entry {  // a scheduler over exactly `ranges` of the flat arrays
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    std::unique_ptr<OptimizerState> state;
    std::unique_ptr<UpdateScheduler> scheduler;
  };

  UpdateScheduler& scheduler_for(const std::vector<std::pair<std::size_t, std::size_t>>& ranges);
  /// Moves an entry's residents back into the host arrays and frees them.
  void retire(Entry& e);
  /// The `j`th subgroup of a cached scheduler's state.
  Subgroup& scheduler_state(UpdateScheduler& scheduler, std::size_t j);
  EngineBudget measure_budget(const Workload& work) const;
  void observe(const StepReport& r, double predicted_ns);
  void observe_iteration_of_this_step(double update_predicted_ns, double update_measured_ns);

  CachingAllocator& allocator_;
  Device& device_;
  HostArena& arena_;
  ThreadPool* pool_;
  EngineConfig config_;
  std::size_t n_;
  std::vector<std::pair<std::size_t, std::size_t>> subgroups_;
  float* arrays_[4] = {};
  PerfModel model_;
  Calibration calibration_;
  std::list<Entry> cache_;  // most recently used first
  std::uint64_t last_slot_bytes_ = 0;  // slots the last phase took
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

  // The allocator's lender (see lend()): the engine's public calls hold api_mutex_ (recursive:
  // they call each other) and count busy_, so the lender gives back only when no call is running.
  struct Busy {
    explicit Busy(UpdateEngine& e) : engine(e) {
      engine.api_mutex_.lock();
      ++engine.busy_;
    }
    ~Busy() {
      --engine.busy_;
      engine.api_mutex_.unlock();
    }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;
    UpdateEngine& engine;
  };
  void lend();
  [[nodiscard]] std::vector<bool> per_subgroup(const char* what, std::vector<bool> flags) const;
  EnginePlan plan_subset(Policy policy, double static_fraction, std::optional<double> k,
                         const std::vector<std::size_t>& index);
  std::recursive_mutex api_mutex_;
  int busy_ = 0;
  std::uint64_t lender_id_ = 0;

  // The NVMe tier.
  struct NvmeTier;
  void setup_nvme();
  void drop_spilled_pages(std::size_t subgroup);
  /// Reads spilled subgroup `g` from NVMe (or its held buffer) into its host range.
  void load_spilled(std::size_t g);
  /// Spilled subgroups resident on the device in entry `e`.
  std::vector<std::size_t> spilled_residents(Entry& e) const;
  /// Before a run: spilled residents leaving residency go back to their host range and NVMe,
  /// entering ones are read into theirs. Returns those that left.
  std::vector<std::size_t> move_spilled_residents(UpdateScheduler& s, const std::vector<Segment>& list,
                                                  const std::vector<Placement>& placement);
  [[nodiscard]] std::size_t subgroup_of(std::size_t element) const;
  std::vector<bool> on_nvme_;
  double phase_h2d_bytes_ = 0;
  std::vector<bool> done_before_phase_;
  std::vector<bool> host_gradients_;
  std::unique_ptr<NvmeTier> nvme_;

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
