#pragma once
/// @file
/// What the NVMe tier needs of the engine's optimizer state, as two small interfaces the engine
/// implements (OptimizerState and UpdateScheduler). They are declared here, in the tier's own
/// headers, so that nvme/ includes nothing of engine/: the engine depends on the tier, never the
/// other way round (docs/architecture.md, the layer picture).
///
/// Indices `range` below are positions in the engine's list of ranges for one scheduler (the
/// entries of one OptimizerState), not the tier's subgroups.

#include <cstddef>

namespace memtide::tiering {

class NvmeStaging;

/// The entries of an optimizer state the tier points at its staging buffers.
class SpillRoutes {
 public:
  SpillRoutes(const SpillRoutes&) = delete;
  SpillRoutes& operator=(const SpillRoutes&) = delete;

  /// Entry `range` is stepped from the staging buffer of the tier's subgroup `subgroup`,
  /// starting `offset` elements into it, instead of from its host arrays.
  virtual void stage_from(std::size_t range, std::size_t subgroup, std::size_t offset) = 0;

 protected:
  SpillRoutes() = default;
  // Never owned through the interface: the engine owns the state.
  ~SpillRoutes() = default;
};

/// The device residents of one scheduler, as the tier moves them between device, host and NVMe.
class SpillResidents {
 public:
  SpillResidents(const SpillResidents&) = delete;
  SpillResidents& operator=(const SpillResidents&) = delete;

  /// Entry `range` is a static resident on the device (its newest state is there).
  [[nodiscard]] virtual bool is_resident(std::size_t range) const = 0;
  /// Copies resident entry `range` back into its host arrays (nothing when not resident).
  virtual void sync_to_host(std::size_t range) = 0;
  /// Gives the scheduler the tier's staging (null: none) and the read-ahead it may use (>= 1).
  virtual void set_nvme(NvmeStaging* staging, std::size_t read_ahead) = 0;

 protected:
  SpillResidents() = default;
  // Never owned through the interface: the engine owns its schedulers.
  ~SpillResidents() = default;
};

}  // namespace memtide::tiering
