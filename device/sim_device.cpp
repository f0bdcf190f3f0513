#include "memtide/device/sim_device.hpp"

#include <cmath>

#include <utility>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "memtide/core/error.hpp"
#include "memtide/core/os.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/options.hpp"

namespace memtide {
namespace {
constexpr std::size_t kAlignment = 256;  // cudaMalloc's guarantee
// Phantom addresses live far above any real heap so a stray dereference faults loudly.
constexpr std::uintptr_t kPhantomBase = std::uintptr_t{0x6d74} << 32;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
}  // namespace

// ---------------------------------------------------------------------------------------------
// DramTimeline

std::map<double, double>::iterator SimDevice::DramTimeline::split_at(double t) {
  auto it = steps_.upper_bound(t);
  auto prev = std::prev(it);  // steps_ always holds a key <= any t >= 0
  if (prev->first == t) return prev;
  return steps_.emplace_hint(it, t, prev->second);
}

double SimDevice::DramTimeline::reserve(double t0, double bytes, double max_rate, double dram_factor) {
  if (bytes <= 0) return t0;
  const auto finite_end = [&](double end) {
    // A rate so small that the transfer ends past any representable time: a clock at infinity
    // would stall every later operation behind it, so say so instead.
    if (!std::isfinite(end)) {
      char rates[96];
      std::snprintf(rates, sizeof rates, "at up to %g B/s (host DRAM %g B/s)", max_rate, capacity_);
      throw InvalidArgument("SimDevice: moving " + format_bytes(static_cast<std::uint64_t>(std::min(bytes, 1e19))) +
                            " " + rates + " ends past any representable time");
    }
    return end;
  };
  if (dram_factor <= 0) return finite_end(t0 + bytes / max_rate * 1e9);
  // The rate an idle DRAM gives this transfer. A step with less than a billionth of it left (at
  // most 1 B/s, as for the usual GB/s rates) is saturated: what is left there is rounding residue.
  // The threshold scales with the rates, so a slow machine still moves its bytes.
  const double full = std::min(max_rate, capacity_ / dram_factor);
  if (!(full > 0)) throw InvalidArgument("SimDevice: the host DRAM rate and the transfer's rate must be positive");
  const double saturated = std::min(1.0, full * 1e-9);
  auto it = split_at(t0);
  double remaining = bytes;
  double t = t0;
  for (;;) {
    auto next = std::next(it);
    const double seg_end = next == steps_.end() ? std::numeric_limits<double>::infinity() : next->first;
    const double avail = std::max(0.0, capacity_ - it->second);
    const double rate = std::min(max_rate, avail / dram_factor);  // bytes/s of the transfer
    if (rate > saturated) {
      const double can = rate * (seg_end - t) / 1e9;
      if (can >= remaining) {
        const double end = finite_end(t + remaining / rate * 1e9);
        // A rounding residue of a transfer that ended on a step boundary: reserving it would
        // add its rate to the whole next step (to infinity, if that step is the last).
        if (!(end > t)) return t;
        split_at(end);
        it->second += rate * dram_factor;
        return end;
      }
      remaining -= can;
      it->second += rate * dram_factor;
    }
    // The last step is never reserved (every transfer ends before it), so it always has the full
    // rate and the loop ends there; this guards the iterator all the same.
    if (next == steps_.end()) throw Error("SimDevice: the DRAM timeline's last step is saturated");
    t = seg_end;
    it = next;
  }
}

void SimDevice::DramTimeline::prune(double before) {
  auto keep = std::prev(steps_.upper_bound(before));
  steps_.erase(steps_.begin(), keep);
}

// ---------------------------------------------------------------------------------------------
// SimDevice

SimDevice::SimDevice(SimConfig config) : config_(config), dram_(config.host_dram_bytes_per_s) {
  props_.backend = "sim";
  props_.name = std::string("SimDevice (H100 model, ") + (config.phantom ? "phantom" : "data") + ")";
  props_.index = config.index;
  props_.total_memory = config.capacity;
  props_.copy_engines = 2;
  props_.stores_data = !config.phantom;
  props_.virtual_clock = true;
  props_.host_addressable = !config.phantom;
  next_phantom_ = kPhantomBase;
}

SimDevice::~SimDevice() = default;

double SimDevice::now_ns() {
  std::lock_guard lock(mutex_);
  return host_now_ns_;
}

void SimDevice::set_host_now_locked(double t) {
  if (t > host_now_ns_) {
    host_now_ns_ = t;
    dram_.prune(host_now_ns_);
  }
}

void SimDevice::advance_host(double ns) {
  std::lock_guard lock(mutex_);
  set_host_now_locked(host_now_ns_ + std::max(0.0, ns));
}

double SimDevice::host_work(double dram_bytes, double max_bytes_per_s) {
  if (!(max_bytes_per_s > 0)) throw InvalidArgument("SimDevice::host_work: rate must be positive");
  std::lock_guard lock(mutex_);
  const double start = host_now_ns_;
  const double end = dram_.reserve(start, dram_bytes, max_bytes_per_s, 1.0);
  set_host_now_locked(end);
  if (recording_) ops_.push_back(SimOp{"host", start, end, dram_bytes});
  return end - start;
}

double SimDevice::enqueue_collective(Stream stream, double bytes, double bytes_per_s) {
  if (!(bytes >= 0) || !(bytes_per_s > 0) || !std::isfinite(bytes) || !std::isfinite(bytes_per_s)) {
    throw InvalidArgument("SimDevice::enqueue_collective: bytes must be >= 0 and bytes_per_s > 0, got " +
                          std::to_string(bytes) + " and " + std::to_string(bytes_per_s));
  }
  std::lock_guard lock(mutex_);
  return schedule_locked(stream_locked(stream), link_, std::max(bytes, 1.0), bytes_per_s, 0.0);
}

void SimDevice::do_enqueue_storage(Stream stream, double bytes, double bytes_per_s) {
  std::lock_guard lock(mutex_);
  (void)schedule_locked(stream_locked(stream), storage_, std::max(bytes, 1.0), bytes_per_s, 0.0);
}

void SimDevice::record_ops(bool on) {
  std::lock_guard lock(mutex_);
  recording_ = on;
}

std::vector<SimOp> SimDevice::take_ops() {
  std::lock_guard lock(mutex_);
  return std::exchange(ops_, {});
}

SimEngineStats SimDevice::link_stats() {
  std::lock_guard lock(mutex_);
  return link_.stats;
}

SimEngineStats SimDevice::storage_stats() {
  std::lock_guard lock(mutex_);
  return storage_.stats;
}

double SimDevice::enqueue_compute(Stream stream, double hbm_bytes, const std::function<void()>& body, double min_ns) {
  if (!(hbm_bytes >= 0) || !(min_ns >= 0)) {
    throw InvalidArgument("SimDevice::enqueue_compute: hbm_bytes and min_ns must be >= 0, got " +
                          std::to_string(hbm_bytes) + " and " + std::to_string(min_ns));
  }
  double end = 0;
  {
  std::lock_guard lock(mutex_);
  // The kernel runs at HBM speed unless min_ns says it is compute-bound: lower the rate to fit.
  double rate = config_.hbm_bytes_per_s;
  if (min_ns > 0 && hbm_bytes / rate * 1e9 < min_ns) rate = hbm_bytes > 0 ? hbm_bytes / min_ns * 1e9 : 0;
  if (rate > 0) {
    end = schedule_locked(stream_locked(stream), compute_, hbm_bytes, rate, 0.0);
  } else {  // no bytes: a pure-latency (or min_ns) kernel
    end = schedule_locked(stream_locked(stream), compute_, 1.0, 1e9 / std::max(min_ns, 1e-3), 0.0);
  }
  }
  // Outside the lock: the simulated kernel may be long, and it touches only memory it was given.
  if (!config_.phantom && body) body();
  return end;
}

void SimDevice::do_enqueue_kernel(Stream stream, const DeviceKernel& kernel) {
  const double rate = config_.gpu_update_params_per_s;
  const double min_ns = kernel.params > 0 && rate > 0 ? kernel.params / rate * 1e9 : 0.0;
  enqueue_compute(stream, kernel.hbm_bytes, kernel.host, min_ns);
}

bool SimDevice::do_can_run(const DeviceKernel& kernel) const { return static_cast<bool>(kernel.host); }

double SimDevice::do_host_now_ns() { return now_ns(); }

double SimDevice::do_run_host_work(const HostWork& work, const std::function<void()>& body) {
  if (!config_.phantom && body) body();
  if (work.params > 0) {
    // A CPU optimizer step: at most cpu_update_params_per_s, and no faster than DRAM allows.
    const double per_param = work.dram_bytes / work.params;
    if (per_param > 0) return host_work(work.dram_bytes, config_.cpu_update_params_per_s * per_param);
    const double ns = work.params / config_.cpu_update_params_per_s * 1e9;
    advance_host(ns);
    return ns;
  }
  if (work.dram_bytes > 0) return host_work(work.dram_bytes, config_.host_dram_bytes_per_s);
  return 0;
}

double SimDevice::stream_ready_ns(Stream stream) {
  std::lock_guard lock(mutex_);
  return stream_locked(stream).ready_ns;
}

SimEngineStats SimDevice::h2d_stats() {
  std::lock_guard lock(mutex_);
  return h2d_.stats;
}
SimEngineStats SimDevice::d2h_stats() {
  std::lock_guard lock(mutex_);
  return d2h_.stats;
}
SimEngineStats SimDevice::compute_stats() {
  std::lock_guard lock(mutex_);
  return compute_.stats;
}

std::size_t SimDevice::used_bytes() {
  std::lock_guard lock(mutex_);
  return used_;
}

void* SimDevice::do_allocate(std::size_t bytes) {
  // A size within kAlignment of SIZE_MAX rounds up past zero: it must fail as the size it is.
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  const std::size_t rounded = bytes > kMax - kAlignment ? kMax : round_up(bytes, kAlignment);
  std::lock_guard lock(mutex_);
  if (rounded > config_.capacity - used_) {
    throw OutOfMemory("SimDevice " + std::to_string(config_.index) + ": cannot allocate " +
                      format_bytes(bytes) + ": " + format_bytes(used_) + " of " +
                      format_bytes(config_.capacity) + " in use");
  }
  std::uintptr_t addr = 0;
  Allocation a{rounded, {nullptr, &std::free}};
  if (config_.phantom) {
    addr = next_phantom_;
    next_phantom_ += rounded;
  } else {
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      throw OutOfMemory("SimDevice: host memory backing " + format_bytes(bytes) + " could not be allocated");
    }
    a.data.reset(static_cast<unsigned char*>(p));
    addr = reinterpret_cast<std::uintptr_t>(p);
  }
  allocations_.emplace(addr, std::move(a));
  used_ += rounded;
  return reinterpret_cast<void*>(addr);
}

void SimDevice::do_deallocate(void* ptr, std::size_t /*bytes*/) {
  std::lock_guard lock(mutex_);
  auto it = allocations_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == allocations_.end()) {
    throw InvalidArgument("SimDevice::deallocate: pointer was not allocated by this device");
  }
  // Like cudaFree: wait for all queued work before the memory goes away.
  double all_done = std::max(default_stream_.ready_ns, host_now_ns_);
  for (auto& [h, s] : streams_) all_done = std::max(all_done, s->ready_ns);
  set_host_now_locked(all_done);
  used_ -= it->second.bytes;
  allocations_.erase(it);
}

// ---- virtual memory ----

namespace {
constexpr std::size_t kGranule = 2ULL << 20;  // CUDA's minimum granularity on current GPUs
}

std::size_t SimDevice::do_vmm_granularity() { return kGranule; }

void* SimDevice::do_reserve_address(std::size_t bytes) {
  std::lock_guard lock(mutex_);
  std::uintptr_t base = 0;
  if (config_.phantom) {
    base = round_up(next_phantom_, kGranule);
    next_phantom_ = base + bytes;
  } else {
    int err = 0;
    void* p = os::reserve(bytes, kGranule, err);
    if (p == nullptr) {
      throw OutOfMemory("SimDevice: reserving " + format_bytes(bytes) + " of address space failed: " +
                        std::strerror(err));
    }
    base = reinterpret_cast<std::uintptr_t>(p);
  }
  reservations_.emplace(base, bytes);
  return reinterpret_cast<void*>(base);
}

void SimDevice::do_release_address(void* base, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  auto it = reservations_.find(addr);
  if (it == reservations_.end() || it->second != bytes) {
    throw InvalidArgument("SimDevice::release_address: not a reservation of this device (or not its size)");
  }
  auto m = mapped_.lower_bound(addr);
  if (m != mapped_.end() && m->first < addr + bytes) {
    throw InvalidArgument("SimDevice::release_address: " + format_bytes(m->second) + " are still mapped in it");
  }
  if (!config_.phantom) (void)os::unmap(base, bytes);
  reservations_.erase(it);
}

void SimDevice::do_map_memory(void* at, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(at);
  auto r = reservations_.upper_bound(addr);
  if (r == reservations_.begin() || addr + bytes > std::prev(r)->first + std::prev(r)->second) {
    throw InvalidArgument("SimDevice::map_memory: the range is not inside a reservation of this device");
  }
  auto m = mapped_.upper_bound(addr);
  if ((m != mapped_.end() && m->first < addr + bytes) ||
      (m != mapped_.begin() && std::prev(m)->first + std::prev(m)->second > addr)) {
    throw InvalidArgument("SimDevice::map_memory: part of the range is mapped already");
  }
  if (bytes > config_.capacity - used_) {
    throw OutOfMemory("SimDevice " + std::to_string(config_.index) + ": cannot map " + format_bytes(bytes) + ": " +
                      format_bytes(used_) + " of " + format_bytes(config_.capacity) + " in use");
  }
  if (!config_.phantom) {
    if (const int err = os::protect(at, bytes, true); err != 0) {
      throw OutOfMemory("SimDevice: mapping " + format_bytes(bytes) + " failed: " + std::strerror(err));
    }
  }
  // One physical allocation per granule, as CudaDevice makes them: any run can be unmapped.
  for (std::size_t off = 0; off < bytes; off += kGranule) mapped_.emplace(addr + off, kGranule);
  used_ += bytes;
}

void SimDevice::do_unmap_memory(void* at, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(at);
  std::size_t found = 0;
  for (auto m = mapped_.find(addr); m != mapped_.end() && m->first == addr + found && found < bytes; ++m) {
    found += m->second;
  }
  if (found != bytes) {
    throw InvalidArgument("SimDevice::unmap_memory: part of the range is not mapped");
  }
  // Like cudaFree: queued work finishes before the memory goes away.
  double all_done = std::max(default_stream_.ready_ns, host_now_ns_);
  for (auto& [h, st] : streams_) all_done = std::max(all_done, st->ready_ns);
  set_host_now_locked(all_done);
  if (!config_.phantom) {
    (void)os::discard(at, bytes);  // the granules' contents are gone, as on a GPU
    (void)os::protect(at, bytes, false);
  }
  mapped_.erase(mapped_.find(addr), mapped_.lower_bound(addr + bytes));
  used_ -= bytes;
}

Stream SimDevice::do_create_stream() {
  auto s = std::make_unique<SimStream>();
  s->ready_ns = 0;
  void* handle = s.get();
  std::lock_guard lock(mutex_);
  streams_.emplace(handle, std::move(s));
  return Stream{handle};
}

void SimDevice::do_destroy_stream(Stream stream) {
  std::lock_guard lock(mutex_);
  if (streams_.erase(stream.handle) == 0) throw InvalidArgument("SimDevice::destroy_stream: unknown stream");
}

Event SimDevice::do_create_event(bool /*timing*/) {
  auto e = std::make_unique<SimEvent>();
  void* handle = e.get();
  std::lock_guard lock(mutex_);
  events_.emplace(handle, std::move(e));
  return Event{handle};
}

void SimDevice::do_destroy_event(Event event) {
  std::lock_guard lock(mutex_);
  if (events_.erase(event.handle) == 0) throw InvalidArgument("SimDevice::destroy_event: unknown event");
}

SimDevice::SimStream& SimDevice::stream_locked(Stream stream) {
  if (stream.handle == nullptr) return default_stream_;
  auto it = streams_.find(stream.handle);
  if (it == streams_.end()) throw InvalidArgument("SimDevice: unknown stream handle");
  return *it->second;
}

SimDevice::SimEvent& SimDevice::event_locked(Event event) {
  auto it = events_.find(event.handle);
  if (it == events_.end()) throw InvalidArgument("SimDevice: unknown event handle");
  return *it->second;
}

void SimDevice::do_record_event(Event event, Stream stream) {
  std::lock_guard lock(mutex_);
  SimStream& s = stream_locked(stream);
  event_locked(event).time_ns = std::max(s.ready_ns, host_now_ns_);
}

void SimDevice::do_stream_wait_event(Stream stream, Event event) {
  std::lock_guard lock(mutex_);
  SimStream& s = stream_locked(stream);
  s.ready_ns = std::max(s.ready_ns, event_locked(event).time_ns);
}

bool SimDevice::do_event_query(Event event) {
  std::lock_guard lock(mutex_);
  return event_locked(event).time_ns <= host_now_ns_;
}

double SimDevice::event_time_ns(Event event) {
  std::lock_guard lock(mutex_);
  return event_locked(event).time_ns;
}

void SimDevice::do_event_synchronize(Event event) {
  std::lock_guard lock(mutex_);
  set_host_now_locked(event_locked(event).time_ns);
}

float SimDevice::do_event_elapsed_ms(Event start, Event end) {
  std::lock_guard lock(mutex_);
  const SimEvent& a = event_locked(start);
  const SimEvent& b = event_locked(end);
  if (a.time_ns > host_now_ns_ || b.time_ns > host_now_ns_) {
    throw InvalidArgument("SimDevice::event_elapsed_ms: event has not completed");
  }
  return static_cast<float>((b.time_ns - a.time_ns) / 1e6);
}

void SimDevice::do_stream_synchronize(Stream stream) {
  std::lock_guard lock(mutex_);
  set_host_now_locked(stream_locked(stream).ready_ns);
}

void SimDevice::do_synchronize() {
  std::lock_guard lock(mutex_);
  double t = default_stream_.ready_ns;
  for (auto& [h, s] : streams_) t = std::max(t, s->ready_ns);
  set_host_now_locked(t);
}

void SimDevice::check_device_range_locked(const void* ptr, std::size_t bytes, const char* what) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = allocations_.upper_bound(addr);
  if (it != allocations_.begin()) {
    --it;
    if (addr >= it->first && addr + bytes <= it->first + it->second.bytes) return;
  }
  // Or inside mapped virtual memory, across adjacent mappings.
  auto m = mapped_.upper_bound(addr);
  if (m != mapped_.begin()) {
    --m;
    std::uintptr_t covered = m->first;
    for (; m != mapped_.end() && m->first == covered && covered < addr + bytes; ++m) covered += m->second;
    if (covered >= addr + bytes) return;
  }
  throw InvalidArgument(std::string("SimDevice: ") + what + " range of " + format_bytes(bytes) +
                        " is not inside device memory allocated by this device");
}

bool SimDevice::host_pinned_locked(const void* ptr, std::size_t bytes) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = registered_.upper_bound(addr);
  if (it == registered_.begin()) return false;
  --it;
  return addr >= it->first && addr + bytes <= it->first + it->second;
}

double SimDevice::schedule_locked(SimStream& s, Engine& engine, double bytes, double rate, double dram_factor) {
  double start = std::max({s.ready_ns, engine.free_ns, host_now_ns_}) + config_.op_latency_ns;
  if (&engine == &compute_ && dram_factor == 0) {
    // A GPU runs kernels of several streams at once, sharing its SMs: a kernel starts as soon as
    // its stream is ready and is stretched by the work of kernels already running beside it
    // (the engine does the same total work; what ran first keeps its times). A copy engine, by
    // contrast, serves its queue in order.
    const double length = bytes / rate * 1e9;
    start = std::max(s.ready_ns, host_now_ns_) + config_.op_latency_ns;
    double end = start + length;
    // A kernel that started more than the longest one's length (twice, and a ns, against
    // rounding) before `t` ended before it: the walks below start there, not at the first kernel
    // the host queued, which made a phase of n kernels cost n^2.
    const auto reach = [this](double t) { return compute_busy_.lower_bound(t - 2 * compute_longest_ns_ - 1); };
    for (int pass = 0; pass < 8; ++pass) {  // the stretch adds overlap of its own: a few rounds
      double shared = 0;
      for (auto it = reach(start); it != compute_busy_.end() && it->first < end; ++it) {
        shared += std::max(0.0, std::min(it->second, end) - std::max(it->first, start));
      }
      const double next = start + length + shared;
      if (next <= end * (1 + 1e-12)) break;
      end = next;
    }
    const auto own = compute_busy_.emplace(end - length, end);  // where this kernel's own work is counted
    compute_longest_ns_ = std::max(compute_longest_ns_, own->second - own->first);
    // Nothing can start before the host's clock: work that ended before it is gone.
    const auto gone = reach(host_now_ns_);
    compute_busy_.erase(compute_busy_.begin(), gone);
    for (auto it = gone; it != compute_busy_.end() && it->first < host_now_ns_;) {
      it = it->second < host_now_ns_ ? compute_busy_.erase(it) : std::next(it);
    }
    engine.free_ns = std::max(engine.free_ns, end);
    engine.stats.busy_ns += length + config_.op_latency_ns;
    engine.stats.bytes += bytes;
    engine.stats.ops += 1;
    s.ready_ns = end;
    if (recording_) ops_.push_back(SimOp{engine.name, start, end, bytes});
    return end;
  }
  const double end = dram_.reserve(start, bytes, rate, dram_factor);
  engine.free_ns = end;
  engine.stats.busy_ns += end - start + config_.op_latency_ns;
  engine.stats.bytes += bytes;
  engine.stats.ops += 1;
  s.ready_ns = end;
  if (recording_) ops_.push_back(SimOp{engine.name, start, end, bytes});
  return end;
}

void SimDevice::do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) {
  std::lock_guard lock(mutex_);
  SimStream& s = stream_locked(stream);
  const double n = static_cast<double>(bytes);
  switch (kind) {
    case CopyKind::host_to_device: {
      check_device_range_locked(dst, bytes, "H2D destination");
      // A copy onto itself stands for the pinned upload that the CPU step's in-place write replaced.
      const bool pinned = src == dst || host_pinned_locked(src, bytes);
      // A pageable copy is staged through a pinned bounce buffer: three passes over host DRAM.
      schedule_locked(s, h2d_, n, pinned ? config_.h2d_bytes_per_s : config_.h2d_pageable_bytes_per_s,
                      pinned ? 1.0 : 3.0);
      break;
    }
    case CopyKind::device_to_host: {
      check_device_range_locked(src, bytes, "D2H source");
      const bool pinned = host_pinned_locked(dst, bytes);
      schedule_locked(s, d2h_, n, pinned ? config_.d2h_bytes_per_s : config_.d2h_pageable_bytes_per_s,
                      pinned ? 1.0 : 3.0);
      break;
    }
    case CopyKind::device_to_device:
      check_device_range_locked(src, bytes, "D2D source");
      check_device_range_locked(dst, bytes, "D2D destination");
      schedule_locked(s, compute_, n, config_.hbm_bytes_per_s / 2.0, 0.0);  // read + write
      break;
  }
  // A copy onto itself (the CPU step wrote the model's copy in place) is timed but moves nothing.
  if (!config_.phantom && dst != src) std::memmove(dst, src, bytes);
}

void SimDevice::do_memset_async(void* ptr, int value, std::size_t bytes, Stream stream) {
  std::lock_guard lock(mutex_);
  check_device_range_locked(ptr, bytes, "memset");
  schedule_locked(stream_locked(stream), compute_, static_cast<double>(bytes), config_.hbm_bytes_per_s, 0.0);
  if (!config_.phantom) std::memset(ptr, value, bytes);
}

void SimDevice::do_host_register(void* ptr, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (host_pinned_locked(ptr, 1)) throw InvalidArgument("SimDevice::host_register: range already registered");
  registered_[addr] = bytes;
}

std::map<std::uintptr_t, std::size_t> SimDevice::registered_host_ranges() {
  std::lock_guard lock(mutex_);
  return registered_;
}

void SimDevice::do_host_unregister(void* ptr) {
  std::lock_guard lock(mutex_);
  if (registered_.erase(reinterpret_cast<std::uintptr_t>(ptr)) == 0) {
    throw InvalidArgument("SimDevice::host_unregister: pointer was not registered");
  }
}

MemInfo SimDevice::do_mem_info() {
  std::lock_guard lock(mutex_);
  return MemInfo{config_.capacity - used_, config_.capacity};
}

SimConfig sim_config_from_options() {
  const Options& o = options();
  SimConfig c;
  c.capacity = o.sim_capacity;
  c.phantom = o.sim_phantom;
  return c;
}

}  // namespace memtide
