#pragma once
/// @file
/// StepProtocol: what an optimizer's step decides, decided in one place. A front end (TieredAdamW)
/// tells it each gradient's arrival as backward makes it final and asks for one step; the protocol
/// takes the NaN/Inf verdict from the kernels' own flags (the gradient path's count, the copy's
/// flag, a scan only where neither ran), sums the squared gradient norms per param where each
/// gradient lies, reduces what must agree across ranks through a Collective the front end
/// provides, clips, skips or steps, accepts or puts back the updates made during backward
/// (BackwardUpdates), and reports what it did (StepOutcome). The arithmetic is the engine's.
///
/// What stays with the front end is what only the framework knows: which tensor is a param's
/// gradient now and whether it changed since it arrived (torch's version counters), and the
/// gradients no memtide kernel can read (odd layouts, another GPU), which it writes into the
/// engine's gradient array itself and reports with grad_written().

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "memtide/tiering/engine/engine_types.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering {

class BackwardUpdates;
class UpdateEngine;

/// What must agree across ranks, reduced over the front end's process groups. Empty functions:
/// one process (nothing to reduce). Every rank calls them in the same order, once per step at most.
struct Collective {
  /// `value` summed over the ranks that hold pieces of the sharded params (FSDP2's shard group).
  std::function<double(double value)> sum_sharded;
  /// Whether `flag` is true on any rank (every rank of the mesh, HSDP's replicas included).
  std::function<bool(bool flag)> any;
};

/// How the step treats gradients, fixed between layout changes.
struct ProtocolOptions {
  std::optional<double> max_grad_norm;  ///< clip the global norm to this (> 0); none: no clipping
  bool loss_scaler = false;             ///< a loss scaler decides: a non-finite gradient skips the step
  std::vector<bool> sharded;            ///< per param (empty: none): its squares sum over the shard group
  Collective collective;                ///< needed when any param is sharded
};

/// How a gradient reaches the engine (GradArrival::how).
enum class GradRoute : std::uint8_t {
  device_path,  ///< device memory: the engine's gradient path (upcast on the device, D2H, checked on the way)
  host_copy,    ///< host memory: copied (upcast) into the engine's gradient array now, checked in the same pass
  in_place,     ///< host memory: read where it lies by the step (the caller keeps it alive until the step ends)
};

/// One gradient handed to grad_ready(): `n` elements of `dtype` at `data`, param `param`'s whole range.
struct GradArrival {
  const void* data = nullptr;
  DType dtype = DType::fp32;
  std::size_t n = 0;
  GradRoute how = GradRoute::host_copy;
  Stream producer{};  ///< device_path: the stream that made it
  OutStores stores = OutStores::automatic;  ///< host_copy: how the array is written (automatic: by the engine's size)
};

/// What one step() did.
struct StepOutcome {
  bool any_gradient = false;  ///< some param had a gradient (else nothing ran and nothing was decided)
  bool nonfinite = false;     ///< a gradient was NaN or Inf (on any rank, where that was asked)
  bool skipped = false;       ///< nothing changed: a loss scaler's overflow, or a non-finite norm to clip by
  bool ran = false;           ///< the engine stepped
  std::optional<double> grad_norm;  ///< the global gradient norm (unscaled), when clipping
  double clip = 1.0;                ///< the factor every gradient was multiplied by
  std::size_t kept_from_backward = 0;  ///< subgroups whose update during backward the step took as done
  std::optional<bool> verdict;      ///< the kernels' NaN/Inf verdict on every gradient, when they gave one
  EngineStep engine;                ///< the engine's step (when ran)
};

class StepProtocol {
 public:
  /// Over `engine`'s layout (set before; the engine must outlive the protocol) with `options`;
  /// `backward`: the engine's updates during backward (null: none; it must outlive the protocol).
  /// Throws InvalidArgument for a bad option (naming it).
  StepProtocol(UpdateEngine& engine, ProtocolOptions options, BackwardUpdates* backward = nullptr);

  /// Param `param`'s gradient is final: sends it on its way (`g.how`) and records the verdict the
  /// kernel gave. `speculate`: the updates during backward may use it (the last micro-batch).
  /// Returns the subgroups of the updates during backward it completed: the front end starts each
  /// (BackwardUpdates::submit) with the step's inputs of this moment. Throws InvalidArgument for a
  /// param out of range, a size that is not the param's, or a bad dtype.
  std::vector<std::size_t> grad_ready(std::size_t param, const GradArrival& g, bool speculate = false);
  /// Param `param`'s gradient was written into the engine's gradient array by the front end
  /// (no verdict: the step scans it where one is needed).
  void grad_written(std::size_t param);

  /// Before the step: waits for the gradient path, forgets the arrivals of `stale` params (their
  /// gradient changed after it arrived; the front end sends them again) and, when there are any,
  /// brings gradients kept on the device to the host array first so that what is sent now wins.
  void collect(const std::vector<bool>& stale);

  /// The step: `request.groups`, `has_grad` and `grad_scale` (1 / loss scale, negative under
  /// maximize) as the front end has them; `clip`, `skip_if_nonfinite`, `path_verdict`, `done` and
  /// `grad_sources` are the protocol's to set and are ignored. `stale`: per param, sent again after
  /// its hook (an update during backward that used it is put back). Every arrival is forgotten after.
  StepOutcome step(const StepRequest& request, const std::vector<bool>& stale);

  /// Puts back every update made during backward (a checkpoint, a rebuild); the arrivals stay.
  void rollback();
  /// Forgets the arrivals: the next backward sends its own.
  void reset();

  [[nodiscard]] const ProtocolOptions& options() const noexcept { return options_; }
  /// What the next steps clip to (none: no clipping). Throws InvalidArgument unless finite and > 0.
  void set_max_grad_norm(std::optional<double> max_grad_norm);
  /// Whether a loss scaler decides from the next gradient on (a checkpoint may bring one).
  void set_loss_scaler(bool on) noexcept { options_.loss_scaler = on; }
  /// The arrivals the step reads where they lie now (GradRoute::in_place), by param.
  [[nodiscard]] std::size_t in_place_count() const noexcept;

 private:
  enum class Verdict : std::uint8_t { none, finite, nonfinite, from_path };
  struct Arrival {
    bool present = false;
    Verdict verdict = Verdict::none;
    const void* source = nullptr;  // in_place
    DType dtype = DType::fp32;
  };

  struct Located {  // one param's gradient where it lies now
    std::size_t param = 0;
    const void* data = nullptr;
    DType dtype = DType::fp32;
    std::size_t n = 0;
  };

  [[nodiscard]] std::optional<bool> verdict(const std::vector<std::uint8_t>& has_grad) const;
  /// Every gradient of the step where it lies: read in place, or the host array (kept device
  /// gradients brought there first).
  [[nodiscard]] std::vector<Located> locate(const std::vector<std::uint8_t>& has_grad) const;
  [[nodiscard]] std::pair<double, double> square_sums(const std::vector<std::uint8_t>& has_grad) const;
  [[nodiscard]] bool scan_finite(const std::vector<std::uint8_t>& has_grad) const;
  void materialize(const std::vector<std::uint8_t>& has_grad);
  [[nodiscard]] std::vector<GradSource> sources(const std::vector<std::uint8_t>& has_grad) const;

  UpdateEngine& engine_;
  ProtocolOptions options_;
  BackwardUpdates* backward_;
  std::vector<Arrival> arrivals_;  // per param
  bool path_finite_ = true;        // the gradient path's verdict at the last collect
};

}  // namespace memtide::tiering
