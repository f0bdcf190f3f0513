#include "memtide/tiering/engine/backward_choice.hpp"

#include <algorithm>
#include <set>

namespace memtide::tiering {

BackwardChoice choose_backward_updates(const BackwardChoiceInput& in) {
  std::vector<std::size_t> candidates;
  const bool spills = std::find(in.on_nvme.begin(), in.on_nvme.end(), true) != in.on_nvme.end();
  for (std::size_t g = 0; g < in.placement.size() && !spills; ++g) {
    if (in.placement[g] != Placement::gpu_static) candidates.push_back(g);
  }
  std::vector<BackwardCandidate> ready;
  for (std::size_t g : candidates) {
    if (const auto it = in.ready_ns.find(g); it != in.ready_ns.end()) ready.push_back({g, it->second, 0});
  }
  BackwardChoice choice;
  choice.candidates = candidates.size();
  std::vector<std::size_t> chosen;
  if (!ready.empty() && in.ns_per_param && in.backward_end_ns) {
    double first_ready = ready.front().ready_ns;
    for (BackwardCandidate& c : ready) {
      const auto& [start, end] = in.subgroups[c.subgroup];
      c.work_ns = static_cast<double>(end - start) * *in.ns_per_param;
      first_ready = std::min(first_ready, c.ready_ns);
    }
    chosen = fit_before_end(std::move(ready), *in.backward_end_ns, in.max_subgroups);
    choice.rule = "time";
    choice.ns_per_param = *in.ns_per_param;
    choice.backward_tail_s = (*in.backward_end_ns - first_ready) * 1e-9;
  } else {
    const std::size_t from = candidates.size() > in.max_subgroups ? candidates.size() - in.max_subgroups : 0;
    chosen.assign(candidates.begin() + static_cast<std::ptrdiff_t>(from), candidates.end());
    choice.rule = "count";
  }
  std::sort(chosen.begin(), chosen.end());
  choice.subgroups = std::move(chosen);
  return choice;
}

}  // namespace memtide::tiering
