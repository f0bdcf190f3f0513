#pragma once
/// @file
/// SpillTier: the NVMe tier of an UpdateEngine. When the host state (16 B/param) does not fit
/// the host budget, the subgroups fit_host_budget picks keep their params and moments on NVMe
/// and each step streams them through pinned staging (NvmeStaging). The tier owns the spill file,
/// the staging and the param and moment arrays' mappings, and keeps per subgroup where its newest
/// state is; the engine calls it at each point of a step (docs/architecture.md, "NVMe spill tier").

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "memtide/allocator/host_arena.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/tiering/model/placement.hpp"
#include "memtide/tiering/nvme/nvme_staging.hpp"
#include "memtide/tiering/nvme/nvme_store.hpp"
#include "memtide/tiering/nvme/spill_state.hpp"

namespace memtide::tiering {

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
  /// On a device whose memory is host memory (DeviceProperties::host_addressable: a SimDevice),
  /// the engine's static residents count against `host_budget_bytes`. false only where a
  /// SimDevice stands in for a separate GPU (tests of the tier's resident paths).
  bool device_memory_in_budget = true;
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

/// Not thread-safe: the engine calls it under its own lock.
class SpillTier {
 public:
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;

  /// The tier for an engine of `n` params in `subgroups` (kept by reference: the engine's), or
  /// null when `config` has no host budget or the state fits it. On a device that stores data
  /// it makes the spill file and maps the param and moment arrays (array()); on a phantom device
  /// it only times the transfers at the configured rates. `guard`: the engine's lock, taken by
  /// the hooks called from outside the engine. Throws InvalidArgument or Error saying why the
  /// tier cannot be made, OutOfMemory when the arrays cannot be mapped.
  static std::unique_ptr<SpillTier> make(Device& device, HostArena& arena, std::size_t n, const Ranges& subgroups,
                                         const NvmeTierConfig& config, const Rates& defaults,
                                         std::recursive_mutex& guard);
  /// Finishes the staging, removes the spill file and folder, unmaps the arrays.
  ~SpillTier();
  SpillTier(const SpillTier&) = delete;
  SpillTier& operator=(const SpillTier&) = delete;

  /// Per subgroup: its params and moments live on NVMe.
  [[nodiscard]] const std::vector<bool>& on_nvme() const noexcept { return on_nvme_; }
  [[nodiscard]] bool spilled(std::size_t subgroup) const { return on_nvme_[subgroup]; }
  /// The param (0), exp_avg (1) or exp_avg_sq (2) array (null on a phantom device).
  [[nodiscard]] float* array(std::size_t k) const noexcept { return maps_[k]; }
  /// Pinned host bytes: the registered ranges of the arrays and the staging buffers.
  [[nodiscard]] std::uint64_t host_bytes() const;
  [[nodiscard]] NvmeTierInfo info() const;

  // ---- the engine's calls ---------------------------------------------------------------------
  /// Writes spilled subgroups wholly below element `up_to` whose host range is the truth to NVMe
  /// and drops their host pages (UpdateEngine::spill_host).
  void spill(std::size_t up_to);
  /// Adds the tier to a workload of the engine's subgroups `index`, and its drive to `rates`.
  void plan_with(Workload& work, Rates& rates, const std::vector<std::size_t>& index) const;
  /// Points the entries of `state` over `ranges` of spilled subgroups at their staging buffers.
  void route(SpillRoutes& state, const Ranges& ranges) const;
  /// Gives `scheduler` the staging.
  void attach(SpillResidents& scheduler) const;
  /// Before a step: what the host holds of spilled subgroups goes to NVMe first.
  void before_step();
  /// After a step: its transfers, and the drive's rates as they showed (smoothed).
  void after_step(const NvmeUse& use);
  /// Before a run of `scheduler` over a list of segments under `placement`: `subgroups[j]` is
  /// the engine subgroup of segment j. Spilled residents leaving residency go to their host range
  /// and NVMe, entering ones are read into theirs. Returns those that left (drop_pages once the
  /// run has copied them back).
  std::vector<std::size_t> move_residents(SpillResidents& scheduler, const std::vector<std::size_t>& subgroups,
                                          const std::vector<Placement>& placement);
  /// Drops the host pages of spilled subgroup `subgroup` (its state is on NVMe).
  void drop_pages(std::size_t subgroup);
  /// Spilled subgroups resident on the device in `scheduler` over `ranges`.
  [[nodiscard]] std::vector<std::size_t> residents(const Ranges& ranges, const SpillResidents& scheduler) const;
  /// `subgroups` were copied to their host ranges from the device: those ranges are the truth.
  /// Returns whether there were any (they must go on to NVMe before anything reads them there).
  bool copied_to_host(const std::vector<std::size_t>& subgroups);
  /// Before `scheduler` drops its device copies because the host changed: a spilled resident
  /// whose host range was never filled has its only copy there, and is copied to it first.
  void keep_unfilled_residents(const Ranges& ranges, SpillResidents& scheduler);
  /// The host ranges that hold state are the truth now (written to NVMe by the next step).
  void host_changed();
  /// `scheduler`'s residents were copied into the host ranges: those hold their newest state.
  void synced(const Ranges& ranges, const SpillResidents& scheduler);
  /// Reads every spilled subgroup whose host range holds no state back into it (a reader).
  void load_all();
  /// Whether spilled subgroups can be read beside the steps (read_beside): a device that stores
  /// data (a phantom device only times transfers).
  [[nodiscard]] bool readable_beside() const noexcept { return store_ != nullptr; }
  /// Reads spilled subgroup `subgroup` as NVMe holds it ([params | exp_avg | exp_avg_sq], its
  /// checksum checked) into `dst` (4 KiB-aligned, room for 12 B/param rounded up to 4 KiB), on
  /// the caller's thread, beside the staging's transfers of other subgroups: for a checkpoint's
  /// writer, which the engine keeps off a subgroup until it has read it. Returns the checksum
  /// (xxHash3 of those bytes). Call spill() first: NVMe then holds every spilled subgroup's state.
  std::uint64_t read_beside(std::size_t subgroup, void* dst) const;

  // ---- hooks for benchmarks and tests ---------------------------------------------------------
  /// Reads every spilled subgroup through the staging pipeline and writes it back unchanged, in
  /// update order, with no update between: the tier's I/O time for one step alone. Returns the
  /// host clock's ns.
  double round_trip();
  /// The next transfers fail as `faults` says (nothing on a phantom device).
  void inject_faults(const NvmeFaults& faults);

 private:
  SpillTier(Device& device, std::size_t n, const Ranges& subgroups, std::recursive_mutex& guard);
  void load(std::size_t subgroup);
  [[nodiscard]] std::size_t subgroup_of(std::size_t element) const;

  Device& device_;
  std::size_t n_;
  const Ranges& subgroups_;
  std::recursive_mutex& guard_;
  std::vector<bool> on_nvme_;
  std::size_t read_ahead_ = 2;
  // Destroyed in order (see ~SpillTier): the staging (its I/O thread finishes), the store (the
  // spill file goes), the directory, then the mappings.
  std::unique_ptr<SpillDir> dir_;
  std::unique_ptr<NvmeStore> store_;
  std::unique_ptr<NvmeStaging> staging_;
  std::vector<char> host_truth_;    // per subgroup: its host range is newer than NVMe (or NVMe has none)
  std::vector<char> materialized_;  // per subgroup: its host range holds its state
  float* maps_[3] = {};             // param, exp_avg, exp_avg_sq (a device that stores data)
  std::size_t map_bytes_ = 0;
  Ranges registered_;               // byte ranges registered in each map
  std::size_t registered_maps_ = 0;  // maps whose every range is registered (the first ones)
  double read_rate_ = 0, write_rate_ = 0;  // planned with; measured once transfers ran
  bool read_measured_ = false, write_measured_ = false;
  NvmeUse last_;
};

}  // namespace memtide::tiering
