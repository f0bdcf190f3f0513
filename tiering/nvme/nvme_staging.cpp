#include "memtide/tiering/nvme/nvme_staging.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"

namespace memtide::tiering {
namespace {

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

double wall_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// The store's calls, in one place: a build without the NVMe tier (no liburing or xxHash) still
// has the staging for the simulator's phantom device, which never reaches these.
#if MEMTIDE_HAVE_NVME
void store_read(NvmeStore& store, std::size_t extent, void* dst) { store.read(extent, dst); }
void store_write(NvmeStore& store, std::size_t extent, const void* src, std::uint64_t bytes) {
  store.write(extent, src, bytes);
}
std::size_t store_extents(const NvmeStore& store) { return store.subgroups(); }
#else
[[noreturn]] void no_nvme() {
  throw Error("memtide was built without the NVMe tier (it needs liburing-dev and libxxhash-dev)");
}
void store_read(NvmeStore&, std::size_t, void*) { no_nvme(); }
void store_write(NvmeStore&, std::size_t, const void*, std::uint64_t) { no_nvme(); }
std::size_t store_extents(const NvmeStore&) { no_nvme(); }
#endif

}  // namespace

NvmeStaging::NvmeStaging(Device& device, NvmeStore* store, const std::vector<std::size_t>& sizes,
                         const std::vector<bool>& spilled, std::size_t buffers, SlabSource* slabs,
                         double phantom_read_bytes_per_s, double phantom_write_bytes_per_s)
    : device_(device), store_(store), slabs_(slabs), phantom_(is_phantom(device)),
      timed_read_rate_(phantom_read_bytes_per_s), timed_write_rate_(phantom_write_bytes_per_s), sizes_(sizes),
      timed_storage_(device.times_storage()) {
  if (spilled.size() != sizes.size()) {
    throw InvalidArgument("NvmeStaging: " + std::to_string(spilled.size()) + " spill flags for " +
                          std::to_string(sizes.size()) + " subgroups");
  }
  if (buffers == 0) throw InvalidArgument("NvmeStaging: buffers = 0; at least one staging buffer is needed");
  index_.assign(sizes.size(), kNone);
  std::size_t extents = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (!spilled[i]) continue;
    index_[i] = extents++;
    largest_ = std::max(largest_, sizes[i]);
  }
  if (phantom_) {
    if (!(timed_read_rate_ > 0) || !(timed_write_rate_ > 0)) {
      throw InvalidArgument("NvmeStaging: a phantom device times the NVMe tier at stated rates; read and write "
                            "rates must be > 0");
    }
    if (!timed_storage_) {
      throw InvalidArgument("NvmeStaging: a phantom device must time storage transfers (Device::times_storage)");
    }
  } else {
    if (store_ == nullptr) throw InvalidArgument("NvmeStaging: no NvmeStore on a device that stores data");
    if (store_extents(*store_) != extents) {
      throw InvalidArgument("NvmeStaging: the store holds " + std::to_string(store_extents(*store_)) + " extents for " +
                            std::to_string(extents) + " spilled subgroups");
    }
  }
  storage_ = device_.create_stream();
  buffer_of_.assign(sizes.size(), kNone);
  ready_.assign(sizes.size(), 0);
  uses_.assign(sizes.size(), 0);
  reserve(buffers);
  if (!phantom_) {
    read_thread_ = std::thread([this] { serve(Kind::read); });
    write_thread_ = std::thread([this] { serve(Kind::write); });
  }
}

NvmeStaging::~NvmeStaging() {
  if (read_thread_.joinable()) {
    {
      std::unique_lock lock(mutex_);
      wait_idle(lock);
      stop_ = true;
    }
    changed_.notify_all();
    read_thread_.join();
    write_thread_.join();
  }
  for (const Buffer& b : buffers_) {
    if (b.held) {
      MEMTIDE_LOG(error, "NvmeStaging: the newest state of subgroup " + std::to_string(b.owner) +
                             " was never written to NVMe (its write-back failed) and is dropped with the optimizer");
    }
  }
  for (Event e : read_done_) {
    if (e.valid()) device_.destroy_event(e);
  }
  for (Event e : transfer_done_) device_.destroy_event(e);
  if (phase_mark_.valid()) device_.destroy_event(phase_mark_);
  device_.destroy_stream(storage_);
}

std::uint64_t NvmeStaging::buffer_bytes() const {
  return round_up(std::max<std::uint64_t>(3 * sizeof(float) * largest_, 1), NvmeStore::kAlign);
}

void NvmeStaging::reserve(std::size_t buffers) {
  while (buffers_.size() < buffers) {
    Buffer b;
    b.memory = PinnedBuffer(device_, buffer_bytes(), slabs_);
    if (!phantom_ && reinterpret_cast<std::uintptr_t>(b.memory.data()) % NvmeStore::kAlign != 0) {
      throw InvalidArgument("NvmeStaging: a staging buffer is not 4 KiB aligned (direct I/O needs it)");
    }
    buffers_.push_back(std::move(b));
  }
}

std::uint64_t NvmeStaging::staging_bytes() const { return phantom_ ? 0 : buffers_.size() * buffer_bytes(); }

NvmeStaging::Staged NvmeStaging::view(std::size_t buffer, std::size_t subgroup) const {
  auto* base = static_cast<float*>(buffers_[buffer].memory.data());
  const std::size_t n = sizes_[subgroup];
  return Staged{base, base + n, base + 2 * n};
}

std::vector<std::size_t> NvmeStaging::held() const {
  std::lock_guard lock(mutex_);
  std::vector<std::size_t> out;
  for (const Buffer& b : buffers_) {
    if (b.held) out.push_back(b.owner);
  }
  return out;
}

std::size_t NvmeStaging::free_buffer() const {
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].owner == kNone) return b;
  }
  return kNone;
}

// ---- a phase --------------------------------------------------------------------------------

void NvmeStaging::begin(const std::vector<std::size_t>& order, std::size_t buffers) {
  {
    std::unique_lock lock(mutex_);
    wait_idle(lock);
    error_ = nullptr;
    reads_stopped_ = false;
  }
  // What a failed write-back left in memory goes first: nothing else may reuse its buffer.
  for (Buffer& b : buffers_) {
    if (!b.held) continue;
    const Staged s = view(static_cast<std::size_t>(&b - buffers_.data()), b.owner);
    store_write(*store_, index_[b.owner], s.p, 3 * sizeof(float) * sizes_[b.owner]);
    b.held = false;
    b.owner = kNone;
  }
  for (std::size_t i : order) {
    if (i >= sizes_.size() || index_[i] == kNone) {
      throw InvalidArgument("NvmeStaging::begin: subgroup " + std::to_string(i) + " is not on NVMe");
    }
  }
  reserve(buffers);
  // A subgroup asked for more than once (parts of it with gaps between) is read once, at its
  // first use, and written back after its last: never read again while its update is unwritten.
  std::fill(uses_.begin(), uses_.end(), 0);
  order_.clear();
  for (std::size_t i : order) {
    if (uses_[i]++ == 0) order_.push_back(i);
  }
  next_read_ = 0;
  std::fill(buffer_of_.begin(), buffer_of_.end(), kNone);
  std::fill(ready_.begin(), ready_.end(), 0);
  for (Buffer& b : buffers_) b.owner = kNone;
  use_ = NvmeUse{};
  phase_start_ns_ = device_.host_now_ns();
  {
    std::lock_guard lock(mutex_);
    transfers_.clear();
    transfers_.reserve(3 * order_.size());  // a read, a wait and a write-back per subgroup
  }
  timed_transfers_ = 0;
  if (phantom_) {
    if (!phase_mark_.valid()) phase_mark_ = device_.create_event(true);
    device_.record_event(phase_mark_, storage_);  // idle since the last finish(): now
  }
  if (timed_storage_) {
    read_done_.resize(sizes_.size());
    for (Event& e : read_done_) {
      if (!e.valid()) e = device_.create_event(false);
    }
    // Recorded again when each read is timed; until then they have completed (nothing queued).
    for (std::size_t i : order) device_.record_event(read_done_[i], storage_);
  }
  for (std::size_t b = 0; b < buffers_.size() && next_read_ < order_.size(); ++b) queue_next_read(b);
}

void NvmeStaging::queue_next_read(std::size_t buffer) {
  const std::size_t i = order_[next_read_++];
  {
    std::lock_guard lock(mutex_);  // the write thread frees buffers after their write-back
    // The write-back out of this buffer may already have failed: the buffer then holds the only
    // copy of its subgroup's new state and keeps naming it. This read is skipped (reads stop
    // with the failure), so it needs no buffer.
    if (!buffers_[buffer].held) buffers_[buffer].owner = i;
  }
  buffer_of_[i] = buffer;
  queue(Job{Kind::read, i, buffer, Event{}});
}

void NvmeStaging::set_rates(double read_bytes_per_s, double write_bytes_per_s) {
  timed_read_rate_ = read_bytes_per_s;
  timed_write_rate_ = write_bytes_per_s;
}

double NvmeStaging::clock_ns() const { return phantom_ ? device_.host_now_ns() : wall_ns(); }

void NvmeStaging::queue(Job job) {
  const double bytes = 3.0 * sizeof(float) * static_cast<double>(sizes_[job.subgroup]);
  job.queued_ns = clock_ns();
  if (timed_storage_ && timed_read_rate_ > 0 && timed_write_rate_ > 0) {
    // On a SimDevice the transfers also take their time on its storage engine, in queue order
    // as one drive serves them, so the virtual clock shows the drive (in data mode the
    // real transfers below move the bytes).
    if (job.after.valid()) device_.stream_wait_event(storage_, job.after);
    const bool read = job.kind == Kind::read;
    const double rate = read ? timed_read_rate_ : timed_write_rate_;
    device_.enqueue_storage(storage_, bytes, rate);
    if (read) device_.record_event(read_done_[job.subgroup], storage_);
    if (phantom_) {
      (read ? use_.read_busy_ns : use_.write_busy_ns) += bytes / rate * 1e9;
      (read ? use_.read_bytes : use_.write_bytes) += bytes;
      ++(read ? use_.reads : use_.writes);
      // Its end is read at finish(); it began bytes / rate before (one drive, one at a time).
      if (timed_transfers_ == transfer_done_.size()) transfer_done_.push_back(device_.create_event(true));
      device_.record_event(transfer_done_[timed_transfers_++], storage_);
      transfers_.push_back(NvmeTransfer{read ? "read" : "write", job.subgroup, job.queued_ns, 0, 0, bytes});
    }
  }
  if (phantom_) return;
  {
    std::lock_guard lock(mutex_);
    if (job.kind == Kind::read) {
      reads_.push_back(job);
    } else {
      buffers_[job.buffer].writing = true;
      writes_.push_back(job);
    }
  }
  changed_.notify_all();
}

NvmeStaging::Staged NvmeStaging::acquire(std::size_t i) {
  if (i >= sizes_.size() || index_[i] == kNone) {
    throw InvalidArgument("NvmeStaging::acquire: subgroup " + std::to_string(i) + " is not on NVMe");
  }
  const std::size_t b = buffer_of_[i];
  if (b == kNone) {
    // Reads are queued in acquire order as buffers free up: one asked for out of that order (or
    // with every buffer taken) would wait forever.
    throw InvalidArgument("NvmeStaging::acquire: subgroup " + std::to_string(i) +
                          " has no read queued (acquired out of the phase's order, or every staging buffer is held)");
  }
  const double t0 = device_.host_now_ns();
  const double w0 = wall_ns();
  if (!phantom_) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return ready_[i] != 0 || error_ != nullptr; });
    if (ready_[i] == 0) std::rethrow_exception(error_);
  }
  if (timed_storage_ && read_done_[i].valid()) device_.event_synchronize(read_done_[i]);
  // The wait on the device's host clock (virtual on a SimDevice) and, for real transfers, on the
  // wall clock.
  use_.stall_ns += device_.host_now_ns() - t0;
  if (!phantom_) use_.stall_wall_ns += wall_ns() - w0;
  {
    const double started = phantom_ ? t0 : w0;
    std::lock_guard lock(mutex_);
    transfers_.push_back(NvmeTransfer{"wait", i, started, started, clock_ns(),
                                      3.0 * sizeof(float) * static_cast<double>(sizes_[i])});
  }
  return view(b, i);
}

void NvmeStaging::release(std::size_t i, Event after) {
  const std::size_t b = i < buffer_of_.size() ? buffer_of_[i] : kNone;
  if (b == kNone) throw InvalidArgument("NvmeStaging::release: subgroup " + std::to_string(i) + " is not staged");
  if (--uses_[i] > 0) return;  // another part of it comes later in the phase
  buffer_of_[i] = kNone;
  queue(Job{Kind::write, i, b, after});
  // The write-back keeps the buffer until it is verified; the next read queues behind it.
  if (next_read_ < order_.size()) {
    queue_next_read(b);
  } else if (phantom_) {
    buffers_[b].owner = kNone;  // the storage stream orders any later use after the write
  }  // else the write thread frees it once the write is verified
}

void NvmeStaging::wait_idle(std::unique_lock<std::mutex>& lock) {
  changed_.wait(lock, [&] { return reads_.empty() && writes_.empty() && !read_busy_ && !write_busy_; });
}

NvmeUse NvmeStaging::finish() {
  if (timed_storage_) device_.stream_synchronize(storage_);
  if (phantom_) {
    for (Buffer& b : buffers_) b.owner = kNone;
    std::size_t k = 0;
    for (NvmeTransfer& t : transfers_) {
      if (t.what[0] == 'w' && t.what[1] == 'a') continue;  // a wait: timed when it happened
      if (k >= timed_transfers_) break;
      const double rate = t.what[0] == 'r' ? timed_read_rate_ : timed_write_rate_;
      t.end_ns = phase_start_ns_ + static_cast<double>(device_.event_elapsed_ms(phase_mark_, transfer_done_[k++])) * 1e6;
      t.start_ns = std::max(t.queued_ns, t.end_ns - t.bytes / rate * 1e9);
    }
    return use_;
  }
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  for (Buffer& b : buffers_) {
    if (!b.held) b.owner = kNone;
  }
  if (error_ != nullptr) std::rethrow_exception(std::exchange(error_, nullptr));
  return use_;
}

std::vector<NvmeTransfer> NvmeStaging::take_transfers() {
  std::lock_guard lock(mutex_);
  return std::exchange(transfers_, {});
}

void NvmeStaging::abandon() noexcept {
  try {
    (void)finish();
  } catch (const std::exception& e) {
    MEMTIDE_LOG(warn, std::string("NvmeStaging: after a failed phase: ") + e.what());
  } catch (...) {
  }
}

// ---- the I/O threads ------------------------------------------------------------------------

void NvmeStaging::serve(Kind kind) {
  std::deque<Job>& queue = kind == Kind::read ? reads_ : writes_;
  bool& busy = kind == Kind::read ? read_busy_ : write_busy_;
  std::unique_lock lock(mutex_);
  for (;;) {
    // A read waits until the write-back out of its buffer is done (reads stay in order).
    changed_.wait(lock, [&] {
      return stop_ || (!queue.empty() && (kind == Kind::write || reads_stopped_ || !buffers_[queue.front().buffer].writing));
    });
    if (queue.empty()) return;  // stop_ with nothing left
    const Job job = queue.front();
    queue.pop_front();
    busy = true;
    const bool skip = kind == Kind::read && reads_stopped_;
    lock.unlock();
    std::exception_ptr failure;
    double t0 = 0, t1 = 0;
    if (!skip) {
      try {
        t0 = wall_ns();
        run(job);
        t1 = wall_ns();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    lock.lock();
    const double bytes = 3.0 * sizeof(float) * static_cast<double>(sizes_[job.subgroup]);
    if (kind == Kind::write) buffers_[job.buffer].writing = false;
    if (failure != nullptr) {
      if (error_ == nullptr) error_ = failure;
      reads_stopped_ = true;
      // A failed write-back keeps the buffer: it holds the only copy of the new state (a read
      // queued into it behind the write is skipped).
      if (kind == Kind::write) {
        buffers_[job.buffer].owner = job.subgroup;
        buffers_[job.buffer].held = true;
      }
    } else if (!skip) {
      transfers_.push_back(NvmeTransfer{kind == Kind::read ? "read" : "write", job.subgroup, job.queued_ns, t0, t1, bytes});
      if (kind == Kind::read) {
        ready_[job.subgroup] = 1;
        use_.read_bytes += bytes;
        use_.read_busy_ns += t1 - t0;
        ++use_.reads;
      } else {
        use_.write_bytes += bytes;
        use_.write_busy_ns += t1 - t0;
        ++use_.writes;
        // Free unless a read was queued into it behind this write.
        if (buffers_[job.buffer].owner == job.subgroup) buffers_[job.buffer].owner = kNone;
      }
    }
    busy = false;
    changed_.notify_all();
  }
}

void NvmeStaging::run(const Job& job) {
  const Staged s = view(job.buffer, job.subgroup);
  if (job.kind == Kind::read) {
    store_read(*store_, index_[job.subgroup], s.p);
    return;
  }
  if (job.after.valid()) device_.event_synchronize(job.after);  // the GPU's flush into the buffer
  store_write(*store_, index_[job.subgroup], s.p, 3 * sizeof(float) * sizes_[job.subgroup]);
}

// ---- between phases -------------------------------------------------------------------------

void NvmeStaging::load(std::size_t i, float* p, float* m, float* v) {
  if (i >= sizes_.size() || index_[i] == kNone) {
    throw InvalidArgument("NvmeStaging::load: subgroup " + std::to_string(i) + " is not on NVMe");
  }
  if (phantom_) return;
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  const std::size_t n = sizes_[i];
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].held && buffers_[b].owner == i) {
      const Staged s = view(b, i);
      std::memcpy(p, s.p, n * sizeof(float));
      std::memcpy(m, s.m, n * sizeof(float));
      std::memcpy(v, s.v, n * sizeof(float));
      return;
    }
  }
  const std::size_t b = free_buffer();
  if (b == kNone) throw IoError("NvmeStaging::load: every staging buffer holds state a failed write left");
  const Staged s = view(b, i);
  store_read(*store_, index_[i], s.p);
  std::memcpy(p, s.p, n * sizeof(float));
  std::memcpy(m, s.m, n * sizeof(float));
  std::memcpy(v, s.v, n * sizeof(float));
}

void NvmeStaging::store(std::size_t i, const float* p, const float* m, const float* v) {
  if (i >= sizes_.size() || index_[i] == kNone) {
    throw InvalidArgument("NvmeStaging::store: subgroup " + std::to_string(i) + " is not on NVMe");
  }
  if (phantom_) return;
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  // The host copy is the truth now: a held (failed) write-back of this subgroup is obsolete.
  std::size_t b = kNone;
  for (std::size_t k = 0; k < buffers_.size(); ++k) {
    if (buffers_[k].held && buffers_[k].owner == i) b = k;
  }
  if (b == kNone) b = free_buffer();
  if (b == kNone) throw IoError("NvmeStaging::store: every staging buffer holds state a failed write left");
  const std::size_t n = sizes_[i];
  const Staged s = view(b, i);
  std::memcpy(s.p, p, n * sizeof(float));
  std::memcpy(s.m, m, n * sizeof(float));
  std::memcpy(s.v, v, n * sizeof(float));
  buffers_[b].owner = i;
  try {
    store_write(*store_, index_[i], s.p, 3 * sizeof(float) * n);
  } catch (...) {
    buffers_[b].held = true;  // the only copy is here now (the caller's may be dropped)
    throw;
  }
  buffers_[b].held = false;
  buffers_[b].owner = kNone;
}

}  // namespace memtide::tiering
