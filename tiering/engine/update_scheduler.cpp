#include "memtide/tiering/engine/update_scheduler.hpp"

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"

namespace memtide::tiering {
namespace {

constexpr std::size_t kDeviceAlign = 512;
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

struct Interval {
  double begin, end;
};

// Sorts and merges intervals; returns the total length and leaves the disjoint union in `v`.
double merge(std::vector<Interval>& v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  double total = 0;
  for (const Interval& x : v) {
    if (!out.empty() && x.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, x.end);
    } else {
      out.push_back(x);
    }
  }
  for (const Interval& x : out) total += x.end - x.begin;
  v = std::move(out);
  return total;
}

// Total time both disjoint, sorted interval lists cover.
double overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double total = 0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].begin, b[j].begin);
    const double hi = std::min(a[i].end, b[j].end);
    if (hi > lo) total += hi - lo;
    (a[i].end < b[j].end) ? ++i : ++j;
  }
  return total;
}

double per_ns(double amount, double ns) { return ns > 0 ? amount / ns : 0; }

}  // namespace

Measurements StepReport::measurements() const {
  Measurements m;
  m.h2d_bytes_per_ns = per_ns(h2d.bytes, h2d.busy_ns);
  m.d2h_bytes_per_ns = per_ns(d2h.bytes, d2h.busy_ns);
  m.cpu_update_params_per_ns = per_ns(cpu.params, cpu.busy_ns);
  m.gpu_update_params_per_ns = per_ns(gpu.params, gpu.busy_ns);
  m.phase_ns = phase_ns;
  return m;
}

UpdateScheduler::UpdateScheduler(OptimizerState& state, CachingAllocator& allocator, ThreadPool* pool,
                                 SchedulerConfig config, SlabSource* staging_slabs)
    : state_(state), device_(state.device()), allocator_(allocator), pool_(pool), config_(config),
      phantom_(is_phantom(state.device())) {
  if (&allocator.device() != &device_) {
    throw InvalidArgument("UpdateScheduler: the allocator and the optimizer state belong to different devices");
  }
  if (config_.staging_buffers == 0) {
    throw InvalidArgument("UpdateScheduler: staging_buffers must be >= 1, got 0");
  }
  prefetch_ = device_.create_stream();
  upload_ = device_.create_stream();
  compute_ = device_.create_stream();
  flush_ = device_.create_stream();
  phase_start_ = device_.create_event(true);
  // Staging holds one subgroup's low-precision params (2 B/param).
  const std::size_t staging_bytes = state_.largest_subgroup() * 2;
  for (std::size_t b = 0; b < config_.staging_buffers; ++b) staging_.emplace_back(device_, staging_bytes, staging_slabs);
  staging_free_.assign(config_.staging_buffers, Event{});
  host_counter_ = PinnedBuffer(device_, 64, staging_slabs);
  device_counter_ = static_cast<unsigned int*>(allocator_.allocate(sizeof(unsigned int), config_.main_stream));
  residents_.assign(state_.size(), Arrays{});
  packs_ = resident_packs(state_.largest_subgroup());
  pack_blocks_.assign((state_.size() + packs_.per_pack - 1) / packs_.per_pack, nullptr);
}

UpdateScheduler::~UpdateScheduler() {
  try {
    release_residents();
    device_.synchronize();
    allocator_.deallocate(device_counter_, config_.main_stream);
    for (Event e : events_) device_.destroy_event(e);
    device_.destroy_event(phase_start_);
    for (Stream s : {prefetch_, upload_, compute_, flush_}) device_.destroy_stream(s);
  } catch (const Error&) {
    // Destructors never throw; the device is shutting down or already gone.
  }
}

double UpdateScheduler::host_now_ns() { return device_.host_now_ns(); }

Event UpdateScheduler::take_event() {
  // begin_phase sized the pool for the whole phase: running out is a bug, not a reason to allocate.
  if (next_event_ >= events_.size()) throw Error("UpdateScheduler: event pool exhausted (internal error)");
  return events_[next_event_++];
}

template <typename Work>
Event UpdateScheduler::enqueue(OpKind kind, const char* what, std::size_t subgroup, Stream stream, Event after,
                               double bytes, double params, Work&& work) {
  if (after.valid()) device_.stream_wait_event(stream, after);
  const Event start = take_event();
  const Event end = take_event();
  device_.record_event(start, stream);
  work();
  device_.record_event(end, stream);
  ops_.push_back(Op{kind, start, end, bytes, params, what, subgroup});
  return end;
}

UpdateScheduler::Arrays UpdateScheduler::carve(void* block, std::size_t n, bool with_grad) const {
  const std::size_t a = round_up(n * sizeof(float), kDeviceAlign);
  auto* base = static_cast<unsigned char*>(block);
  Arrays r;
  r.block = block;
  r.p = reinterpret_cast<float*>(base);
  r.m = reinterpret_cast<float*>(base + a);
  r.v = reinterpret_cast<float*>(base + 2 * a);
  r.g = with_grad ? reinterpret_cast<float*>(base + 3 * a) : nullptr;
  return r;
}

AdamwArgs UpdateScheduler::args_for(const StepParams& p, std::size_t i) const {
  const Subgroup& g = state_[i];
  AdamwArgs a;
  a.n = g.n;
  a.lr = p.lr;
  a.beta1 = p.beta1;
  a.beta2 = p.beta2;
  a.eps = p.eps;
  a.weight_decay = p.weight_decay;
  a.step = p.step;
  a.grad_scale = p.grad_scale;
  a.clip = p.clip;
  a.l2 = p.l2;
  a.grad_dtype = DType::fp32;
  if (g.model_param != nullptr) {
    a.param_out = g.model_param;
    a.param_out_dtype = state_.model_dtype();
  }
  return a;
}

bool UpdateScheduler::is_resident(std::size_t subgroup) const { return residents_.at(subgroup).block != nullptr; }

std::size_t UpdateScheduler::resident_count() const {
  return static_cast<std::size_t>(
      std::count_if(residents_.begin(), residents_.end(), [](const Arrays& r) { return r.block != nullptr; }));
}

std::uint64_t UpdateScheduler::held_bytes() const {
  std::uint64_t total = allocator_.allocation_size(device_counter_).value_or(0);
  for (void* block : pack_blocks_) total += block == nullptr ? 0 : allocator_.allocation_size(block).value_or(0);
  return total;
}

// ---------------------------------------------------------------------------------------------
// Static residents: moved in when a plan first makes a subgroup gpu_static, out when one stops.
// They live in packs (resident_packs()): one device block for the residents among a run of
// consecutive subgroups. A pack whose members change is moved out whole and in again, sized to
// its new members: the plans' residents are the last subgroups, so at most the one pack at the
// boundary changes when their count does.

std::pair<std::size_t, std::size_t> UpdateScheduler::pack_members(std::size_t j) const {
  const std::size_t n = state_.size();
  const std::size_t last = n - j * packs_.per_pack;
  return {last > packs_.per_pack ? last - packs_.per_pack : 0, last};
}

void UpdateScheduler::place_residents(const std::vector<Placement>& placement) {
  for (std::size_t i = 0; i < state_.size(); ++i) {
    const Subgroup& g = state_[i];
    if (placement[i] == Placement::gpu_static && g.on_nvme() && g.nvme_offset != 0) {
      throw InvalidArgument("UpdateScheduler::run: part of spilled subgroup " + std::to_string(g.nvme_subgroup) +
                            " cannot be a static GPU resident (only a whole one)");
    }
  }
  bool moved = false;
  for (std::size_t j = 0; j < pack_blocks_.size(); ++j) {
    const auto [first, last] = pack_members(j);
    bool same = true;
    std::uint64_t want_bytes = 0;
    for (std::size_t i = first; i < last; ++i) {
      const bool want = placement[i] == Placement::gpu_static;
      same = same && want == (residents_[i].block != nullptr);
      if (want) want_bytes += 4 * round_up(state_[i].n * sizeof(float), kDeviceAlign);
    }
    if (same) continue;
    if (pack_blocks_[j] != nullptr) {
      for (std::size_t i = first; i < last; ++i) copy_back_async(i);
      device_.stream_synchronize(config_.main_stream);
      allocator_.deallocate(pack_blocks_[j], config_.main_stream);
      pack_blocks_[j] = nullptr;
      for (std::size_t i = first; i < last; ++i) residents_[i] = Arrays{};
    }
    if (want_bytes == 0) continue;
    void* block = allocator_.allocate(want_bytes, config_.main_stream);
    pack_blocks_[j] = block;
    std::size_t offset = 0;
    for (std::size_t i = first; i < last; ++i) {
      if (placement[i] != Placement::gpu_static) continue;
      const Subgroup& g = state_[i];
      const std::size_t bytes = g.n * sizeof(float);
      Arrays r = carve(static_cast<unsigned char*>(block) + offset, g.n, true);
      r.block = block;
      offset += 4 * round_up(bytes, kDeviceAlign);
      device_.copy_async(r.p, g.param, bytes, CopyKind::host_to_device, config_.main_stream);
      device_.copy_async(r.m, g.exp_avg, bytes, CopyKind::host_to_device, config_.main_stream);
      device_.copy_async(r.v, g.exp_avg_sq, bytes, CopyKind::host_to_device, config_.main_stream);
      residents_[i] = r;
      moved = true;
    }
  }
  if (moved) device_.stream_synchronize(config_.main_stream);
}

void UpdateScheduler::copy_back_async(std::size_t i) {
  const Arrays& r = residents_.at(i);
  if (r.block == nullptr) return;
  before_host_write(i, NvmeStaging::Staged{});  // a spilled one's old state is on NVMe only
  const Subgroup& g = state_[i];
  const std::size_t bytes = g.n * sizeof(float);
  device_.copy_async(g.param, r.p, bytes, CopyKind::device_to_host, config_.main_stream);
  device_.copy_async(g.exp_avg, r.m, bytes, CopyKind::device_to_host, config_.main_stream);
  device_.copy_async(g.exp_avg_sq, r.v, bytes, CopyKind::device_to_host, config_.main_stream);
}

void UpdateScheduler::sync_to_host() {
  for (std::size_t i = 0; i < state_.size(); ++i) copy_back_async(i);
  device_.stream_synchronize(config_.main_stream);
}

void UpdateScheduler::sync_to_host(std::size_t i) {
  copy_back_async(i);
  device_.stream_synchronize(config_.main_stream);
}

void UpdateScheduler::release_residents() { place_residents(std::vector<Placement>(state_.size(), Placement::cpu)); }

void UpdateScheduler::discard_residents() {
  if (std::all_of(pack_blocks_.begin(), pack_blocks_.end(), [](void* b) { return b == nullptr; })) return;
  // Work queued on the resident arrays (the last sync_to_host) must finish before they are reused.
  device_.stream_synchronize(config_.main_stream);
  for (void*& block : pack_blocks_) {
    if (block != nullptr) allocator_.deallocate(block, config_.main_stream);
    block = nullptr;
  }
  residents_.assign(state_.size(), Arrays{});
}

// ---------------------------------------------------------------------------------------------
// The phase.

StepReport UpdateScheduler::run(const Plan& plan, const StepParams& params) {
  if (plan.placement.size() != state_.size()) {
    throw InvalidArgument("UpdateScheduler::run: the plan places " + std::to_string(plan.placement.size()) +
                          " subgroups, the optimizer state has " + std::to_string(state_.size()));
  }
  const bool any_streamed = std::find(plan.placement.begin(), plan.placement.end(), Placement::gpu) != plan.placement.end();
  if (any_streamed && plan.gpu_slots == 0) {
    throw InvalidArgument("UpdateScheduler::run: the plan streams subgroups to the GPU but gpu_slots = 0; accepted: >= 1");
  }
  const double phase_start_ns = host_now_ns();
  phase_start_ns_ = phase_start_ns;
  cpu_log_.clear();
  if (!check_gradients(params)) {
    for (auto& pieces : grad_pieces_) pieces.clear();
    StepReport skipped;
    skipped.skipped = true;
    skipped.phase_ns = host_now_ns() - phase_start_ns;
    return skipped;
  }
  try {
    begin_phase(plan);
    for (std::size_t i = 0; i < state_.size(); ++i) {
      switch (plan.placement[i]) {
        case Placement::gpu: gpu_update(streamed_index_[i], params); break;
        case Placement::gpu_static: static_update(i, params); break;
        case Placement::cpu: cpu_update(i, params); break;
        case Placement::done: break;
      }
    }
  } catch (...) {
    for (auto& pieces : grad_pieces_) pieces.clear();
    stop_phase();
    throw;
  }
  return end_phase(phase_start_ns);
}

void UpdateScheduler::set_nvme(NvmeStaging* staging, std::size_t read_ahead) {
  if (staging != nullptr && read_ahead == 0) {
    throw InvalidArgument("UpdateScheduler::set_nvme: read_ahead = 0; at least one staging buffer is needed");
  }
  nvme_ = staging;
  nvme_read_ahead_ = read_ahead;
}

std::vector<bool> UpdateScheduler::spilled() const {
  std::vector<bool> out(state_.size());
  for (std::size_t i = 0; i < state_.size(); ++i) out[i] = state_[i].on_nvme();
  return out;
}

void UpdateScheduler::before_host_write(std::size_t i, const NvmeStaging::Staged& now) const {
  if (!before_host_write_) return;
  const Subgroup& g = state_[i];
  if (!g.on_nvme() || now.p == nullptr) {
    before_host_write_(i, nullptr, nullptr, nullptr);
    return;
  }
  // `now` is this entry's piece; the staging buffer holds the whole spilled subgroup.
  before_host_write_(i, now.p - g.nvme_offset, now.m - g.nvme_offset, now.v - g.nvme_offset);
}

NvmeStaging::Staged UpdateScheduler::host_state(std::size_t i) {
  const Subgroup& g = state_[i];
  if (!g.on_nvme()) return NvmeStaging::Staged{g.param, g.exp_avg, g.exp_avg_sq};
  const NvmeStaging::Staged s = nvme_->acquire(g.nvme_subgroup);
  return NvmeStaging::Staged{s.p + g.nvme_offset, s.m + g.nvme_offset, s.v + g.nvme_offset};
}

void UpdateScheduler::stop_phase() noexcept {
  for (Stream s : {prefetch_, upload_, compute_, flush_}) {
    try {
      device_.stream_synchronize(s);
    } catch (...) {  // the phase is being abandoned: the first error is the one reported
    }
  }
  for (const Arrays& s : slots_) {
    try {
      allocator_.deallocate(s.block, config_.main_stream);
    } catch (...) {
    }
  }
  slots_.clear();
  if (nvme_active_) nvme_->abandon();
}

// A NaN or Inf anywhere skips the whole step, on every device alike (dynamic loss scaling).
bool UpdateScheduler::check_gradients(const StepParams& params) {
  if (params.grads_finite) return *params.grads_finite;
  bool finite = true;
  bool on_device = false;
  for (std::size_t i = 0; i < state_.size() && finite; ++i) {
    const Subgroup& g = state_[i];
    if (g.device_grad != nullptr) {
      if (!on_device) {  // device gradients were produced on the training stream
        device_.record_event(phase_start_, config_.main_stream);
        device_.stream_wait_event(compute_, phase_start_);
        device_.memset_async(device_counter_, 0, sizeof(unsigned int), compute_);
      }
      on_device = true;
      count_nonfinite_async(device_, compute_, g.device_grad, DType::fp32, g.n, params.grad_scale, params.clip,
                            device_counter_);
    } else {
      device_.run_host_work(HostWork{static_cast<double>(g.n) * 4, 0}, [&] {
        finite = grads_finite(g.grad, DType::fp32, g.n, params.grad_scale, params.clip, pool_, config_.isa);
      });
    }
  }
  if (on_device) {
    auto* host = static_cast<unsigned int*>(host_counter_.data());
    device_.copy_async(host, device_counter_, sizeof(unsigned int), CopyKind::device_to_host, compute_);
    device_.stream_synchronize(compute_);
    if (!phantom_ && *host != 0) finite = false;
  }
  return finite;
}

void UpdateScheduler::begin_phase(const Plan& plan) {
  const AllocatorStats before = allocator_.stats();
  place_residents(plan.placement);

  // Everything the loop needs is sized here, so the loop itself allocates nothing.
  const std::size_t n = state_.size();
  const std::size_t events_needed = 2 * (3 * n + 4);
  while (events_.size() < events_needed) events_.push_back(device_.create_event(true));
  next_event_ = 0;
  ops_.clear();
  ops_.reserve(3 * n + 4);
  streamed_.clear();
  streamed_index_.assign(n, 0);
  std::size_t largest = 0;
  bool grads_from_host = false;
  for (std::size_t i = 0; i < n; ++i) {
    if (plan.placement[i] != Placement::gpu) continue;
    streamed_index_[i] = streamed_.size();
    streamed_.push_back(i);
    largest = std::max(largest, state_[i].n);
    grads_from_host = grads_from_host || state_[i].device_grad == nullptr;
  }
  prefetched_.assign(streamed_.size(), Event{});
  cpu_count_ = 0;
  cpu_busy_ns_ = 0;
  cpu_params_ = 0;
  cpu_ops_ = 0;
  cpu_nonfinite_ = false;
  params_[0] = params_[1] = params_[2] = 0;

  const std::size_t slots = std::min(plan.gpu_slots, streamed_.size());
  const std::size_t slot_bytes = (grads_from_host ? 4 : 3) * round_up(largest * sizeof(float), kDeviceAlign);
  slots_.clear();
  for (std::size_t s = 0; s < slots; ++s) {
    slots_.push_back(carve(allocator_.allocate(slot_bytes, config_.main_stream), largest, grads_from_host));
  }
  slot_free_.assign(slots, Event{});
  last_slot_bytes_ = slots * slot_bytes;
  std::fill(staging_free_.begin(), staging_free_.end(), Event{});
  staged_.assign(streamed_.size(), NvmeStaging::Staged{});
  const std::vector<bool> on_nvme = spilled();
  nvme_active_ = std::find(on_nvme.begin(), on_nvme.end(), true) != on_nvme.end();
  if (nvme_active_) {
    if (nvme_ == nullptr) {
      throw InvalidArgument("UpdateScheduler::run: a subgroup's state is on NVMe but the scheduler has no NvmeStaging");
    }
    // Reads in the order the loop below asks for them. Subgroups prefetched to the GPU hold
    // their staging until flushed: buffers for them on top of the read-ahead, or a read could
    // wait for a buffer only a later update frees.
    std::vector<std::size_t> order = nvme_read_order(plan.placement, on_nvme, slots);
    for (std::size_t& i : order) i = state_[i].nvme_subgroup;
    // Parts of one subgroup with other work between them keep its buffer across that work.
    std::size_t gapped = 0;
    std::vector<char> seen(order.empty() ? 0 : *std::max_element(order.begin(), order.end()) + 1, 0);
    for (std::size_t k = 0; k < order.size(); ++k) {
      if (k > 0 && order[k] == order[k - 1]) continue;
      gapped += seen[order[k]] != 0;
      seen[order[k]] = 1;
    }
    nvme_->begin(order, nvme_staging_buffers(plan.placement, on_nvme, slots, nvme_read_ahead_) + gapped);
  }
  setup_stats_ = allocator_.stats();
  setup_allocations_ = setup_stats_.allocation[0].allocated - before.allocation[0].allocated;

  // The phase starts after the training stream's work (the backward that produced the grads).
  device_.record_event(phase_start_, config_.main_stream);
  for (Stream s : {prefetch_, upload_, compute_, flush_}) device_.stream_wait_event(s, phase_start_);
  for (std::size_t j = 0; j < slots; ++j) prefetch_in(j);
}

// async_prefetch_in: p, m, v (and the host gradient) into the slot, once its last flush is done.
void UpdateScheduler::prefetch_in(std::size_t j) {
  const std::size_t i = streamed_[j];
  const Subgroup& g = state_[i];
  const std::size_t slot = j % slots_.size();
  const Arrays& s = slots_[slot];
  const std::size_t bytes = g.n * sizeof(float);
  const bool grad = g.device_grad == nullptr;
  const NvmeStaging::Staged h = staged_[j] = host_state(i);  // NVMe -> pinned staging first
  prefetched_[j] = enqueue(OpKind::h2d, "prefetch", i, prefetch_, slot_free_[slot], static_cast<double>(bytes * (grad ? 4 : 3)), 0, [&] {
    device_.copy_async(s.p, h.p, bytes, CopyKind::host_to_device, prefetch_);
    device_.copy_async(s.m, h.m, bytes, CopyKind::host_to_device, prefetch_);
    device_.copy_async(s.v, h.v, bytes, CopyKind::host_to_device, prefetch_);
    if (grad) device_.copy_async(s.g, g.grad, bytes, CopyKind::host_to_device, prefetch_);
  });
}

// gpu_update + async_flush_out, and the prefetch that reuses the slot (lookahead = slots).
void UpdateScheduler::gpu_update(std::size_t j, const StepParams& params) {
  const std::size_t i = streamed_[j];
  const Subgroup& g = state_[i];
  const std::size_t slot = j % slots_.size();
  const Arrays& s = slots_[slot];
  AdamwArgs a = args_for(params, i);
  a.param = s.p;
  a.exp_avg = s.m;
  a.exp_avg_sq = s.v;
  a.grad = g.device_grad != nullptr ? static_cast<const void*>(g.device_grad) : s.g;
  const double n = static_cast<double>(g.n);
  const Event stepped = enqueue(OpKind::gpu, "gpu update", i, compute_, prefetched_[j], n * adamw_bytes_per_param(DType::fp32, a.param_out_dtype),
                                n, [&] { adamw_step_async(device_, compute_, a); });
  const std::size_t bytes = g.n * sizeof(float);
  const NvmeStaging::Staged h = staged_[j];
  before_host_write(i, h);  // the flush may land any time once queued
  slot_free_[slot] = enqueue(OpKind::d2h, "flush", i, flush_, stepped, static_cast<double>(3 * bytes), 0, [&] {
    device_.copy_async(h.p, s.p, bytes, CopyKind::device_to_host, flush_);
    device_.copy_async(h.m, s.m, bytes, CopyKind::device_to_host, flush_);
    device_.copy_async(h.v, s.v, bytes, CopyKind::device_to_host, flush_);
  });
  if (g.on_nvme()) nvme_->release(g.nvme_subgroup, slot_free_[slot]);  // written back behind the flush
  params_[static_cast<int>(Placement::gpu)] += g.n;
  if (j + slots_.size() < streamed_.size()) prefetch_in(j + slots_.size());
}

// A static resident: state already on the GPU; only a host gradient has to come over.
void UpdateScheduler::static_update(std::size_t i, const StepParams& params) {
  const Subgroup& g = state_[i];
  const Arrays& r = residents_[i];
  const std::size_t bytes = g.n * sizeof(float);
  Event grad_ready{};
  if (g.device_grad == nullptr) {
    grad_ready = enqueue(OpKind::h2d, "grad upload", i, upload_, Event{}, static_cast<double>(bytes), 0, [&] {
      device_.copy_async(r.g, g.grad, bytes, CopyKind::host_to_device, upload_);
    });
  }
  AdamwArgs a = args_for(params, i);
  a.param = r.p;
  a.exp_avg = r.m;
  a.exp_avg_sq = r.v;
  a.grad = g.device_grad != nullptr ? static_cast<const void*>(g.device_grad) : r.g;
  const double n = static_cast<double>(g.n);
  enqueue(OpKind::gpu, "gpu update", i, compute_, grad_ready, n * adamw_bytes_per_param(DType::fp32, a.param_out_dtype), n,
          [&] { adamw_step_async(device_, compute_, a); });
  params_[static_cast<int>(Placement::gpu_static)] += g.n;
}

// cpu_update with the fused downscale into pinned staging, then the H2D of the low-precision copy.
void UpdateScheduler::cpu_update(std::size_t i, const StepParams& params) {
  Subgroup& g = state_[i];
  const std::size_t b = cpu_count_++ % staging_.size();
  const std::size_t bytes = g.n * sizeof(float);
  // Algorithm 1's only waits inside the loop: the staging buffer must have left for the GPU
  // before the CPU overwrites it, and a gradient kept on the GPU must be on the host.
  if (staging_free_[b].valid()) device_.event_synchronize(staging_free_[b]);
  if (g.device_grad != nullptr) {
    enqueue(OpKind::d2h, "grad to host", i, flush_, Event{}, static_cast<double>(bytes), 0, [&] {
      device_.copy_async(g.grad, g.device_grad, bytes, CopyKind::device_to_host, flush_);
    });
    device_.stream_synchronize(flush_);
  }
  const NvmeStaging::Staged h = host_state(i);  // waits for an NVMe read, if any
  AdamwArgs a = args_for(params, i);
  a.param = h.p;
  a.exp_avg = h.m;
  a.exp_avg_sq = h.v;
  a.grad = g.grad;
  // On a device whose memory is host memory (params on CPU tensors, a SimDevice) the kernel writes
  // the model's low-precision copy where it lives: the upload below then moves nothing, and the
  // device still counts its time. Elsewhere the copy waits in pinned staging for the upload.
  const bool in_place = g.model_param != nullptr && device_.properties().host_addressable;
  if (a.param_out != nullptr) a.param_out = in_place ? g.model_param : staging_[b].data();
  // The model's copy is next read by the forward after the whole step, not by this subgroup's
  // upload: whether it survives in cache until then depends on the step's size, not the piece's.
  if (in_place) a.out_stores = resolve_out_stores(OutStores::automatic, state_.total_params());

  const double n = static_cast<double>(g.n);
  before_host_write(i, h);
  const double cpu_start = host_now_ns() - phase_start_ns_;
  cpu_busy_ns_ += device_.run_host_work(HostWork{n * adamw_bytes_per_param(DType::fp32, a.param_out_dtype), n},
                                        [&] { cpu_nonfinite_ = cpu_step(i, a) || cpu_nonfinite_; });
  cpu_log_.push_back(TieringOp{"cpu update", i, cpu_start, host_now_ns() - phase_start_ns_,
                               n * adamw_bytes_per_param(DType::fp32, a.param_out_dtype)});
  if (g.on_nvme()) nvme_->release(g.nvme_subgroup);  // written back behind
  cpu_params_ += static_cast<double>(g.n);
  ++cpu_ops_;
  params_[static_cast<int>(Placement::cpu)] += g.n;

  if (g.model_param != nullptr) {
    const std::size_t out_bytes = g.n * dtype_size(a.param_out_dtype);
    void* staged = in_place ? g.model_param : staging_[b].data();
    staging_free_[b] = enqueue(OpKind::h2d, "param upload", i, upload_, Event{}, static_cast<double>(out_bytes), 0, [&] {
      device_.copy_async(g.model_param, staged, out_bytes, CopyKind::host_to_device, upload_);
    });
  }
}

// The fused step over subgroup i: one call over the host gradient array, or one per run of it
// between the gradients read where they lie (set_grad_pieces) and one per such gradient.
bool UpdateScheduler::cpu_step(std::size_t i, const AdamwArgs& whole) {
  if (i >= grad_pieces_.size() || grad_pieces_[i].empty()) return adamw_step(whole, pool_, config_.isa);
  const std::size_t out_elem = whole.param_out == nullptr ? 0 : dtype_size(whole.param_out_dtype);
  auto part = [&](std::size_t b, std::size_t e, const void* grad, DType dtype) {
    if (e <= b) return false;
    AdamwArgs a = whole;
    a.param += b;
    a.exp_avg += b;
    a.exp_avg_sq += b;
    if (a.param_out != nullptr) a.param_out = static_cast<unsigned char*>(a.param_out) + b * out_elem;
    a.grad = grad;
    a.grad_dtype = dtype;
    a.n = e - b;
    return adamw_step(a, pool_, config_.isa);
  };
  const auto* host = static_cast<const float*>(whole.grad);
  bool bad = false;
  std::size_t at = 0;
  for (const GradPiece& piece : grad_pieces_[i]) {
    bad = part(at, piece.begin, host + at, DType::fp32) || bad;
    bad = part(piece.begin, piece.end, piece.data, piece.dtype) || bad;
    at = piece.end;
  }
  return part(at, whole.n, host + at, DType::fp32) || bad;
}

void UpdateScheduler::set_grad_pieces(std::size_t i, std::vector<GradPiece> pieces) {
  if (i >= state_.size()) {
    throw InvalidArgument("UpdateScheduler::set_grad_pieces: subgroup " + std::to_string(i) + " of " +
                          std::to_string(state_.size()));
  }
  std::size_t at = 0;
  for (const GradPiece& p : pieces) {
    if (p.begin < at || p.end <= p.begin || p.end > state_[i].n || p.data == nullptr ||
        (p.dtype != DType::fp32 && p.dtype != DType::fp16 && p.dtype != DType::bf16)) {
      throw InvalidArgument("UpdateScheduler::set_grad_pieces: piece [" + std::to_string(p.begin) + ", " +
                            std::to_string(p.end) + ") of subgroup " + std::to_string(i) + " (" +
                            std::to_string(state_[i].n) + " elements) is empty, out of order, past the end, "
                            "null or not fp32/fp16/bf16");
    }
    at = p.end;
  }
  if (grad_pieces_.size() < state_.size()) grad_pieces_.resize(state_.size());
  grad_pieces_[i] = std::move(pieces);
}

StepReport UpdateScheduler::end_phase(double phase_start_ns) {
  for (Stream s : {prefetch_, upload_, compute_, flush_}) device_.stream_synchronize(s);
  for (auto& pieces : grad_pieces_) pieces.clear();  // for one run only
  StepReport r;
  // The phase ends with the last write-back; a failed one is rethrown once the rest is done.
  std::exception_ptr nvme_error;
  if (nvme_active_) {
    try {
      r.nvme = nvme_->finish();
    } catch (...) {
      nvme_error = std::current_exception();
    }
    r.nvme_transfers = nvme_->take_transfers();
  }
  r.phase_ns = host_now_ns() - phase_start_ns;
  const AllocatorStats after = allocator_.stats();
  r.setup_allocations = setup_allocations_;
  r.loop_allocations = after.allocation[0].allocated - setup_stats_.allocation[0].allocated;
  r.loop_device_allocs = after.num_device_alloc - setup_stats_.num_device_alloc;
  for (const Arrays& s : slots_) allocator_.deallocate(s.block, config_.main_stream);
  slots_.clear();

  std::vector<Interval> spans[3];
  ResourceUse* use[3] = {&r.h2d, &r.d2h, &r.gpu};
  for (const Op& op : ops_) {
    const int k = static_cast<int>(op.kind);
    const double t0 = static_cast<double>(device_.event_elapsed_ms(phase_start_, op.start)) * 1e6;
    const double t1 = static_cast<double>(device_.event_elapsed_ms(phase_start_, op.end)) * 1e6;
    spans[k].push_back(Interval{t0, t1});
    r.ops.push_back(TieringOp{op.what, op.subgroup, t0, t1, op.bytes});
    use[k]->bytes += op.bytes;
    use[k]->params += op.params;
    use[k]->ops += 1;
  }
  for (int k = 0; k < 3; ++k) use[k]->busy_ns = merge(spans[k]);
  r.h2d_d2h_overlap_ns = overlap(spans[0], spans[1]);
  r.ops.insert(r.ops.end(), cpu_log_.begin(), cpu_log_.end());
  r.phase_start_ns = phase_start_ns;
  r.cpu.busy_ns = cpu_busy_ns_;
  r.cpu.params = cpu_params_;
  r.cpu.ops = cpu_ops_;
  r.cpu_nonfinite = cpu_nonfinite_;
  r.cpu.bytes = cpu_params_ * adamw_bytes_per_param(DType::fp32, state_.model_dtype());
  r.params_cpu = params_[static_cast<int>(Placement::cpu)];
  r.params_gpu = params_[static_cast<int>(Placement::gpu)];
  r.params_gpu_static = params_[static_cast<int>(Placement::gpu_static)];
  if (nvme_error) std::rethrow_exception(nvme_error);
  return r;
}

}  // namespace memtide::tiering
