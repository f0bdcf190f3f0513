#pragma once
/// @file
/// Per-phase GPU memory watermarks and the headroom query that drives tiering.
///
/// A training iteration cycles through forward -> backward -> update. The tracker keeps, for each
/// phase of the running iteration and of the last N finished ones, the peak allocated and reserved
/// bytes and the lowest free memory (limit - allocated). From those it answers: "how many bytes can
/// be borrowed now and kept until phase X begins?"
///
/// Not thread-safe by itself: CachingAllocator owns one and calls it under its own lock.

#include <array>
#include <cstdint>
#include <deque>
#include <optional>
#include <string_view>

namespace memtide {

enum class Phase : int { forward = 0, backward = 1, update = 2, other = 3 };
inline constexpr int kPhaseCount = 4;

/// "forward", "backward", "update", "other".
const char* phase_name(Phase phase) noexcept;
/// Inverse of phase_name; nullopt for anything else.
std::optional<Phase> parse_phase(std::string_view name) noexcept;

/// Watermarks of one phase within one iteration.
struct PhaseWatermark {
  bool seen = false;
  std::uint64_t peak_allocated = 0;
  std::uint64_t peak_reserved = 0;
  std::uint64_t min_free = 0;  ///< lowest (limit - allocated) while the phase ran
  double duration_ns = 0;      ///< wall time spent in the phase
};

struct IterationRecord {
  std::uint64_t index = 0;
  std::array<PhaseWatermark, kPhaseCount> phases{};
};

/// Answer to a headroom query.
struct Headroom {
  std::uint64_t bytes = 0;          ///< what may be borrowed
  Phase limiting_phase = Phase::other;  ///< the phase whose low water set the cap
  std::uint64_t iterations_used = 0;    ///< finished iterations the answer is based on
  bool from_history = false;        ///< false: no finished iteration yet, only the present is known
};

class PhaseTracker {
 public:
  /// `history`: finished iterations remembered (>= 1).
  explicit PhaseTracker(std::size_t history = 4);

  void set_limit(std::uint64_t limit) noexcept { limit_ = limit; }
  [[nodiscard]] std::uint64_t limit() const noexcept { return limit_; }

  /// Enters `phase`. Entering forward after an update closes the running iteration; so does
  /// forward after backward until the first update is seen (a loop without update marks, or the
  /// first micro-batches of gradient accumulation, whose later micro-batches then stay inside one
  /// iteration).
  void mark(Phase phase, std::uint64_t allocated, std::uint64_t reserved, double now_ns);

  /// Called on every change of allocated or reserved bytes; the allocator's hot path.
  void observe(std::uint64_t allocated, std::uint64_t reserved) noexcept {
    PhaseWatermark& w = current_.phases[static_cast<int>(phase_)];
    if (allocated > w.peak_allocated) w.peak_allocated = allocated;
    if (reserved > w.peak_reserved) w.peak_reserved = reserved;
    const std::uint64_t free = limit_ > allocated ? limit_ - allocated : 0;
    if (free < w.min_free) w.min_free = free;
  }

  [[nodiscard]] Phase phase() const noexcept { return phase_; }
  /// Number of finished iterations.
  [[nodiscard]] std::uint64_t iterations() const noexcept { return finished_; }
  [[nodiscard]] const IterationRecord& current() const noexcept { return current_; }
  /// Finished iterations, oldest first (at most `history`).
  [[nodiscard]] const std::deque<IterationRecord>& history() const noexcept { return history_; }

  /// Bytes that can be borrowed now and held until `until` begins, keeping `margin` free.
  /// The cap is the lowest free memory seen, over the remembered iterations, in the current phase
  /// and every phase before `until`; and never more than what is free right now.
  [[nodiscard]] Headroom headroom(Phase until, std::uint64_t allocated_now, std::uint64_t margin) const;

 private:
  void begin_phase(Phase phase, std::uint64_t allocated, std::uint64_t reserved, double now_ns);

  std::size_t capacity_;
  std::uint64_t limit_ = 0;
  Phase phase_ = Phase::other;
  double phase_start_ns_ = 0;
  bool clock_started_ = false;  ///< the first mark starts the clock; time before it is unknown
  std::uint64_t finished_ = 0;
  bool update_seen_ = false;  ///< an update phase has run: only forward after update closes an iteration
  IterationRecord current_;
  std::deque<IterationRecord> history_;
};

}  // namespace memtide
