#include "memtide/tiering/nvme/spill_tier.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"
#include "memtide/core/os.hpp"
#include "memtide/tiering/host/pinned_buffer.hpp"

namespace memtide::tiering {
namespace {

std::size_t page_round_up(std::size_t n) { return (n + os::page_bytes() - 1) / os::page_bytes() * os::page_bytes(); }
std::size_t page_round_down(std::size_t n) { return n / os::page_bytes() * os::page_bytes(); }

}  // namespace

NvmeConfig NvmeTierConfig::io_from_options() {
  NvmeConfig c;
  c.queue_depth = static_cast<std::size_t>(options().nvme_queue_depth);
  c.block_bytes = static_cast<std::size_t>(options().nvme_block_size);
  return c;
}

SpillTier::SpillTier(Device& device, std::size_t n, const Ranges& subgroups, std::recursive_mutex& guard)
    : device_(device), n_(n), subgroups_(subgroups), guard_(guard) {}

SpillTier::~SpillTier() {
  staging_.reset();
  store_.reset();
  dir_.reset();
  for (std::size_t k = 0; k < 3; ++k) {
    if (maps_[k] == nullptr) continue;
    for (std::size_t r = 0; k < registered_maps_ && r < registered_.size(); ++r) {
      try {
        device_.host_unregister(reinterpret_cast<unsigned char*>(maps_[k]) + registered_[r].first);
      } catch (const Error& e) {
        MEMTIDE_LOG(warn, std::string("UpdateEngine: ") + e.what());
      }
    }
    os::unmap(maps_[k], map_bytes_);
  }
}

std::unique_ptr<SpillTier> SpillTier::make(Device& device, HostArena& arena, std::size_t n, const Ranges& subgroups,
                                           const NvmeTierConfig& c, const Rates& defaults,
                                           std::recursive_mutex& guard) {
  if (c.host_budget_bytes == 0) return nullptr;
  if (c.read_ahead == 0) throw InvalidArgument("UpdateEngine: nvme read_ahead = 0; at least 1 is needed");
  Workload w;
  for (auto [s, e] : subgroups) w.subgroup_params.push_back(e - s);
  w.nvme_read_ahead = c.read_ahead;
  const std::size_t spilled = fit_host_budget(w, c.host_budget_bytes);  // throws, naming the budget
  if (spilled == 0) {
    MEMTIDE_LOG(info, "UpdateEngine: the optimizer state (" + format_bytes(16 * static_cast<std::uint64_t>(n)) +
                          ") fits the host budget of " + format_bytes(c.host_budget_bytes) + ": nothing goes to NVMe");
    return nullptr;
  }
  std::unique_ptr<SpillTier> tier(new SpillTier(device, n, subgroups, guard));
  tier->read_ahead_ = c.read_ahead;
  tier->read_rate_ = c.read_bytes_per_s > 0 ? c.read_bytes_per_s : defaults.nvme_read_bytes_per_s;
  tier->write_rate_ = c.write_bytes_per_s > 0 ? c.write_bytes_per_s : defaults.nvme_write_bytes_per_s;
  const std::size_t n_sub = subgroups.size();
  tier->host_truth_.assign(n_sub, 0);
  tier->materialized_.assign(n_sub, 0);
  std::uint64_t spilled_params = 0;
  for (std::size_t i = 0; i < n_sub; ++i) spilled_params += w.on_nvme[i] ? w.subgroup_params[i] : 0;

  if (is_phantom(device)) {
    if (!(tier->read_rate_ > 0) || !(tier->write_rate_ > 0)) {
      throw InvalidArgument("UpdateEngine: a simulated NVMe tier needs its read and write rates (nvme read_bytes_per_s "
                            "and write_bytes_per_s)");
    }
    tier->staging_ = std::make_unique<NvmeStaging>(device, nullptr, w.subgroup_params, w.on_nvme, c.read_ahead, nullptr,
                                                   tier->read_rate_, tier->write_rate_);
  } else {
#if MEMTIDE_HAVE_NVME
    if (c.dir.empty()) {
      throw InvalidArgument("UpdateEngine: the optimizer state (" + format_bytes(16 * static_cast<std::uint64_t>(n)) +
                            ") does not fit the host budget of " + format_bytes(c.host_budget_bytes) + ": " +
                            std::to_string(spilled) + " subgroups must go to NVMe, and no NVMe directory was given");
    }
    for (const StaleSpill& st : SpillDir::find_stale(c.dir)) {
      MEMTIDE_LOG(warn, "UpdateEngine: " + st.path.string() + " (" + format_bytes(st.bytes) + ", " +
                            std::to_string(static_cast<long long>(st.age_s)) +
                            " s old) was left by a process that did not exit cleanly; remove it to get the space back");
    }
    tier->dir_ = std::make_unique<SpillDir>(c.dir);
    std::vector<std::uint64_t> extents;
    std::vector<std::size_t> names;  // errors name the engine's subgroup, not the extent
    for (std::size_t i = 0; i < n_sub; ++i) {
      if (!w.on_nvme[i]) continue;
      extents.push_back(3 * sizeof(float) * static_cast<std::uint64_t>(w.subgroup_params[i]));
      names.push_back(i);
    }
    tier->store_ = std::make_unique<NvmeStore>(*tier->dir_, extents, c.io, names);  // reserves the space now
    tier->staging_ = std::make_unique<NvmeStaging>(device, tier->store_.get(), w.subgroup_params, w.on_nvme,
                                                   c.read_ahead, &arena);  // pinned slabs on the GPU's node
    // The arrays: address space for all n, memory only where the state stays in host memory.
    // Those ranges are registered (pinned) for the device's copies, each run rounded out to
    // whole pages; spilled ranges are never registered, so their pages can be dropped.
    tier->map_bytes_ = page_round_up(n * sizeof(float));
    for (float*& base : tier->maps_) {
      int err = 0;
      base = static_cast<float*>(os::map(tier->map_bytes_, os::page_bytes(), /*noreserve=*/true, err));
      if (base == nullptr) {
        throw OutOfMemory("UpdateEngine: could not map " + format_bytes(tier->map_bytes_) +
                          " of address space for the optimizer state: " + std::strerror(err));
      }
    }
    for (std::size_t i = 0; i < n_sub;) {
      if (w.on_nvme[i]) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < n_sub && !w.on_nvme[j]) ++j;
      const std::size_t lo = page_round_down(subgroups[i].first * sizeof(float));
      const std::size_t hi = std::min(page_round_up(subgroups[j - 1].second * sizeof(float)), tier->map_bytes_);
      if (!tier->registered_.empty() && tier->registered_.back().second >= lo) {
        tier->registered_.back().second = hi;  // a page shared with the previous run: one range
      } else {
        tier->registered_.emplace_back(lo, hi);
      }
      i = j;
    }
    for (float* base : tier->maps_) {
      std::size_t done = 0;
      try {
        for (; done < tier->registered_.size(); ++done) {
          auto [lo, hi] = tier->registered_[done];
          device.host_register(reinterpret_cast<unsigned char*>(base) + lo, hi - lo);
        }
      } catch (...) {
        // This map's ranges so far; the tier's destructor does the maps before it, and unmaps all.
        for (std::size_t k = 0; k < done; ++k) {
          device.host_unregister(reinterpret_cast<unsigned char*>(base) + tier->registered_[k].first);
        }
        throw;
      }
      ++tier->registered_maps_;
    }
    // The state starts as zeros in host memory: written to NVMe by spill or the first step.
    for (std::size_t i = 0; i < n_sub; ++i) tier->host_truth_[i] = tier->materialized_[i] = w.on_nvme[i] ? 1 : 0;
#else
    (void)arena;
    throw Error("UpdateEngine: the optimizer state does not fit the host budget of " + format_bytes(c.host_budget_bytes) +
                ", and memtide was built without the NVMe tier (it needs liburing-dev and libxxhash-dev)");
#endif
  }
  MEMTIDE_LOG(info, "UpdateEngine: " + std::to_string(spilled) + " of " + std::to_string(n_sub) + " subgroups (" +
                        format_bytes(12 * spilled_params) + " of params and moments) live on NVMe" +
                        (tier->store_ ? " in " + tier->store_->file().string() : std::string(" (simulated)")) +
                        " to keep the host state within " + format_bytes(c.host_budget_bytes));
  tier->on_nvme_ = std::move(w.on_nvme);
  return tier;
}

std::uint64_t SpillTier::host_bytes() const {
  std::uint64_t total = 0;
  for (auto [lo, hi] : registered_) total += 3 * (hi - lo);
  return total + staging_->staging_bytes();
}

NvmeTierInfo SpillTier::info() const {
  NvmeTierInfo info;
  for (std::size_t i = 0; i < on_nvme_.size(); ++i) {
    if (!on_nvme_[i]) continue;
    ++info.spilled;
    info.spilled_params += subgroups_[i].second - subgroups_[i].first;
  }
  if (store_) {
    info.file = store_->file();
    info.file_bytes = store_->file_bytes();
  }
  info.staging_bytes = staging_->staging_bytes();
  info.read_bytes_per_s = read_rate_;
  info.write_bytes_per_s = write_rate_;
  info.held = staging_->held();
  info.last = last_;
  return info;
}

void SpillTier::drop_pages(std::size_t i) {
  const std::size_t lo = page_round_up(subgroups_[i].first * sizeof(float));
  const std::size_t hi = page_round_down(subgroups_[i].second * sizeof(float));
  if (hi <= lo) return;  // a subgroup smaller than two pages keeps what it shares
  for (float* base : maps_) {
    if (const int err = os::discard(reinterpret_cast<unsigned char*>(base) + lo, hi - lo); err != 0) {
      MEMTIDE_LOG(warn, "UpdateEngine: could not drop the host pages of spilled subgroup " + std::to_string(i) + ": " +
                            std::strerror(err));
    }
  }
}

void SpillTier::spill(std::size_t up_to) {
  if (store_ == nullptr) return;
  for (std::size_t i = 0; i < subgroups_.size() && subgroups_[i].second <= up_to; ++i) {
    if (!on_nvme_[i]) continue;
    const std::size_t s = subgroups_[i].first;
    if (host_truth_[i]) {
      // Verified on NVMe before the host copy goes: a failed write keeps it (and throws).
      staging_->store(i, maps_[0] + s, maps_[1] + s, maps_[2] + s);
      host_truth_[i] = 0;
    }
    if (materialized_[i]) {
      drop_pages(i);
      materialized_[i] = 0;
    }
  }
  // Until a step measures the drive, the first spill tells its write rate.
  if (!write_measured_) {
    const NvmeStore::Counters c = store_->counters();
    if (c.bytes_written > 0 && c.write_s > 0) write_rate_ = static_cast<double>(c.bytes_written) / c.write_s;
  }
}

void SpillTier::plan_with(Workload& w, Rates& rates, const std::vector<std::size_t>& index) const {
  for (std::size_t g : index) w.on_nvme.push_back(on_nvme_[g]);
  w.nvme_read_ahead = read_ahead_;
  // A spilled subgroup may be a static resident: its state comes from NVMe once, stays on the
  // GPU, and goes back when it leaves (see move_residents): no NVMe I/O per step.
  // Until the tier's transfers are measured: a conservative 1 GB/s, corrected after one step.
  constexpr double kUnmeasured = 1e9;
  rates.nvme_read_bytes_per_s = read_rate_ > 0 ? read_rate_ : kUnmeasured;
  rates.nvme_write_bytes_per_s = write_rate_ > 0 ? write_rate_ : kUnmeasured;
}

void SpillTier::route(SpillRoutes& state, const Ranges& ranges) const {
  // A range of a spilled subgroup is stepped from its staging buffer, at its offset in it.
  for (std::size_t j = 0; j < ranges.size(); ++j) {
    const std::size_t g = subgroup_of(ranges[j].first);
    if (!on_nvme_[g]) continue;
    state.stage_from(j, g, ranges[j].first - subgroups_[g].first);
  }
}

void SpillTier::attach(SpillResidents& scheduler) const { scheduler.set_nvme(staging_.get(), read_ahead_); }

void SpillTier::before_step() {
  spill(n_);
  // A SimDevice times the transfers on its virtual clock at the rates the plan counts on.
  if (store_) staging_->set_rates(read_rate_, write_rate_);
}

void SpillTier::after_step(const NvmeUse& use) {
  last_ = use;
  auto learn = [](double& rate, bool& measured, double bytes, double busy_ns) {
    if (bytes <= 0 || busy_ns <= 0) return;
    const double seen = bytes / busy_ns * 1e9;
    rate = measured ? 0.7 * rate + 0.3 * seen : seen;
    measured = true;
  };
  if (store_) {  // measured; a phantom device's rates are the stated ones
    learn(read_rate_, read_measured_, use.read_bytes, use.read_busy_ns);
    learn(write_rate_, write_measured_, use.write_bytes, use.write_busy_ns);
  }
}

std::vector<std::size_t> SpillTier::move_residents(SpillResidents& s, const std::vector<std::size_t>& list,
                                                   const std::vector<Placement>& placement) {
  std::vector<std::size_t> left;
  if (store_ == nullptr) return left;
  // Leaving first: the device holds the newest state; it goes to the host range and on to NVMe
  // before this phase reads the subgroup from there.
  for (std::size_t j = 0; j < list.size(); ++j) {
    const std::size_t g = list[j];
    if (!on_nvme_[g] || placement[j] == Placement::gpu_static || !s.is_resident(j)) continue;
    s.sync_to_host(j);
    materialized_[g] = host_truth_[g] = 1;
    left.push_back(g);
  }
  if (!left.empty()) spill(n_);
  // Entering: the scheduler moves a new resident's state to the device from its host range.
  for (std::size_t j = 0; j < list.size(); ++j) {
    const std::size_t g = list[j];
    if (on_nvme_[g] && placement[j] == Placement::gpu_static && !s.is_resident(j) && !materialized_[g]) load(g);
  }
  return left;
}

std::vector<std::size_t> SpillTier::residents(const Ranges& ranges, const SpillResidents& scheduler) const {
  std::vector<std::size_t> out;
  for (std::size_t j = 0; j < ranges.size(); ++j) {
    const std::size_t g = subgroup_of(ranges[j].first);
    if (on_nvme_[g] && scheduler.is_resident(j)) out.push_back(g);
  }
  return out;
}

bool SpillTier::copied_to_host(const std::vector<std::size_t>& subgroups) {
  for (std::size_t g : subgroups) materialized_[g] = host_truth_[g] = 1;
  return !subgroups.empty();
}

void SpillTier::keep_unfilled_residents(const Ranges& ranges, SpillResidents& scheduler) {
  for (std::size_t j = 0; j < ranges.size(); ++j) {
    const std::size_t g = subgroup_of(ranges[j].first);
    if (!on_nvme_[g] || !scheduler.is_resident(j) || materialized_[g]) continue;
    scheduler.sync_to_host(j);
    materialized_[g] = 1;
  }
}

void SpillTier::host_changed() {
  // What sync_host brought back is what the caller may have changed: it is the truth now.
  for (std::size_t i = 0; i < on_nvme_.size(); ++i) {
    if (on_nvme_[i] && materialized_[i]) host_truth_[i] = 1;
  }
}

void SpillTier::synced(const Ranges& ranges, const SpillResidents& scheduler) {
  // Their host ranges now hold their newest state (NVMe does not): not read from NVMe by load_all.
  for (std::size_t g : residents(ranges, scheduler)) materialized_[g] = 1;
}

void SpillTier::load_all() {
  if (store_ == nullptr) return;
  // Spilled subgroups are read back into their ranges until the next step drops them again.
  for (std::size_t i = 0; i < on_nvme_.size(); ++i) {
    if (!on_nvme_[i] || materialized_[i]) continue;
    load(i);
  }
}

void SpillTier::load(std::size_t g) {
  const std::size_t a = subgroups_[g].first;
  staging_->load(g, maps_[0] + a, maps_[1] + a, maps_[2] + a);
  materialized_[g] = 1;
}

std::size_t SpillTier::subgroup_of(std::size_t element) const {
  const auto it = std::upper_bound(subgroups_.begin(), subgroups_.end(), element,
                                   [](std::size_t e, const std::pair<std::size_t, std::size_t>& r) { return e < r.second; });
  return static_cast<std::size_t>(it - subgroups_.begin());
}

double SpillTier::round_trip() {
  // The engine's lock: its lender must not move residents (and spill them) meanwhile.
  std::lock_guard lock(guard_);
  spill(n_);
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < on_nvme_.size(); ++i) {
    if (on_nvme_[i]) order.push_back(i);
  }
  const double t0 = device_.host_now_ns();
  staging_->begin(order, read_ahead_);
  try {
    for (std::size_t i : order) {
      (void)staging_->acquire(i);
      staging_->release(i);
    }
  } catch (...) {
    staging_->abandon();
    throw;
  }
  last_ = staging_->finish();
  return device_.host_now_ns() - t0;
}

void SpillTier::inject_faults(const NvmeFaults& faults) {
  std::lock_guard lock(guard_);
  if (store_) store_->inject(faults);
}

std::uint64_t SpillTier::read_beside(std::size_t subgroup, void* dst) const {
  if (store_ == nullptr || subgroup >= on_nvme_.size() || !on_nvme_[subgroup]) {
    throw InvalidArgument("SpillTier::read_beside: subgroup " + std::to_string(subgroup) + " is not readable from NVMe");
  }
  // The store's extents are the spilled subgroups in order.
  const std::size_t extent = static_cast<std::size_t>(std::count(on_nvme_.begin(), on_nvme_.begin() + static_cast<std::ptrdiff_t>(subgroup), true));
  return store_->read_beside(extent, dst);
}

}  // namespace memtide::tiering
