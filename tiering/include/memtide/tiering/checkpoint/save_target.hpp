#pragma once
/// @file
/// SaveTarget: what the engine tells a checkpoint save that runs beside training. The engine
/// (UpdateEngine::start_save) calls protect() before a step changes a subgroup's state, and asks
/// whether the save is over. StateSnapshot is the one that writes files; the simulator has one
/// that runs on a SimDevice's virtual clock, so that a save's cost to the steps of a model too
/// large for this machine can be judged through the same engine code.

#include <cstddef>

namespace memtide::tiering {

class SaveTarget {
 public:
  virtual ~SaveTarget() = default;
  SaveTarget(const SaveTarget&) = delete;
  SaveTarget& operator=(const SaveTarget&) = delete;

  /// Before the state of subgroup `i` changes: returns once the save no longer needs it where
  /// it is (written, copied aside, or the save is over). `p`, `m`, `v`: where the subgroup's
  /// state is now when it is not in the host arrays (a spilled subgroup's staging buffer), else
  /// null.
  virtual void protect(std::size_t i, const float* p, const float* m, const float* v) = 0;
  /// Whether the save is over: committed, failed or cancelled.
  [[nodiscard]] virtual bool done() const = 0;
  /// Blocks until the save is over; throws IoError when it did not complete.
  virtual void wait() = 0;

 protected:
  SaveTarget() = default;
};

}  // namespace memtide::tiering
