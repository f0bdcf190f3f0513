#pragma once
/// @file
/// BackwardUpdates: CPU updates during backward (STRONGHOLD 3-E). A subgroup whose gradients are
/// all in host memory is updated on a worker thread while backward goes on, instead of waiting
/// for the step. Speculative and exact: the update runs with what is known during backward (the
/// hyper-parameters, step count and gradient scale of that moment, no clipping) on copies it can
/// put back; the step takes it as done only where the sequential step would have used exactly
/// those inputs (docs/layer_window.md says which checks), and puts back and redoes the rest.
/// The model's params do not change before the step: their new values wait aside until
/// publish(). Used by TieredAdamW through the bindings; a front end tells it when a param's
/// gradient is in place and when backward starts and ends, since only it sees autograd.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "memtide/tiering/engine/backward_choice.hpp"
#include "memtide/tiering/engine/update_engine.hpp"

namespace memtide::tiering {

/// What the speculation has done so far.
struct BackwardStats {
  std::size_t speculated = 0, kept = 0, redone = 0, rolled_back = 0;
};

class BackwardUpdates {
 public:
  /// The bound an optimizer asks for by default over `subgroups` subgroups: a quarter of them (at
  /// least one), whose copies take a quarter of the state's 12 B/param at most.
  [[nodiscard]] static std::size_t default_max_subgroups(std::size_t subgroups) noexcept {
    return subgroups <= 4 ? 1 : (subgroups + 3) / 4;
  }

  /// Over `engine`'s layout and arrays (the engine must outlive it), at most `max_subgroups` (>= 1)
  /// per backward: each holds its copy until the step. Throws InvalidArgument for 0.
  BackwardUpdates(UpdateEngine& engine, std::size_t max_subgroups);
  /// Puts back whatever is still speculative and stops the worker.
  ~BackwardUpdates();
  BackwardUpdates(const BackwardUpdates&) = delete;
  BackwardUpdates& operator=(const BackwardUpdates&) = delete;

  /// The layout changed: `takes_part[i]` says whether param i's gradient arrives by the hook
  /// (a trainable leaf). Rolls back, forgets the timing (it named the old subgroups), chooses.
  void rebuild(std::vector<bool> takes_part);
  /// Where the model's low-precision params live when they are not the engine's model buffer:
  /// host memory of `dtype` (fp16 or bf16) for every element, written at publish() (null: the
  /// engine's buffer, or none).
  void set_model_copy(void* host, DType dtype) noexcept {
    model_copy_ = host;
    model_copy_dtype_ = dtype;
  }

  /// Chooses the subgroups the next backward updates (finish() and rebuild() do it themselves) by
  /// choose_backward_updates, over the engine's plan and this worker's timing, at most
  /// max_subgroups(). `ns_per_param`, when given, replaces the worker's measured
  /// cost per param first (a figure from elsewhere, or a what-if).
  void choose(std::optional<double> ns_per_param = std::nullopt);
  [[nodiscard]] std::size_t max_subgroups() const;
  /// Throws InvalidArgument for 0; takes effect at the next choice.
  void set_max_subgroups(std::size_t n);
  /// When each subgroup's gradients were complete in the last backward (steady clock ns).
  [[nodiscard]] std::map<std::size_t, double> ready_ns() const;

  /// Backward started (its first gradient): the timing of this backward begins.
  void backward_started();
  /// Backward ended: the time the next choice fits the updates into.
  void backward_ended();
  /// Param `i`'s gradient is in place. Returns the chosen subgroups it completed: the front end
  /// then starts each with submit() (it knows the step's inputs of this moment).
  std::vector<std::size_t> grad_ready(std::size_t i);
  /// Starts subgroup `g`'s update on the worker with `request` as it stands now (groups,
  /// has_grad, grad_scale; clip is taken as 1). Nothing when it has no segment.
  void submit(std::size_t g, const StepRequest& request);

  /// Waits for every update begun. When one failed, puts every one back and throws Error.
  void settle();
  /// Which settled subgroups the step `request` (its clip and grad_scale, with `stale[i]` for a
  /// param whose gradient changed after its hook) takes as done, per subgroup; puts the others
  /// back. `scaler`: a loss scaler decides, so a non-finite update is not kept.
  std::vector<bool> accept(const StepRequest& request, const std::vector<bool>& stale, bool scaler);
  /// Whether a kept update met a non-finite gradient.
  [[nodiscard]] bool nonfinite() const;
  /// The step stands: the kept updates' new params take their place.
  void publish();
  /// The step is over (kept updates stay; waits for any still running): the next backward starts
  /// afresh, the choice is made anew.
  void finish();
  /// Puts back every update begun since the last step, then finish().
  void rollback();
  /// Whether any update is speculative now.
  [[nodiscard]] bool pending() const;

  [[nodiscard]] BackwardStats stats() const;
  [[nodiscard]] BackwardChoice last_choice() const;
  [[nodiscard]] std::set<std::size_t> chosen() const;

 private:
  struct Piece {  // one segment's update: what to put back, or what to publish
    std::size_t start = 0, end = 0;
    std::vector<float> exp_avg, exp_avg_sq;  // the moments before (updated in place)
    std::vector<float> params;               // fp32 masters before, where updated in place
    std::vector<float> new_params;           // masters the model views: the new values, aside
    std::vector<std::uint16_t> new_lowp;     // the model's fp16/bf16 params: the new values, aside
  };
  struct Speculation {
    std::vector<Segment> segments;
    double grad_scale = 1;
    std::vector<Piece> pieces;
    bool nonfinite = false;
    bool finished = false;
    std::exception_ptr error;
  };

  void choose_locked();
  void reset_counts_locked();
  void restore(const Speculation& s);
  void run(Speculation& s);
  void worker_main();
  void settle_locked(std::unique_lock<std::mutex>& lock);
  void finish_locked();

  UpdateEngine& engine_;
  std::size_t max_;
  void* model_copy_ = nullptr;
  DType model_copy_dtype_ = DType::none;
  std::vector<std::vector<std::size_t>> subgroups_of_;  // per param
  std::vector<std::size_t> needed_, left_;              // per subgroup: params with a hook
  std::vector<bool> seen_;                              // per param, this backward
  std::map<std::size_t, Speculation> specs_;
  std::set<std::size_t> invalid_, chosen_;
  std::map<std::size_t, double> ready_ns_;
  std::optional<double> backward_end_ns_;
  std::optional<double> ns_per_param_;
  BackwardChoice choice_;
  BackwardStats stats_;

  mutable std::mutex mutex_;
  std::condition_variable work_, done_;
  std::deque<std::size_t> queue_;
  std::size_t running_ = 0;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace memtide::tiering
