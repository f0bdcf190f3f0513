#include "plan_budget.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

namespace memtide::tiering {

std::string count_words(std::size_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

EngineBudget plan_budget(CachingAllocator& allocator, const Workload& work, const EngineLoans& own) {
  EngineBudget b;
  std::size_t largest = 0;
  for (std::size_t n : work.subgroup_params) largest = std::max(largest, n);
  b.slot_bytes = gpu_slot_bytes(largest, true);

  // The engine's own loans were counted as used when the tracker saw them: add them back.
  const std::uint64_t own_residents = own.residents;
  const std::uint64_t margin = allocator.headroom_margin();
  // Memory outside this allocator (torch's own, when torch does not use memtide) shows only in
  // the device's free memory; this allocator's cached free blocks are free to it.
  const AllocatorStats stats = allocator.stats();
  const auto allocated_now = static_cast<std::uint64_t>(stats.allocated_bytes[0].current);
  const auto reserved_now = static_cast<std::uint64_t>(stats.reserved_bytes[0].current);
  const std::uint64_t free_now = std::min(sat_sub(allocator.limit(), allocated_now),
                                          allocator.device().mem_info().free + sat_sub(reserved_now, allocated_now)) +
                                 own_residents;

  // The remembered iterations and the running one (whose forward and backward have been seen
  // by the time its update phase plans).
  const PhaseReport report = allocator.phase_report();
  std::vector<const IterationRecord*> iterations;
  for (const IterationRecord& it : report.history) iterations.push_back(&it);
  iterations.push_back(&report.running);
  bool any_seen = false;
  for (const IterationRecord* itp : iterations) {
    const IterationRecord& it = *itp;
    for (int p = 0; p < kPhaseCount; ++p) {
      const PhaseWatermark& w = it.phases[p];
      // A phase entered but with no allocation observed keeps min_free at its "none yet" maximum.
      if (!w.seen || w.min_free == std::numeric_limits<std::uint64_t>::max()) continue;
      const bool update = p == static_cast<int>(Phase::update);
      const bool backward = p == static_cast<int>(Phase::backward);
      const std::uint64_t loans =
          own_residents + (update ? own.slots : 0) + (update || backward ? own.kept_grads : 0);
      const std::uint64_t free = w.min_free > std::numeric_limits<std::uint64_t>::max() - loans
                                     ? std::numeric_limits<std::uint64_t>::max()
                                     : w.min_free + loans;
      // Memory held across phases must also fit beside what the allocator reserved at the
      // phase's peak, not only beside the live bytes: the phase's large blocks need whole
      // segments, and memory cut into smaller cached blocks cannot hold them (the iteration
      // simulator ran out of memory in backward with residents sized to the live bytes).
      const std::uint64_t unreserved = std::min(free, sat_sub(allocator.limit(), w.peak_reserved) + loans);
      b.phase_min_free[p] = b.phase_seen[p] ? std::min(b.phase_min_free[p], free) : free;
      b.phase_min_unreserved[p] = b.phase_seen[p] ? std::min(b.phase_min_unreserved[p], unreserved) : unreserved;
      b.phase_seen[p] = true;
      any_seen = any_seen || p != static_cast<int>(Phase::other);
    }
  }
  if (!any_seen) {
    // No phase marks seen: only the present is known (residents may then not fit the next
    // forward; attaching the optimizer to the model gives the phase marks that fix this).
    b.budget.update_bytes = b.budget.resident_bytes = sat_sub(free_now, margin);
    b.source = "device free memory (no phase marks seen)";
    return b;
  }
  std::uint64_t update_cap = free_now;
  std::uint64_t iteration_cap = free_now;
  for (int p = 0; p < kPhaseCount; ++p) {
    if (!b.phase_seen[p]) continue;
    iteration_cap = std::min(iteration_cap, b.phase_min_unreserved[p]);
    // Slots live from the update phase until the next forward begins.
    if (p == static_cast<int>(Phase::update) || p == static_cast<int>(Phase::other)) {
      update_cap = std::min(update_cap, b.phase_min_free[p]);
    }
  }
  b.budget.update_bytes = sat_sub(update_cap, margin);
  b.budget.resident_bytes = sat_sub(iteration_cap, margin);
  b.source = "phase tracker (" + count_words(report.history.size(), "finished iteration") + " and the running one)";
  return b;
}

}  // namespace memtide::tiering
