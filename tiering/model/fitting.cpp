// The fitting functions declared in perf_model.hpp, each the one place that decides what fits
// where: device memory into slots and residents, the host budget into the subgroups spilled to
// NVMe (and the staging they need), backward's time into the subgroups updated during it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

std::vector<std::size_t> fit_before_end(std::vector<BackwardCandidate> candidates, double end_ns, std::size_t cap) {
  std::sort(candidates.begin(), candidates.end(), [](const BackwardCandidate& a, const BackwardCandidate& b) {
    return a.ready_ns != b.ready_ns ? a.ready_ns < b.ready_ns : a.subgroup < b.subgroup;
  });
  std::vector<std::size_t> taken;
  double free = -INFINITY;  // when the worker is done with those taken so far
  for (const BackwardCandidate& c : candidates) {
    if (taken.size() == cap) break;
    const double finish = std::max(free, c.ready_ns) + c.work_ns;
    if (finish > end_ns) continue;
    free = finish;
    taken.push_back(c.subgroup);
  }
  return taken;
}

std::size_t nvme_staging_buffers(const std::vector<Placement>& placement, const std::vector<bool>& spilled,
                                 std::size_t slots, std::size_t read_ahead) {
  std::size_t streamed = 0;
  for (std::size_t i = 0; i < placement.size() && i < spilled.size(); ++i) {
    streamed += spilled[i] && placement[i] == Placement::gpu;
  }
  return std::max<std::size_t>(read_ahead, 1) + std::min(slots, streamed);
}

std::uint64_t gpu_slot_bytes(std::size_t largest, bool with_grad) {
  constexpr std::uint64_t kAlign = 512;  // the scheduler's device array alignment
  const std::uint64_t array = (static_cast<std::uint64_t>(largest) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
  return (with_grad ? 4 : 3) * array;
}

ResidentPacks resident_packs(std::size_t largest) {
  constexpr std::uint64_t kPackAtLeast = 256ULL << 20;
  constexpr std::uint64_t kSegmentRound = 2ULL << 20;  // a request over 10 MiB: its own segment, rounded so
  const std::uint64_t one = gpu_slot_bytes(largest, true);
  ResidentPacks p;
  if (one == 0) return p;
  p.slot_bytes = one;
  p.per_pack = static_cast<std::size_t>((kPackAtLeast + one - 1) / one);
  p.pack_bytes = (p.per_pack * one + kSegmentRound - 1) / kSegmentRound * kSegmentRound;
  return p;
}

void fit_gpu_budget(Workload& work, const GpuBudget& budget) {
  std::size_t largest = 0;
  for (std::size_t n : work.subgroup_params) largest = std::max(largest, n);
  const std::uint64_t n = work.subgroup_params.size();
  if (largest == 0) {
    work.gpu_slot_limit = work.gpu_static_limit = 0;
    return;
  }
  const std::uint64_t slot = gpu_slot_bytes(largest, work.grads_on_host);
  work.gpu_slot_limit = static_cast<std::size_t>(std::min(budget.update_bytes / slot, n));
  const std::uint64_t slots = std::min<std::uint64_t>(work.gpu_slot_limit, kUsefulSlots) * slot;
  const std::uint64_t left = budget.update_bytes > slots ? budget.update_bytes - slots : 0;
  // A resident keeps a gradient array whatever the gradient path (the scheduler allocates it).
  // Whole packs, then what the rest holds of a last, partial one (a block of its own size).
  const ResidentPacks packs = resident_packs(largest);
  const std::uint64_t room = std::min(left, budget.resident_bytes);
  const std::uint64_t partial = std::min<std::uint64_t>((room % packs.pack_bytes) / packs.slot_bytes, packs.per_pack - 1);
  work.gpu_static_limit = static_cast<std::size_t>(std::min(room / packs.pack_bytes * packs.per_pack + partial, n));
}

std::size_t fit_host_budget(Workload& work, std::uint64_t host_budget_bytes) {
  const std::size_t n = work.subgroup_params.size();
  work.on_nvme.clear();
  double total = 0, largest = 0;
  for (std::size_t p : work.subgroup_params) {
    total += 16.0 * static_cast<double>(p);
    largest = std::max(largest, static_cast<double>(p));
  }
  const auto budget = static_cast<double>(host_budget_bytes);
  if (total <= budget) return 0;
  const std::size_t candidates = n - std::min(work.gpu_static_limit, n);
  // Host memory with m subgroups spilled: their 12 B/param leave, staging for the read-ahead comes.
  const double staging = static_cast<double>(std::max<std::size_t>(work.nvme_read_ahead, 1)) * kStateBytesPerParam * largest;
  auto pick = [&](std::size_t m) {
    std::vector<bool> out(n, false);
    for (std::size_t k = 0; k < m; ++k) {
      out[static_cast<std::size_t>((static_cast<double>(k) + 0.5) * static_cast<double>(candidates) /
                                   static_cast<double>(m))] = true;
    }
    return out;
  };
  auto host_bytes = [&](const std::vector<bool>& on) {
    double moved = 0;
    for (std::size_t i = 0; i < n; ++i) moved += on[i] ? kStateBytesPerParam * static_cast<double>(work.subgroup_params[i]) : 0;
    return total - moved + staging;
  };
  if (candidates == 0 || host_bytes(pick(candidates)) > budget) {
    const double floor = candidates == 0 ? total : host_bytes(pick(candidates));
    throw InvalidArgument("host budget " + format_bytes(host_budget_bytes) + " is too small: the optimizer state (" +
                          format_bytes(static_cast<std::uint64_t>(total)) + ") needs at least " +
                          format_bytes(static_cast<std::uint64_t>(floor)) +
                          " of host memory even with every subgroup's params and moments on NVMe (gradients, "
                          "GPU residents and the read-ahead staging stay in host memory)");
  }
  // The fewest evenly spread subgroups that fit: the host bytes fall as m grows.
  std::size_t lo = 1, hi = candidates;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (host_bytes(pick(mid)) <= budget) hi = mid;
    else lo = mid + 1;
  }
  work.on_nvme = pick(lo);
  return lo;
}

}  // namespace memtide::tiering
