#pragma once
/// @file
/// Which subgroups are updated on the host during backward (STRONGHOLD 3-E): the one rule, used
/// by BackwardUpdates in training and by the iteration simulator on its phantom device.

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

/// How the subgroups for the next backward were chosen.
struct BackwardChoice {
  std::string rule;                    ///< "count" until a backward and an update were timed, then "time"
  std::vector<std::size_t> subgroups;  ///< the chosen ones, ascending
  std::size_t candidates = 0;          ///< subgroups whose newest state is in host memory
  double ns_per_param = 0;             ///< the host's cost per param ("time" only)
  double backward_tail_s = 0;          ///< from the first ready subgroup to backward's end ("time" only)
};

/// What the choice reads: the plan, and what the last backward showed.
struct BackwardChoiceInput {
  const std::vector<Placement>& placement;                      ///< the plan's, per subgroup
  const std::vector<bool>& on_nvme;                             ///< per subgroup; empty: none spills
  const std::vector<std::pair<std::size_t, std::size_t>>& subgroups;  ///< [first, last) params
  const std::map<std::size_t, double>& ready_ns;  ///< when each subgroup's gradients were in host memory
  std::optional<double> ns_per_param;             ///< the host's update cost per param, once timed
  std::optional<double> backward_end_ns;          ///< when the last backward ended, on ready_ns' clock
  std::size_t max_subgroups = 0;                  ///< the most taken
};

/// Candidates are the subgroups whose newest state lives in host memory between steps: every one
/// the plan does not keep resident on the GPU, and none while any spills to NVMe (the spill tier
/// owns the host copies then). Once a backward and the host's cost were timed, those one host
/// worker finishes before backward ends (fit_before_end); until then the ones backward completes
/// first (the last: backward runs the layers in reverse). At most `max_subgroups`.
[[nodiscard]] BackwardChoice choose_backward_updates(const BackwardChoiceInput& in);

}  // namespace memtide::tiering
