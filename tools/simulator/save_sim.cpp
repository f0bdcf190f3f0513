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
  stage_.assign(sizes_.size(), Stage::pending);
  start_ns_ = clock_ = device_.now_ns();
}

void SimulatedSave::advance(double now) const {
  const std::size_t count = stage_.size();
  for (;;) {
    if (current_ == kNone) {
      std::size_t i = kNone;
      bool from_copy = false;
      while (i == kNone && !urgent_.empty()) {  // what a step waits for, then copies: they free the buffer
        if (stage_[urgent_.front()] == Stage::pending) i = urgent_.front();
        urgent_.pop_front();
      }
      for (std::size_t j = 0; i == kNone && j < count; ++j) {
        if (stage_[j] == Stage::copied) {
          i = j;
          from_copy = true;
        }
      }
      while (i == kNone && cursor_ < count && stage_[count - 1 - cursor_] != Stage::pending) ++cursor_;
      if (i == kNone && cursor_ < count) i = count - 1 - cursor_;
      if (i == kNone) return;  // all written
      current_ = i;
      current_from_copy_ = from_copy;
      stage_[i] = Stage::writing;
      current_end_ = clock_ + static_cast<double>(bytes(i)) / rate_ * 1e9;
    }
    if (current_end_ > now) return;
    stage_[current_] = Stage::written;
    if (current_from_copy_) buffer_used_ -= bytes(current_);
    clock_ = current_end_;
    current_ = kNone;
  }
}

bool SimulatedSave::done() const {
  advance(device_.now_ns());
  return current_ == kNone && std::all_of(stage_.begin(), stage_.end(), [](Stage s) { return s == Stage::written; });
}

double SimulatedSave::end_ns() const {
  // Run a copy of the writer to the end: from here on nothing more is copied or made urgent.
  const auto stage = stage_;
  const auto urgent = urgent_;
  const std::size_t cursor = cursor_, current = current_;
  const bool from_copy = current_from_copy_;
  const double current_end = current_end_, clock = clock_;
  const std::uint64_t used = buffer_used_;
  advance(std::numeric_limits<double>::infinity());
  const double end = clock_;
  stage_ = stage;
  urgent_ = urgent;
  cursor_ = cursor;
  current_ = current;
  current_from_copy_ = from_copy;
  current_end_ = current_end;
  clock_ = clock;
  buffer_used_ = used;
  return end;
}

void SimulatedSave::protect(std::size_t i, const float*, const float*, const float*) {
  if (i >= stage_.size()) return;
  const double now = device_.now_ns();
  advance(now);
  const Stage s = stage_[i];
  if (s == Stage::written || s == Stage::copied) return;
  double until = 0;
  if (s == Stage::writing) {
    if (current_from_copy_) return;  // the step may change the arrays: the writer has its copy
    until = current_end_;
  } else if (buffer_used_ + bytes(i) <= buffer_bound_) {
    // Copy-on-write: read the subgroup's 12 B/param and write them to the buffer.
    device_.host_work(2.0 * static_cast<double>(bytes(i)), std::numeric_limits<double>::infinity());
    stage_[i] = Stage::copied;
    buffer_used_ += bytes(i);
    peak_buffer_ = std::max(peak_buffer_, buffer_used_);
    copied_bytes_ += bytes(i);
    return;
  } else {
    urgent_.push_front(i);  // the writer takes it next
    const double after = current_ == kNone ? std::max(clock_, now) : current_end_;
    until = after + static_cast<double>(bytes(i)) / rate_ * 1e9;
  }
  if (until > now) {
    device_.advance_host(until - now);
    waited_ns_ += until - now;
  }
  advance(device_.now_ns());
}

void SimulatedSave::wait() {
  const double end = end_ns();
  const double now = device_.now_ns();
  if (end > now) device_.advance_host(end - now);
  advance(device_.now_ns());
}

}  // namespace memtide::tiering
