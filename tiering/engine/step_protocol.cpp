#include "memtide/tiering/engine/step_protocol.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/tiering/engine/backward_updates.hpp"
#include "memtide/tiering/engine/update_engine.hpp"

namespace memtide::tiering {
namespace {

bool any_of(const std::vector<std::uint8_t>& flags) {
  return std::any_of(flags.begin(), flags.end(), [](std::uint8_t f) { return f != 0; });
}

bool any_of(const std::vector<bool>& flags) { return std::find(flags.begin(), flags.end(), true) != flags.end(); }

// Forgets the step's arrivals however the step ends: the next backward sends its own.
struct ResetOnExit {
  StepProtocol& protocol;
  ~ResetOnExit() { protocol.reset(); }
};

}  // namespace

StepProtocol::StepProtocol(UpdateEngine& engine, ProtocolOptions options, BackwardUpdates* backward)
    : engine_(engine), options_(std::move(options)), backward_(backward) {
  const std::size_t params = engine_.layout().size();
  set_max_grad_norm(options_.max_grad_norm);
  if (!options_.sharded.empty() && options_.sharded.size() != params) {
    throw InvalidArgument("StepProtocol: " + std::to_string(options_.sharded.size()) + " sharded flags for " +
                          std::to_string(params) + " params");
  }
  if (any_of(options_.sharded) && !(options_.collective.sum_sharded && options_.collective.any)) {
    throw InvalidArgument("StepProtocol: some params are sharded across ranks, but no collective was given to sum "
                          "their norms and agree on a verdict");
  }
  arrivals_.assign(params, Arrival{});
}

void StepProtocol::set_max_grad_norm(std::optional<double> max_grad_norm) {
  if (max_grad_norm && !(std::isfinite(*max_grad_norm) && *max_grad_norm > 0)) {
    throw InvalidArgument("StepProtocol: max_grad_norm must be a finite number > 0, got " +
                          std::to_string(*max_grad_norm));
  }
  options_.max_grad_norm = max_grad_norm;
}

std::vector<std::size_t> StepProtocol::grad_ready(std::size_t param, const GradArrival& g, bool speculate) {
  const ParamLayout& layout = engine_.layout();
  if (param >= layout.size()) {
    throw InvalidArgument("StepProtocol::grad_ready: param " + std::to_string(param) + " of " +
                          std::to_string(layout.size()));
  }
  const ParamSlot& slot = layout.params()[param];
  if (g.n != slot.end - slot.start) {
    throw InvalidArgument("StepProtocol::grad_ready: param " + std::to_string(param) + " has " +
                          std::to_string(slot.end - slot.start) + " elements, its gradient " + std::to_string(g.n));
  }
  if (g.dtype != DType::fp32 && g.dtype != DType::fp16 && g.dtype != DType::bf16) {
    throw InvalidArgument(std::string("StepProtocol::grad_ready: gradients must be fp32, fp16 or bf16, got ") +
                          dtype_name(g.dtype));
  }
  if (g.n == 0) return {};  // an empty shard: nothing to send
  if (g.data == nullptr) throw InvalidArgument("StepProtocol::grad_ready: null gradient of param " + std::to_string(param));
  Arrival a;
  a.present = true;
  a.dtype = g.dtype;
  switch (g.how) {
    case GradRoute::device_path:
      engine_.push_grad(slot.start, g.data, g.dtype, g.n, g.producer);
      a.verdict = Verdict::from_path;
      break;
    case GradRoute::host_copy:
      // Above the last-level cache the step reads the array from DRAM anyway: non-temporal stores
      // (decided by the whole step's size, not this gradient's).
      a.verdict = copy_grad(engine_.grad() + slot.start, g.data, g.dtype, g.n, engine_.pool(),
                            resolve_out_stores(g.stores, engine_.size()))
                      ? Verdict::finite
                      : Verdict::nonfinite;
      break;
    case GradRoute::in_place:
      // A loss scaler needs the verdict before the step: a scan (a read, no write) gives it now,
      // while backward goes on. Without one the step's own kernel raises the flag.
      if (options_.loss_scaler) {
        a.verdict = grads_finite(g.data, g.dtype, g.n, 1.0, 1.0, engine_.pool()) ? Verdict::finite : Verdict::nonfinite;
      }
      a.source = g.data;
      break;
  }
  arrivals_[param] = a;
  if (backward_ != nullptr && speculate) return backward_->grad_ready(param);
  return {};
}

void StepProtocol::grad_written(std::size_t param) {
  if (param >= arrivals_.size()) {
    throw InvalidArgument("StepProtocol::grad_written: param " + std::to_string(param) + " of " +
                          std::to_string(arrivals_.size()));
  }
  arrivals_[param] = Arrival{true, Verdict::none, nullptr, DType::fp32};
}

void StepProtocol::collect(const std::vector<bool>& stale) {
  path_finite_ = engine_.finish_grads();
  bool any = false;
  for (std::size_t i = 0; i < stale.size() && i < arrivals_.size(); ++i) {
    if (!stale[i]) continue;
    arrivals_[i] = Arrival{};
    any = true;
  }
  // Gradients the path kept on the device go to the host first, so that what is sent again wins.
  if (any) engine_.grads_to_host();
}

std::size_t StepProtocol::in_place_count() const noexcept {
  return static_cast<std::size_t>(
      std::count_if(arrivals_.begin(), arrivals_.end(), [](const Arrival& a) { return a.source != nullptr; }));
}

std::optional<bool> StepProtocol::verdict(const std::vector<std::uint8_t>& has_grad) const {
  const auto& slots = engine_.layout().params();
  bool finite = true;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (!has_grad[i] || slots[i].end == slots[i].start) continue;
    switch (arrivals_[i].verdict) {
      case Verdict::none: return std::nullopt;  // written by the front end, or read in place unchecked
      case Verdict::nonfinite: finite = false; break;
      case Verdict::from_path: finite = finite && path_finite_; break;
      case Verdict::finite: break;
    }
  }
  return finite;
}

std::vector<StepProtocol::Located> StepProtocol::locate(const std::vector<std::uint8_t>& has_grad) const {
  engine_.grads_to_host();  // kept on the device (a GPU-resident subgroup's): read on the host
  const auto& slots = engine_.layout().params();
  std::vector<Located> out;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const std::size_t n = slots[i].end - slots[i].start;
    if (!has_grad[i] || n == 0) continue;
    const Arrival& a = arrivals_[i];
    out.push_back(a.source != nullptr ? Located{i, a.source, a.dtype, n}
                                      : Located{i, engine_.grad() + slots[i].start, DType::fp32, n});
  }
  return out;
}

std::pair<double, double> StepProtocol::square_sums(const std::vector<std::uint8_t>& has_grad) const {
  double sums[2] = {0.0, 0.0};  // replicated or local, sharded
  for (const Located& g : locate(has_grad)) {
    sums[!options_.sharded.empty() && options_.sharded[g.param]] += grad_square_sum(g.data, g.dtype, g.n, engine_.pool());
  }
  return {sums[0], sums[1]};
}

bool StepProtocol::scan_finite(const std::vector<std::uint8_t>& has_grad) const {
  for (const Located& g : locate(has_grad)) {
    if (!grads_finite(g.data, g.dtype, g.n, 1.0, 1.0, engine_.pool())) return false;
  }
  return true;
}

void StepProtocol::materialize(const std::vector<std::uint8_t>& has_grad) {
  const auto& slots = engine_.layout().params();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Arrival& a = arrivals_[i];
    if (a.source == nullptr || !has_grad[i]) continue;
    copy_grad(engine_.grad() + slots[i].start, a.source, a.dtype, slots[i].end - slots[i].start, engine_.pool());
    a.source = nullptr;
  }
}

std::vector<GradSource> StepProtocol::sources(const std::vector<std::uint8_t>& has_grad) const {
  std::vector<GradSource> out;
  const auto& slots = engine_.layout().params();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const Arrival& a = arrivals_[i];
    if (a.source != nullptr && has_grad[i]) out.push_back(GradSource{slots[i].start, slots[i].end - slots[i].start, a.source, a.dtype});
  }
  return out;
}

StepOutcome StepProtocol::step(const StepRequest& request, const std::vector<bool>& stale) {
  const std::size_t params = engine_.layout().size();
  if (request.has_grad.size() != params || (!stale.empty() && stale.size() != params)) {
    throw InvalidArgument("StepProtocol::step: " + std::to_string(request.has_grad.size()) + " gradient flags and " +
                          std::to_string(stale.size()) + " stale flags for " + std::to_string(params) + " params");
  }
  ResetOnExit reset_on_exit{*this};
  StepOutcome out;
  bool speculated = false;
  if (backward_ != nullptr) {
    backward_->settle();
    speculated = backward_->pending();
  }
  out.any_gradient = any_of(request.has_grad);
  if (!out.any_gradient) {
    if (backward_ != nullptr) backward_->rollback();
    return out;
  }
  const auto& slots = engine_.layout().params();
  for (std::size_t i = 0; i < params; ++i) {
    if (request.has_grad[i] && slots[i].end > slots[i].start && !arrivals_[i].present) {
      throw InvalidArgument("StepProtocol::step: param " + std::to_string(i) +
                            " has a gradient that never arrived (grad_ready or grad_written)");
    }
  }

  // The verdict and the clip factor, agreed by every rank before anything changes.
  out.verdict = verdict(request.has_grad);
  const bool sharded = any_of(options_.sharded);
  bool nonfinite = false;
  if (options_.max_grad_norm) {
    auto [replicated, shards] = square_sums(request.has_grad);
    if (sharded) shards = options_.collective.sum_sharded(shards);
    const double norm = std::sqrt(replicated + shards) * std::abs(request.grad_scale);
    out.grad_norm = norm;
    if (std::isfinite(norm)) {
      out.clip = std::min(1.0, *options_.max_grad_norm / (norm + 1e-6));
    } else {
      nonfinite = true;
    }
  } else if (options_.loss_scaler && sharded) {
    // An Inf on any rank skips the step on every rank (the norm above agrees by itself).
    nonfinite = options_.collective.any(!(out.verdict ? *out.verdict : scan_finite(request.has_grad)));
  }

  StepRequest r = request;
  r.clip = out.clip;
  r.skip_if_nonfinite = options_.loss_scaler;
  r.path_verdict = out.verdict;
  r.done.clear();
  r.grad_sources.clear();
  std::vector<bool> done;
  if (speculated) {
    // Updates made during backward stand where they used exactly the step's inputs; the others
    // are put back now and run below.
    done = backward_->accept(r, stale, options_.loss_scaler);
    if (nonfinite || (options_.loss_scaler && backward_->nonfinite())) {
      backward_->rollback();  // the whole step is skipped
      done.clear();
      nonfinite = true;
    }
  }
  if (!nonfinite) {
    const bool nonfinite_before = backward_ != nullptr && backward_->nonfinite();
    const bool any_done = any_of(done);
    if (any_done) r.done = done;
    // Gradients read where they lie need a step that scans nothing: else they go into the array.
    const bool scan_needed = options_.loss_scaler && !(out.verdict && std::abs(r.grad_scale) * r.clip <= 1.0);
    if (scan_needed) materialize(request.has_grad);
    r.grad_sources = sources(request.has_grad);
    out.engine = engine_.step(r);
    nonfinite = out.engine.nonfinite;
    out.ran = !out.engine.skipped;
    if (any_done && !out.ran) {
      backward_->rollback();  // skipped: the updates made during backward go too
    } else if (any_done) {
      backward_->publish();
      out.kept_from_backward = static_cast<std::size_t>(std::count(done.begin(), done.end(), true));
    }
    nonfinite = nonfinite || nonfinite_before;
  }
  if (backward_ != nullptr) backward_->finish();
  out.nonfinite = nonfinite;
  out.skipped = nonfinite && !out.ran;
  return out;
}

void StepProtocol::rollback() {
  if (backward_ != nullptr) backward_->rollback();
}

void StepProtocol::reset() {
  std::fill(arrivals_.begin(), arrivals_.end(), Arrival{});
}

}  // namespace memtide::tiering
