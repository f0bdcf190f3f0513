#include "memtide/tiering/checkpoint/frozen_state.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "subgroup_ranges.hpp"

namespace memtide::tiering {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Adds [first, end) to a set of disjoint intervals, merging it with those it touches.
void add_interval(std::map<std::size_t, std::size_t>& set, std::size_t first, std::size_t end) {
  auto it = set.upper_bound(first);
  if (it != set.begin() && std::prev(it)->second >= first) --it;
  std::size_t lo = first, hi = end;
  while (it != set.end() && it->first <= end) {
    lo = std::min(lo, it->first);
    hi = std::max(hi, it->second);
    it = set.erase(it);
  }
  set.emplace(lo, hi);
}

// Whether [first, end) lies inside one interval of the set.
bool inside(const std::map<std::size_t, std::size_t>& set, std::size_t first, std::size_t end) {
  auto it = set.upper_bound(first);
  if (it == set.begin()) return false;
  --it;
  return it->first <= first && end <= it->second;
}

void check_range(const FrozenState::Range& r, std::size_t n) {
  if (r.array > 2 || r.first >= r.end || r.end > n) {
    throw InvalidArgument("frozen state: range [" + std::to_string(r.first) + ", " + std::to_string(r.end) + ") of array " +
                          std::to_string(r.array) + " is empty or outside the " + std::to_string(n) + " elements");
  }
}

}  // namespace

std::shared_ptr<FrozenState> FrozenState::start(Config config) {
  if (config.n == 0 || config.subgroups.empty()) throw InvalidArgument("frozen state: there is no state to read");
  for (const float* a : config.arrays) {
    if (a == nullptr) throw InvalidArgument("frozen state: the params, exp_avg and exp_avg_sq arrays must all be given");
  }
  const std::size_t largest = detail::check_subgroups(config.subgroups, config.n, "frozen state");
  for (const Range& r : config.needed) check_range(r, config.n);
  // At most about a year: the limit is added to a steady_clock time point in nanoseconds.
  if (!(config.stall.count() > 0 && config.stall.count() < 3e7)) {
    throw InvalidArgument("frozen state: the stall limit must be > 0 s and finite, got " + std::to_string(config.stall.count()));
  }
  if (config.buffer_bytes == 0) config.buffer_bytes = 2 * 3 * sizeof(float) * static_cast<std::uint64_t>(largest);
  if (!config.buffers) config.buffers = std::make_shared<CopyBuffers>();
  return std::shared_ptr<FrozenState>(new FrozenState(std::move(config)));
}

FrozenState::FrozenState(Config config) : config_(std::move(config)) {
  const std::size_t count = config_.subgroups.size();
  stage_.assign(count, Stage::pending);
  readers_.assign(count, 0);
  left_.assign(3 * count, 0);
  copies_.resize(count);
  touched_.assign(count, false);
  // Each needed range counts as often as it is given: a tensor in the state dict twice (tied
  // weights) is read twice.
  std::uint64_t total = 0;
  for (const Range& r : config_.needed) {
    add_interval(needed_[r.array], r.first, r.end);
    total += (r.end - r.first) * sizeof(float);
    for_each_subgroup(r.first, r.end, [&](std::size_t i, std::size_t a, std::size_t b) {
      left_[3 * i + r.array] += b - a;
    });
  }
  for (std::size_t i = 0; i < count; ++i) {
    if (left(i) == 0) stage_[i] = Stage::read;
  }
  progress_.bytes_total = total;
  progress_.buffer_bound = config_.buffer_bytes;
  started_ = last_read_ = std::chrono::steady_clock::now();
}

FrozenState::~FrozenState() { close("closed before its reader was done"); }

template <typename Each>
void FrozenState::for_each_subgroup(std::size_t first, std::size_t end, Each each) const {
  auto g = std::upper_bound(config_.subgroups.begin(), config_.subgroups.end(), first,
                            [](std::size_t at, const std::pair<std::size_t, std::size_t>& s) { return at < s.first; });
  for (auto i = static_cast<std::size_t>(g - config_.subgroups.begin()) - 1;
       i < config_.subgroups.size() && config_.subgroups[i].first < end; ++i) {
    each(i, std::max(first, config_.subgroups[i].first), std::min(end, config_.subgroups[i].second));
  }
}

std::size_t FrozenState::left(std::size_t i) const { return left_[3 * i] + left_[3 * i + 1] + left_[3 * i + 2]; }

void FrozenState::settle(std::size_t i) {
  if (stage_[i] != Stage::read || readers_[i] != 0 || !copies_[i].memory) return;
  buffer_used_ -= copies_[i].bytes;
  held_bytes_ -= copies_[i].memory.bytes();
  config_.buffers->give(std::move(copies_[i].memory));
  copies_[i] = Copy{};
}

void FrozenState::wait_for_reader(std::unique_lock<std::mutex>& lock, const char* who) {
  const auto limit = std::chrono::duration_cast<std::chrono::steady_clock::duration>(config_.stall);
  if (changed_.wait_until(lock, last_read_ + limit) == std::cv_status::timeout && !closed_ &&
      std::chrono::steady_clock::now() - last_read_ >= config_.stall) {
    give_up(who);
  }
}

void FrozenState::give_up(const char* who) {
  const std::string why = std::string("its reader read nothing for ") + format_duration_ns(config_.stall.count() * 1e9) + " while " + who +
                          " waited";
  MEMTIDE_LOG(error, "frozen state: " + why + "; it is let go and the save will fail");
  error_ = why;
  closed_ = true;
  progress_.done = true;
  progress_.error = why;
  progress_.elapsed_s = seconds_since(started_);
  changed_.notify_all();
}

void FrozenState::read(const Range& range, float* dst) {
  if (range.array > 2 || range.first >= range.end || range.end > config_.n || dst == nullptr) {
    throw InvalidArgument("frozen state: cannot read [" + std::to_string(range.first) + ", " + std::to_string(range.end) +
                          ") of array " + std::to_string(range.array) + " into " + (dst ? "memory" : "null"));
  }
  const std::size_t k = range.array;
  std::unique_lock lock(mutex_);
  if (!inside(needed_[k], range.first, range.end)) {
    throw InvalidArgument("frozen state: [" + std::to_string(range.first) + ", " + std::to_string(range.end) + ") of array " +
                          std::to_string(k) + " was not among the ranges frozen; its values may have changed since");
  }
  for_each_subgroup(range.first, range.end, [&](std::size_t i, std::size_t a, std::size_t b) {
    changed_.wait(lock, [&] { return closed_ || stage_[i] != Stage::copying; });
    if (closed_) {
      throw Error("frozen state: read after it was " + (error_.empty() ? std::string("closed") : "given up on (" + error_ + ")"));
    }
    // From the copy of the array while there is one; else from the array, unless a step has
    // changed it since (it was read as often as it was frozen for, or let go).
    if (copies_[i].at[k] == nullptr && touched_[i]) {
      throw Error("frozen state: array " + std::to_string(k) + " of subgroup " + std::to_string(i) +
                  " was read more often than it was frozen for, and a step has changed it since");
    }
    const float* src = copies_[i].at[k] != nullptr ? copies_[i].at[k] + (a - config_.subgroups[i].first) : config_.arrays[k] + a;
    ++readers_[i];
    lock.unlock();
    std::memcpy(dst + (a - range.first), src, (b - a) * sizeof(float));
    lock.lock();
    --readers_[i];
    std::size_t& still = left_[3 * i + k];
    still -= std::min(still, b - a);
    progress_.bytes_written += (b - a) * sizeof(float);
    if (left(i) == 0) stage_[i] = Stage::read;
    settle(i);
    last_read_ = std::chrono::steady_clock::now();
    changed_.notify_all();
  });
}

void FrozenState::keep_only(const std::vector<Range>& ranges) {
  std::vector<bool> kept(3 * stage_.size(), false);
  for (const Range& r : ranges) {
    check_range(r, config_.n);
    for_each_subgroup(r.first, r.end, [&](std::size_t i, std::size_t, std::size_t) { kept[3 * i + r.array] = true; });
  }
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < stage_.size(); ++i) {
    // One being copied is left as it is (the copy decided what it needs).
    if (stage_[i] == Stage::read || stage_[i] == Stage::copying) continue;
    for (std::size_t k = 0; k < 3; ++k) {
      if (kept[3 * i + k]) continue;
      progress_.bytes_total -= std::min<std::uint64_t>(progress_.bytes_total, left_[3 * i + k] * sizeof(float));
      left_[3 * i + k] = 0;
    }
    if (left(i) == 0) stage_[i] = Stage::read;
    settle(i);
  }
  changed_.notify_all();
}

void FrozenState::protect(std::size_t i, const float* p, const float* m, const float* v) {
  std::unique_lock lock(mutex_);
  if (i >= stage_.size()) return;
  const auto t0 = std::chrono::steady_clock::now();
  bool waited = false;
  double copying_s = 0;
  for (;;) {
    if (closed_) break;
    const Stage s = stage_[i];
    if (s == Stage::copied || s == Stage::read) {
      touched_[i] = true;  // the step changes the arrays now: a read not from the copy would see it
      break;
    }
    if (s == Stage::pending && readers_[i] == 0) {
      const auto [first, end] = config_.subgroups[i];
      const std::uint64_t array_bytes = (end - first) * sizeof(float);
      std::uint64_t bytes = 0;
      bool wanted[3];  // the arrays with reads still to come
      for (std::size_t k = 0; k < 3; ++k) {
        wanted[k] = left_[3 * i + k] > 0;
        bytes += wanted[k] ? array_bytes : 0;
      }
      if (buffer_used_ + bytes <= config_.buffer_bytes) {
        stage_[i] = Stage::copying;
        buffer_used_ += bytes;
        lock.unlock();
        const auto copy_t0 = std::chrono::steady_clock::now();
        Copy c;
        c.memory = config_.buffers->take(bytes);
        if (c.memory) {
          const float* source[3] = {p ? p : config_.arrays[0] + first, m ? m : config_.arrays[1] + first,
                                    v ? v : config_.arrays[2] + first};
          unsigned char* at = c.memory.data();
          for (std::size_t k = 0; k < 3; ++k) {
            if (!wanted[k]) continue;
            std::memcpy(at, source[k], array_bytes);
            c.at[k] = reinterpret_cast<const float*>(at);
            at += array_bytes;
          }
          c.bytes = bytes;
        }
        const double copy_s = seconds_since(copy_t0);
        lock.lock();
        progress_.copy_s += copy_s;
        copying_s += copy_s;
        if (!c.memory || closed_) {
          // No memory for the copy (wait for the reader instead), or nothing to keep any more.
          buffer_used_ -= bytes;
          stage_[i] = Stage::pending;
          if (c.memory) config_.buffers->give(std::move(c.memory));
          changed_.notify_all();
          if (closed_) break;
        } else {
          held_bytes_ += c.memory.bytes();
          peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
          progress_.peak_buffer_bytes = std::max(progress_.peak_buffer_bytes, buffer_used_);
          progress_.copied_bytes += bytes;
          copies_[i] = std::move(c);
          stage_[i] = Stage::copied;
          touched_[i] = true;
          changed_.notify_all();
          break;
        }
      }
    }
    waited = true;
    wait_for_reader(lock, "a step");
  }
  if (waited) progress_.waited_s += std::max(0.0, seconds_since(t0) - copying_s);
}

void FrozenState::close(const std::string& error) {
  std::unique_lock lock(mutex_);
  const bool first = !closed_;
  if (first) {
    closed_ = true;
    error_ = error;
    progress_.done = true;
    progress_.committed = error.empty();
    progress_.error = error;
    progress_.elapsed_s = seconds_since(started_);
  }
  changed_.notify_all();
  // Reads in progress copy from the arrays or the copies: wait for them before letting go.
  changed_.wait(lock, [&] { return std::all_of(readers_.begin(), readers_.end(), [](unsigned r) { return r == 0; }); });
  bool had_copies = false;
  for (Copy& c : copies_) {
    if (!c.memory) continue;
    had_copies = true;
    config_.buffers->give(std::move(c.memory));
    c = Copy{};
  }
  buffer_used_ = 0;
  held_bytes_ = 0;
  if (had_copies || first) config_.buffers->idle(peak_held_bytes_);  // what it needed at most, for the next save
  if (!first) return;
  if (!error.empty()) {
    MEMTIDE_LOG(warn, "frozen state: closed before it was all read (" + error + ")");
  } else {
    MEMTIDE_LOG(info, "frozen state: its reader read " + format_bytes(progress_.bytes_written) + " of " +
                          format_bytes(progress_.bytes_total) + (config_.target.empty() ? "" : " for " + config_.target) +
                          " in " + format_duration_ns(progress_.elapsed_s * 1e9) + "; training waited " +
                          format_duration_ns(progress_.waited_s * 1e9) + ", copied aside " +
                          format_bytes(progress_.copied_bytes) + " (peak " + format_bytes(progress_.peak_buffer_bytes) + ")");
  }
}

bool FrozenState::done() const {
  std::lock_guard lock(mutex_);
  return closed_;
}

void FrozenState::wait() {
  std::unique_lock lock(mutex_);
  while (!closed_) {
    wait_for_reader(lock, "a caller");
  }
  if (!error_.empty()) throw IoError("frozen state: " + error_);
}

SnapshotProgress FrozenState::progress() const {
  std::lock_guard lock(mutex_);
  SnapshotProgress p = progress_;
  if (!p.done) p.elapsed_s = seconds_since(started_);
  return p;
}

}  // namespace memtide::tiering
