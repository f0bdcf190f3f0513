#include "memtide/simulator/save_sim.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "memtide/core/error.hpp"

namespace memtide::tiering {

SimulatedSave::SimulatedSave(SimDevice& device, std::vector<std::size_t> sizes, double write_bytes_per_s,
                             std::uint64_t buffer_bytes)
    : device_(device), sizes_(std::move(sizes)), rate_(write_bytes_per_s) {
  if (!(rate_ > 0) || !std::isfinite(rate_)) {
    throw InvalidArgument("simulated checkpoint: the write rate must be a positive number of bytes/s, got " +
                          std::to_string(write_bytes_per_s));
  }
  std::uint64_t largest = 0;
  for (std::size_t i = 0; i < sizes_.size(); ++i) {
    total_bytes_ += bytes(i);
    largest = std::max(largest, bytes(i));
  }
  buffer_bound_ = buffer_bytes > 0 ? buffer_bytes : 2 * largest;
  writer_.stage.assign(sizes_.size(), Stage::pending);
  start_ns_ = writer_.clock = device_.now_ns();
}

void SimulatedSave::advance(Writer& w, double now) const {
  const std::size_t count = w.stage.size();
  for (;;) {
    if (w.current == kNone) {
      std::size_t i = kNone;
      bool from_copy = false;
      while (i == kNone && !w.urgent.empty()) {  // what a step waits for, then copies: they free the buffer
        if (w.stage[w.urgent.front()] == Stage::pending) i = w.urgent.front();
        w.urgent.pop_front();
      }
      for (std::size_t j = 0; i == kNone && j < count; ++j) {
        if (w.stage[j] == Stage::copied) {
          i = j;
          from_copy = true;
        }
      }
      while (i == kNone && w.cursor < count && w.stage[count - 1 - w.cursor] != Stage::pending) ++w.cursor;
      if (i == kNone && w.cursor < count) i = count - 1 - w.cursor;
      if (i == kNone) return;  // all written
      w.current = i;
      w.from_copy = from_copy;
      w.stage[i] = Stage::writing;
      w.end = w.clock + static_cast<double>(bytes(i)) / rate_ * 1e9;
    }
    if (w.end > now) return;
    w.stage[w.current] = Stage::written;
    w.buffer_used -= w.from_copy ? bytes(w.current) : w.rest_copied;
    w.rest_copied = 0;
    w.clock = w.end;
    w.current = kNone;
  }
}

bool SimulatedSave::done() const {
  advance(writer_, device_.now_ns());
  return writer_.current == kNone &&
         std::all_of(writer_.stage.begin(), writer_.stage.end(), [](Stage s) { return s == Stage::written; });
}

double SimulatedSave::end_ns() const {
  Writer rest = writer_;  // run a copy to the end: from here on nothing more is copied or made urgent
  advance(rest, std::numeric_limits<double>::infinity());
  return rest.clock;
}

void SimulatedSave::protect(std::size_t i, const float*, const float*, const float*) {
  if (i >= writer_.stage.size()) return;
  const double now = device_.now_ns();
  advance(writer_, now);
  const Stage s = writer_.stage[i];
  if (s == Stage::written || s == Stage::copied) return;
  double until = 0;
  if (s == Stage::writing) {
    if (writer_.from_copy || writer_.rest_copied > 0) return;  // the writer has its copy: the arrays may change
    // The part not yet written is copied aside; the writer goes on from it.
    const double length = static_cast<double>(bytes(i)) / rate_ * 1e9;
    const double left = length > 0 ? std::clamp((writer_.end - now) / length, 0.0, 1.0) : 0.0;
    const auto rest = static_cast<std::uint64_t>(std::ceil(left * static_cast<double>(bytes(i))));
    if (rest > 0 && writer_.buffer_used + rest <= buffer_bound_) {
      device_.host_work(2.0 * static_cast<double>(rest), std::numeric_limits<double>::infinity());
      writer_.rest_copied = rest;
      writer_.buffer_used += rest;
      peak_buffer_ = std::max(peak_buffer_, writer_.buffer_used);
      copied_bytes_ += rest;
      return;
    }
    until = writer_.end;
  } else if (writer_.buffer_used + bytes(i) <= buffer_bound_) {
    // Copy-on-write: read the subgroup's 12 B/param and write them to the buffer.
    device_.host_work(2.0 * static_cast<double>(bytes(i)), std::numeric_limits<double>::infinity());
    writer_.stage[i] = Stage::copied;
    writer_.buffer_used += bytes(i);
    peak_buffer_ = std::max(peak_buffer_, writer_.buffer_used);
    copied_bytes_ += bytes(i);
    return;
  } else {
    writer_.urgent.push_front(i);  // the writer takes it next
    const double after = writer_.current == kNone ? std::max(writer_.clock, now) : writer_.end;
    until = after + static_cast<double>(bytes(i)) / rate_ * 1e9;
  }
  if (until > now) {
    device_.advance_host(until - now);
    waited_ns_ += until - now;
  }
  advance(writer_, device_.now_ns());
}

void SimulatedSave::wait() {
  const double end = end_ns();
  const double now = device_.now_ns();
  if (end > now) device_.advance_host(end - now);
  advance(writer_, device_.now_ns());
}

}  // namespace memtide::tiering
