#include "memtide/tiering/engine/backward_updates.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"
#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {
namespace {

double now_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

template <typename T>
std::vector<T> copy_of(const T* from, std::size_t n) {
  return std::vector<T>(from, from + n);
}

}  // namespace

BackwardUpdates::BackwardUpdates(UpdateEngine& engine, std::size_t max_subgroups)
    : engine_(engine), max_(max_subgroups) {
  if (max_subgroups == 0) throw InvalidArgument("BackwardUpdates: max_subgroups must be >= 1");
  worker_ = std::thread([this] { worker_main(); });
}

BackwardUpdates::~BackwardUpdates() {
  try {
    std::unique_lock<std::mutex> lock(mutex_);
    settle_locked(lock);
    for (auto& [g, s] : specs_) restore(s);
    specs_.clear();
  } catch (...) {  // a failed update was put back by settle_locked; nothing else to do here
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_.notify_all();
  worker_.join();
}

void BackwardUpdates::rebuild(std::vector<bool> takes_part) {
  rollback();
  std::lock_guard<std::mutex> lock(mutex_);
  const ParamLayout& layout = engine_.layout();
  if (takes_part.size() != layout.size()) {
    throw InvalidArgument("BackwardUpdates::rebuild: " + std::to_string(takes_part.size()) + " flags for " +
                          std::to_string(layout.size()) + " params");
  }
  subgroups_of_.assign(layout.size(), {});
  needed_.assign(engine_.subgroups().size(), 0);
  for (std::size_t i = 0; i < layout.size(); ++i) {
    if (!takes_part[i]) continue;
    const auto [first, last] = layout.subgroups_of(i);
    for (std::size_t g = first; g < last; ++g) {
      subgroups_of_[i].push_back(g);
      ++needed_[g];
    }
  }
  ready_ns_.clear();  // timed under the old subgroups' numbers
  backward_end_ns_.reset();
  reset_counts_locked();
  choose_locked();
}

void BackwardUpdates::reset_counts_locked() {
  left_ = needed_;
  seen_.assign(subgroups_of_.size(), false);
}

void BackwardUpdates::choose_locked() {
  const std::vector<Placement> placement = engine_.current_plan().plan.placement;
  choice_ = choose_backward_updates(
      {placement, engine_.on_nvme(), engine_.subgroups(), ready_ns_, ns_per_param_, backward_end_ns_, max_});
  chosen_ = std::set<std::size_t>(choice_.subgroups.begin(), choice_.subgroups.end());
  std::vector<bool> host(placement.size(), false);
  for (std::size_t g : chosen_) host[g] = true;
  engine_.set_host_gradients(std::move(host));  // their gradients go to the host whatever the plan says
}

void BackwardUpdates::choose(std::optional<double> ns_per_param) {
  if (ns_per_param && !(*ns_per_param >= 0 && std::isfinite(*ns_per_param))) {
    throw InvalidArgument("BackwardUpdates::choose: ns_per_param must be finite and >= 0");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (ns_per_param) ns_per_param_ = *ns_per_param;
  choose_locked();
}

std::size_t BackwardUpdates::max_subgroups() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return max_;
}

void BackwardUpdates::set_max_subgroups(std::size_t n) {
  if (n == 0) throw InvalidArgument("BackwardUpdates: max_subgroups must be >= 1");
  std::lock_guard<std::mutex> lock(mutex_);
  max_ = n;
}

std::map<std::size_t, double> BackwardUpdates::ready_ns() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ready_ns_;
}

void BackwardUpdates::backward_started() {
  std::lock_guard<std::mutex> lock(mutex_);
  ready_ns_.clear();
  backward_end_ns_.reset();
}

void BackwardUpdates::backward_ended() {
  std::lock_guard<std::mutex> lock(mutex_);
  backward_end_ns_ = now_ns();
}

std::vector<std::size_t> BackwardUpdates::grad_ready(std::size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::size_t> complete;
  if (i >= subgroups_of_.size()) return complete;
  const bool first = !seen_[i];
  seen_[i] = true;
  for (std::size_t g : subgroups_of_[i]) {
    if (specs_.count(g) != 0) {
      // A gradient of an updated subgroup arrived again (a second backward before the step):
      // the update read the earlier one.
      invalid_.insert(g);
      continue;
    }
    if (!first || left_[g] == 0) continue;
    if (--left_[g] == 0) {
      ready_ns_[g] = now_ns();
      if (chosen_.count(g) != 0) complete.push_back(g);
    }
  }
  return complete;
}

void BackwardUpdates::submit(std::size_t g, const StepRequest& request) {
  std::vector<Segment> segments = engine_.segments(request, g);
  if (segments.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (specs_.count(g) != 0) return;
  Speculation& s = specs_[g];
  s.segments = std::move(segments);
  s.grad_scale = request.grad_scale;
  ++stats_.speculated;
  queue_.push_back(g);
  work_.notify_one();
}

void BackwardUpdates::worker_main() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_ && queue_.empty()) return;
    const std::size_t g = queue_.front();
    queue_.pop_front();
    const auto it = specs_.find(g);  // there: every path that erases specs settles first
    if (it == specs_.end()) {
      done_.notify_all();
      continue;
    }
    ++running_;
    Speculation& s = it->second;
    lock.unlock();
    std::exception_ptr error;
    try {
      run(s);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    s.error = error;
    s.finished = true;
    --running_;
    done_.notify_all();
  }
}

// The CPU kernel over copies it can put back. The model's params (views of the low-precision
// buffer, or of the fp32 masters) must not change before the step: a forward in between (a
// micro-batch nobody said was one, an evaluation) would read them, so their new values wait aside.
void BackwardUpdates::run(Speculation& s) {
  // CUDA gradients reach the host array through the engine's gradient path, on its own streams:
  // wait until what was pushed (this subgroup's included) has landed.
  if (!engine_.device().properties().host_addressable) engine_.wait_grads_pushed();
  const double t0 = now_ns();
  const DType lowp = model_copy_ != nullptr ? model_copy_dtype_ : engine_.model_dtype();
  std::size_t n_total = 0;
  for (const Segment& seg : s.segments) {
    const std::size_t n = seg.end - seg.start;
    engine_.protect_host(seg.subgroup);  // a running checkpoint save keeps the state before this update
    Piece piece;
    piece.start = seg.start;
    piece.end = seg.end;
    piece.exp_avg = copy_of(engine_.exp_avg() + seg.start, n);
    piece.exp_avg_sq = copy_of(engine_.exp_avg_sq() + seg.start, n);
    AdamwArgs a;
    if (seg.low_precision && lowp != DType::none) {
      piece.params = copy_of(engine_.param() + seg.start, n);
      piece.new_lowp.resize(n);
      a.param = engine_.param() + seg.start;
      a.param_out = piece.new_lowp.data();
      a.param_out_dtype = lowp;
    } else {
      piece.new_params = copy_of(engine_.param() + seg.start, n);
      a.param = piece.new_params.data();
    }
    a.exp_avg = engine_.exp_avg() + seg.start;
    a.exp_avg_sq = engine_.exp_avg_sq() + seg.start;
    a.grad = engine_.grad() + seg.start;
    a.n = n;
    a.lr = seg.params.lr;
    a.beta1 = seg.params.beta1;
    a.beta2 = seg.params.beta2;
    a.eps = seg.params.eps;
    a.weight_decay = seg.params.weight_decay;
    a.step = seg.params.step;
    a.grad_scale = s.grad_scale;
    s.pieces.push_back(std::move(piece));
    s.nonfinite = adamw_step(a, engine_.pool()) || s.nonfinite;
    n_total += n;
  }
  if (n_total > 0) {
    const double rate = (now_ns() - t0) / static_cast<double>(n_total);
    std::lock_guard<std::mutex> lock(mutex_);
    ns_per_param_ = ns_per_param_ ? 0.5 * (*ns_per_param_ + rate) : rate;
  }
}

void BackwardUpdates::settle_locked(std::unique_lock<std::mutex>& lock) {
  done_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
  std::exception_ptr failed;
  for (auto& [g, s] : specs_) {
    if (s.error && !failed) failed = s.error;
  }
  if (!failed) return;
  for (auto& [g, s] : specs_) restore(s);
  finish_locked();
  try {
    std::rethrow_exception(failed);
  } catch (const std::exception& e) {
    throw Error(std::string("an update during backward failed (every one was put back): ") + e.what());
  }
}

void BackwardUpdates::settle() {
  std::unique_lock<std::mutex> lock(mutex_);
  settle_locked(lock);
}

std::vector<bool> BackwardUpdates::accept(const StepRequest& request, const std::vector<bool>& stale, bool scaler) {
  if (stale.size() > engine_.layout().size()) {
    throw InvalidArgument("BackwardUpdates::accept: " + std::to_string(stale.size()) + " stale flags for " +
                          std::to_string(engine_.layout().size()) + " params");
  }
  const std::vector<Segment> step_segments = engine_.segments(request);
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::size_t, std::vector<Segment>> by_subgroup;
  for (const Segment& s : step_segments) by_subgroup[s.subgroup].push_back(s);
  std::vector<bool> done(engine_.subgroups().size(), false);
  std::size_t kept = 0;
  for (auto it = specs_.begin(); it != specs_.end();) {
    const auto& [g, s] = *it;
    bool stale_here = false;  // a gradient changed after its hook ran (any param of the subgroup)
    for (std::size_t i = 0; i < stale.size() && !stale_here; ++i) {
      const auto [first, last] = engine_.layout().subgroups_of(i);
      stale_here = stale[i] && first <= g && g < last;
    }
    const auto step_here = by_subgroup.find(g);
    const bool same = step_here != by_subgroup.end() && step_here->second == s.segments;
    if (invalid_.count(g) == 0 && !stale_here && request.clip == 1.0 && s.grad_scale == request.grad_scale && same &&
        !(scaler && s.nonfinite)) {
      done[g] = true;
      ++kept;
      ++it;
    } else {
      restore(s);
      ++stats_.redone;
      it = specs_.erase(it);
    }
  }
  stats_.kept += kept;
  return done;
}

bool BackwardUpdates::nonfinite() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::any_of(specs_.begin(), specs_.end(), [](const auto& kv) { return kv.second.nonfinite; });
}

void BackwardUpdates::publish() {
  std::lock_guard<std::mutex> lock(mutex_);
  Device& device = engine_.device();
  const DType engine_dtype = engine_.model_dtype();
  void* engine_model = model_copy_ == nullptr && engine_dtype != DType::none ? engine_.model_params(engine_dtype)
                                                                             : nullptr;
  bool copied = false;
  for (auto& [g, s] : specs_) {
    for (const Piece& piece : s.pieces) {
      const std::size_t n = piece.end - piece.start;
      if (!piece.new_lowp.empty()) {
        if (model_copy_ != nullptr) {
          std::memcpy(static_cast<std::uint16_t*>(model_copy_) + piece.start, piece.new_lowp.data(), n * 2);
        } else if (engine_model != nullptr && device.properties().host_addressable) {
          std::memcpy(static_cast<std::uint16_t*>(engine_model) + piece.start, piece.new_lowp.data(), n * 2);
        } else if (engine_model != nullptr) {
          // The engine's model buffer is a GPU's memory: an upload, on the device's default stream.
          device.copy_async(static_cast<std::uint16_t*>(engine_model) + piece.start, piece.new_lowp.data(), n * 2,
                            CopyKind::host_to_device, Stream{});
          copied = true;
        }
      }
      if (!piece.new_params.empty()) std::memcpy(engine_.param() + piece.start, piece.new_params.data(), n * 4);
    }
  }
  if (copied) device.stream_synchronize(Stream{});  // the pieces' buffers go with finish()
}

void BackwardUpdates::restore(const Speculation& s) {
  for (const Piece& piece : s.pieces) {
    const std::size_t n = piece.end - piece.start;
    std::memcpy(engine_.exp_avg() + piece.start, piece.exp_avg.data(), n * 4);
    std::memcpy(engine_.exp_avg_sq() + piece.start, piece.exp_avg_sq.data(), n * 4);
    if (!piece.params.empty()) std::memcpy(engine_.param() + piece.start, piece.params.data(), n * 4);
  }
}

void BackwardUpdates::finish_locked() {
  specs_.clear();
  invalid_.clear();
  reset_counts_locked();
  choose_locked();  // the step may have made a new plan
}

void BackwardUpdates::finish() {
  std::unique_lock<std::mutex> lock(mutex_);
  settle_locked(lock);  // nothing may still run on what finish forgets
  finish_locked();
}

void BackwardUpdates::rollback() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!specs_.empty()) {
    settle_locked(lock);
    for (auto& [g, s] : specs_) {
      restore(s);
      ++stats_.rolled_back;
    }
  }
  if (!subgroups_of_.empty() || !needed_.empty()) finish_locked();
}

bool BackwardUpdates::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !specs_.empty();
}

BackwardStats BackwardUpdates::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

BackwardChoice BackwardUpdates::last_choice() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return choice_;
}

std::set<std::size_t> BackwardUpdates::chosen() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return chosen_;
}

}  // namespace memtide::tiering
