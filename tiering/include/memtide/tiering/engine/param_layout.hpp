#pragma once
/// @file
/// ParamLayout: where an optimizer's params lie in the engine's flat arrays, which param group
/// each belongs to, and how many steps each has taken. From it and a step's per-group
/// hyper-parameters the engine cuts the step into segments itself, so an optimizer front end
/// hands over a few numbers per step, not a list per param.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "memtide/tiering/engine/update_scheduler.hpp"

namespace memtide::tiering {

/// A range [start, end) of the flat arrays, inside subgroup `subgroup`, stepped with `params`.
struct Segment {
  std::size_t subgroup = 0;
  std::size_t start = 0;
  std::size_t end = 0;
  StepParams params;
  /// The model's param of these elements is fp16/bf16 (a front end that keeps its own copy of
  /// the model rounds these); the engine itself does not read it.
  bool low_precision = false;

  friend bool operator==(const Segment&, const Segment&) = default;
};

/// One param of the layout.
/// `n` params cut into subgroups of `size` elements (the last may be smaller), as [start, end)
/// ranges: the one rule for every front end (TieredAdamW, `memtide plan`). Throws InvalidArgument
/// for a size of 0, or for more than kMaxSubgroups, naming the smallest size that fits;
/// `size_name` is what the caller's user calls the size.
std::vector<std::pair<std::size_t, std::size_t>> cut_subgroups(std::size_t n, std::size_t size,
                                                               const char* size_name = "subgroup_size");

struct ParamSlot {
  std::size_t start = 0;  ///< [start, end) of the flat arrays
  std::size_t end = 0;
  std::size_t group = 0;  ///< its param group (index into a step's hyper-parameters)
  bool low_precision = false;
};

class ParamLayout {
 public:
  ParamLayout() = default;
  /// `params` in order, consecutive from 0, over `subgroups` ([start, end), consecutive, covering
  /// the same elements). Every param starts at step 0. Throws InvalidArgument naming the bad param.
  ParamLayout(std::vector<ParamSlot> params, const std::vector<std::pair<std::size_t, std::size_t>>& subgroups);

  [[nodiscard]] std::size_t size() const noexcept { return params_.size(); }
  [[nodiscard]] const std::vector<ParamSlot>& params() const noexcept { return params_; }
  /// Steps taken per param (float: what torch.optim keeps as a param's "step"; exact to 2^24).
  [[nodiscard]] float* steps() noexcept { return steps_.data(); }
  [[nodiscard]] const float* steps() const noexcept { return steps_.data(); }

  /// The segments of a step: within each subgroup, runs of params that have a gradient
  /// (`has_grad`, one flag per param) and share group, step count and precision, stepped with
  /// their group's hyper-parameters (`groups`, whose `step` is ignored) at their next step. Only
  /// subgroup `only` when given. Throws InvalidArgument on a size that does not match.
  [[nodiscard]] std::vector<Segment> segments(const std::vector<StepParams>& groups,
                                              const std::vector<std::uint8_t>& has_grad,
                                              std::optional<std::size_t> only = std::nullopt) const;
  /// The subgroups param `i` has elements in: [first, last) (empty for a param of no elements).
  [[nodiscard]] std::pair<std::size_t, std::size_t> subgroups_of(std::size_t i) const { return subgroups_of_.at(i); }
  /// Counts one more step for every param with a gradient.
  void advance(const std::vector<std::uint8_t>& has_grad);

 private:
  struct Piece {  // a param's part inside one subgroup
    std::size_t param, start, end;
  };
  std::vector<ParamSlot> params_;
  std::vector<std::vector<Piece>> pieces_;  // per subgroup
  std::vector<std::pair<std::size_t, std::size_t>> subgroups_of_;  // per param
  std::vector<float> steps_;
};

}  // namespace memtide::tiering
