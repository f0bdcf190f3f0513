#include "memtide/allocator/phase_tracker.hpp"

#include <algorithm>
#include <limits>
#include <vector>

namespace memtide {

const char* phase_name(Phase phase) noexcept {
  switch (phase) {
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::update: return "update";
    case Phase::other: return "other";
  }
  return "other";
}

std::optional<Phase> parse_phase(std::string_view name) noexcept {
  for (int i = 0; i < kPhaseCount; ++i) {
    const auto p = static_cast<Phase>(i);
    if (name == phase_name(p)) return p;
  }
  return std::nullopt;
}

PhaseTracker::PhaseTracker(std::size_t history) : capacity_(std::max<std::size_t>(history, 1)) {
  current_.phases[static_cast<int>(Phase::other)].seen = true;
  current_.phases[static_cast<int>(Phase::other)].min_free = std::numeric_limits<std::uint64_t>::max();
}

void PhaseTracker::begin_phase(Phase phase, std::uint64_t allocated, std::uint64_t reserved, double now_ns) {
  phase_ = phase;
  phase_start_ns_ = now_ns;
  PhaseWatermark& w = current_.phases[static_cast<int>(phase)];
  if (!w.seen) {
    w.seen = true;
    w.min_free = std::numeric_limits<std::uint64_t>::max();
  }
  observe(allocated, reserved);
}

void PhaseTracker::mark(Phase phase, std::uint64_t allocated, std::uint64_t reserved, double now_ns) {
  if (clock_started_) current_.phases[static_cast<int>(phase_)].duration_ns += now_ns - phase_start_ns_;
  clock_started_ = true;
  // Once an update has been seen, only forward after update closes an iteration: with gradient
  // accumulation, forward -> backward repeats per micro-batch inside one iteration. Before that
  // (the first micro-batches, or a loop that never marks update), forward after backward does.
  const bool after_update = current_.phases[static_cast<int>(Phase::update)].seen;
  const bool after_backward = current_.phases[static_cast<int>(Phase::backward)].seen;
  const bool closes_iteration = phase == Phase::forward && (after_update || (!update_seen_ && after_backward));
  if (after_update) update_seen_ = true;
  if (closes_iteration) {
    history_.push_back(current_);
    if (history_.size() > capacity_) history_.pop_front();
    ++finished_;
    current_ = IterationRecord{};
    current_.index = finished_;
  }
  begin_phase(phase, allocated, reserved, now_ns);
}

Headroom PhaseTracker::headroom(Phase until, std::uint64_t allocated_now, std::uint64_t margin) const {
  Headroom h;
  const std::uint64_t free_now = limit_ > allocated_now ? limit_ - allocated_now : 0;
  std::uint64_t cap = free_now;
  h.limiting_phase = phase_;

  // The phases the loan lives through: the current one, then each following one in the
  // forward -> backward -> update cycle until `until` begins. From "other", whose place in the
  // cycle is unknown, every cyclic phase except `until` is counted.
  std::vector<Phase> window{phase_};
  if (phase_ == Phase::other) {
    for (Phase p : {Phase::forward, Phase::backward, Phase::update}) {
      if (p != until) window.push_back(p);
    }
  } else if (until != Phase::other) {
    for (int i = (static_cast<int>(phase_) + 1) % 3; i != static_cast<int>(until); i = (i + 1) % 3) {
      window.push_back(static_cast<Phase>(i));
    }
  }

  auto consider = [&](const IterationRecord& it, Phase p) {
    const PhaseWatermark& w = it.phases[static_cast<int>(p)];
    if (w.seen && w.min_free < cap) {
      cap = w.min_free;
      h.limiting_phase = p;
    }
  };
  for (const IterationRecord& it : history_) {
    for (Phase p : window) consider(it, p);
  }
  consider(current_, phase_);  // what the running phase has already shown
  h.iterations_used = history_.size();
  h.from_history = !history_.empty();
  h.bytes = cap > margin ? cap - margin : 0;
  return h;
}

}  // namespace memtide
