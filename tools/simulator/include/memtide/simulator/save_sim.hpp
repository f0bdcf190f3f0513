#pragma once
/// @file
/// SimulatedSave: a checkpoint save beside training on a SimDevice's virtual clock. The engine
/// treats it as it treats StateSnapshot (it is a SaveTarget: the steps protect each subgroup
/// before they change it); what it writes is modelled, not written. Its writer streams the
/// rank's optimizer state (12 B/param: params, exp_avg, exp_avg_sq) at a stated disk rate, one
/// subgroup at a time in StateSnapshot's order (what a step waits for, then copies, then from the
/// last subgroup down). A step that meets a subgroup not yet written copies it into the
/// bounded buffer (host work over DRAM: 24 B/param) or, when the buffer is full, waits for the
/// writer to take it next: the host clock advances to that write's end. One the writer is on has
/// the part not yet written copied aside, as StateSnapshot does, and the writer goes on from it
/// (the real writer takes the copy at its next 8 MiB chunk; that wait is not modelled).
///
/// Modelled, not simulated: the disk is the writer's alone at the stated rate (a spilled state's
/// NVMe traffic does not slow it), and its DRAM reads (12 B/param at disk speed) do not slow the
/// steps. docs/simulator.md says so beside the numbers.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "memtide/device/sim_device.hpp"
#include "memtide/tiering/checkpoint/save_target.hpp"

namespace memtide::tiering {

class SimulatedSave final : public SaveTarget {
 public:
  /// A save of subgroups of `sizes` params, starting now on `device`'s host clock, written at
  /// `write_bytes_per_s`, with a copy-on-write buffer of `buffer_bytes` (0: two of the largest
  /// subgroup). Throws InvalidArgument for a rate that is not positive.
  SimulatedSave(SimDevice& device, std::vector<std::size_t> sizes, double write_bytes_per_s, std::uint64_t buffer_bytes);

  void protect(std::size_t i, const float* p, const float* m, const float* v) override;
  [[nodiscard]] bool done() const override;
  /// Advances the host clock to the save's end.
  void wait() override;

  [[nodiscard]] double start_ns() const noexcept { return start_ns_; }
  /// When the last subgroup is written (the writer's pace from here on, if it is not yet).
  [[nodiscard]] double end_ns() const;
  [[nodiscard]] double waited_ns() const noexcept { return waited_ns_; }
  [[nodiscard]] std::uint64_t copied_bytes() const noexcept { return copied_bytes_; }
  [[nodiscard]] std::uint64_t peak_buffer_bytes() const noexcept { return peak_buffer_; }
  [[nodiscard]] std::uint64_t buffer_bound() const noexcept { return buffer_bound_; }
  [[nodiscard]] std::uint64_t total_bytes() const noexcept { return total_bytes_; }

 private:
  enum class Stage : unsigned char { pending, copied, writing, written };
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  // The writer as of its clock: what it has written, what it writes now, the buffer it frees.
  struct Writer {
    std::vector<Stage> stage;
    std::deque<std::size_t> urgent;
    std::size_t cursor = 0;  // subgroups from the last down it has passed
    std::size_t current = kNone;
    bool from_copy = false;
    std::uint64_t rest_copied = 0;  // the current write's part not yet written, copied by a step
    double end = 0;  // of the current write
    double clock = 0;
    std::uint64_t buffer_used = 0;
  };
  // Runs `w` up to `now`: every write that ends by then is done, and the next begun.
  void advance(Writer& w, double now) const;
  [[nodiscard]] std::uint64_t bytes(std::size_t i) const { return 12 * static_cast<std::uint64_t>(sizes_[i]); }

  SimDevice& device_;
  std::vector<std::size_t> sizes_;
  double rate_;
  std::uint64_t buffer_bound_ = 0, total_bytes_ = 0;
  double start_ns_ = 0;
  mutable Writer writer_;  // mutable: done() and end_ns() run it up to now
  std::uint64_t peak_buffer_ = 0, copied_bytes_ = 0;
  double waited_ns_ = 0;
};

}  // namespace memtide::tiering
