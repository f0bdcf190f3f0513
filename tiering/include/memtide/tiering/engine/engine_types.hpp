#pragma once
/// @file
/// What crosses the UpdateEngine's interface: the policy it plans with, what an optimizer's step
/// asks of it, the plan it made (with the device memory it was made from) and what a step did.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memtide/allocator/phase_tracker.hpp"
#include "memtide/tiering/engine/update_scheduler.hpp"
#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

/// How the engine places subgroups when it plans a step itself (see PerfModel::plan).
struct PolicyChoice {
  Policy policy = Policy::automatic;
  double static_fraction = 0;
  std::optional<double> k;  ///< the stride of streamed GPU updates; none under auto: the model chooses
};

/// A gradient the step reads where it lies (a CPU tensor that backward made), so nothing copies it
/// into the engine's gradient array: elements [start, start + n) of the flat params.
struct GradSource {
  std::size_t start = 0;
  std::size_t n = 0;
  const void* data = nullptr;
  DType dtype = DType::fp32;  ///< fp32, fp16 or bf16 (the kernel upcasts as it reads)
};

/// What an optimizer's step asks of the engine once a ParamLayout is set (see set_layout).
struct StepRequest {
  std::vector<StepParams> groups;      ///< per param group: lr, betas, eps, weight decay (step is the engine's)
  std::vector<std::uint8_t> has_grad;  ///< per param: it has a gradient this step
  double grad_scale = 1.0;             ///< multiplies every gradient (1 / loss scale)
  double clip = 1.0;                   ///< the global clipping factor
  bool skip_if_nonfinite = false;      ///< a non-finite gradient leaves everything untouched
  std::optional<bool> path_verdict;    ///< finish_grads()'s verdict when every gradient came through it
  /// Per subgroup (empty: none): already updated for this step (during backward), left as it is.
  std::vector<bool> done;
  /// Gradients read where they lie (sorted by start, not overlapping); the gradient array holds
  /// the others. Only for a step whose every segment is updated on the CPU, and whose NaN/Inf
  /// verdict needs no scan (path_verdict given, or no skip_if_nonfinite): else InvalidArgument.
  std::vector<GradSource> grad_sources;
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
  std::vector<Placement> placement;  ///< as run (Placement::done for subgroups updated before it)
};

}  // namespace memtide::tiering
