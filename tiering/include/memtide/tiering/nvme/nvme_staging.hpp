#pragma once
/// @file
/// NvmeStaging: the NVMe tier's half of an update phase. Subgroups whose state (fp32 params,
/// exp_avg, exp_avg_sq) lives on NVMe are read into pinned staging buffers ahead of their update
/// and written back behind it, so a phase takes the time of the slower of I/O and compute, not
/// their sum.
///
/// Reads run in the order the scheduler asks for the subgroups; a release queues the subgroup's
/// write-back and then the next read into the buffer it frees, so reads stay `buffers` subgroups
/// ahead. On a real device a read thread and a write thread serve them through NvmeStore
/// (io_uring, O_DIRECT, checksummed), a read starting once the write-back out of its buffer is
/// done: the drive has the next extent queued while one drains (one extent at a time left a
/// drained queue after each on a virtio disk). Its bytes are the same as the PerfModel's walk
/// counts, one drive serving both. On a phantom SimDevice nothing is stored and the transfers are
/// timed on the device's storage engine at the stated rates (the simulator), in one queue.
///
/// Nothing is lost on an I/O error: a subgroup whose write-back failed keeps its new state in
/// its staging buffer ("held"); newest() reads it from there, and the next phase writes it first.
/// A failed read stops further reads (the scheduler then stops the phase) but never a queued
/// write-back.
///
/// A staging buffer holds p, m and v of one subgroup back to back (12 B/param), 4 KiB aligned.
/// Thread-compatible: one caller (the scheduler's thread); the I/O threads are internal.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "memtide/allocator/host_slab.hpp"
#include "memtide/device/device.hpp"
#include "memtide/tiering/host/pinned_buffer.hpp"
#include "memtide/tiering/nvme/nvme_store.hpp"

namespace memtide::tiering {

/// What the NVMe tier did in one phase (host clock: wall on a GPU, virtual on a SimDevice).
struct NvmeUse {
  double read_bytes = 0, write_bytes = 0;
  double read_busy_ns = 0, write_busy_ns = 0;  ///< time the drive spent on each
  double stall_ns = 0;                         ///< time the scheduler waited for a read (host clock)
  double stall_wall_ns = 0;                    ///< the same on the wall clock (real transfers)
  std::uint64_t reads = 0, writes = 0;

  NvmeUse& operator+=(const NvmeUse& o) noexcept {
    read_bytes += o.read_bytes;
    write_bytes += o.write_bytes;
    read_busy_ns += o.read_busy_ns;
    write_busy_ns += o.write_busy_ns;
    stall_ns += o.stall_ns;
    stall_wall_ns += o.stall_wall_ns;
    reads += o.reads;
    writes += o.writes;
    return *this;
  }
};

/// One transfer of a phase, or one wait for a read, for the timeline: `what` is "read", "write"
/// or "wait" (the scheduler asked for a subgroup and waited from `start_ns` until its read was
/// done; 0 ns when it was already there). `queued_ns`: when the transfer was queued (a read
/// ahead, a write-back behind); `start_ns` to `end_ns`: when the drive served it. Absolute times:
/// the steady clock (std::chrono::steady_clock, as the allocator's events) for real transfers,
/// the device's virtual host clock on a phantom device.
struct NvmeTransfer {
  const char* what = "";
  std::size_t subgroup = 0;
  double queued_ns = 0;
  double start_ns = 0;
  double end_ns = 0;
  double bytes = 0;
};

class NvmeStaging {
 public:
  /// `sizes[i]`: params of subgroup i; `spilled[i]`: its state lives on NVMe. `store` holds an
  /// extent for every spilled subgroup, in subgroup order (null on a phantom device, where the
  /// transfers are timed at `phantom_read_bytes_per_s` / `phantom_write_bytes_per_s`).
  /// `buffers`: staging buffers (>= 1), from `slabs` when given.
  NvmeStaging(Device& device, NvmeStore* store, const std::vector<std::size_t>& sizes, const std::vector<bool>& spilled,
              std::size_t buffers, SlabSource* slabs, double phantom_read_bytes_per_s = 0,
              double phantom_write_bytes_per_s = 0);
  /// Waits for the I/O threads (write-backs complete) and stops them.
  ~NvmeStaging();
  NvmeStaging(const NvmeStaging&) = delete;
  NvmeStaging& operator=(const NvmeStaging&) = delete;

  [[nodiscard]] bool spilled(std::size_t subgroup) const { return index_.at(subgroup) != kNone; }
  [[nodiscard]] std::size_t buffers() const noexcept { return buffers_.size(); }
  /// Starts a phase: the spilled subgroups in the order the scheduler will acquire them (one may
  /// come more than once: it is read at its first acquire and written back after its last
  /// release), with at least `buffers` staging buffers. Writes held subgroups first (throws
  /// IoError if one fails again), then queues the first reads.
  void begin(const std::vector<std::size_t>& order, std::size_t buffers);
  /// Subgroup `i`'s state in staging: waits for its read. Throws the read's IoError.
  struct Staged {
    float* p = nullptr;
    float* m = nullptr;
    float* v = nullptr;
  };
  Staged acquire(std::size_t i);
  /// Subgroup `i`'s buffer holds its new state once `after` has completed (an invalid event: now):
  /// queues its write-back, then the next read into the same buffer.
  void release(std::size_t i, Event after = {});
  /// Waits for every queued transfer; throws the phase's first IoError (after all are done).
  NvmeUse finish();
  /// The transfers and waits of the phase finish() ended (once: they are moved out).
  std::vector<NvmeTransfer> take_transfers();
  /// After an error: waits for the queue (write-backs complete), never throws; buffers not
  /// released are dropped (their NVMe copy is still the subgroup's state).
  void abandon() noexcept;

  /// The newest state of spilled subgroup `i` into p, m, v (n floats each): a held buffer's, else
  /// read from NVMe. Between phases. Throws IoError naming the subgroup and the file.
  void load(std::size_t i, float* p, float* m, float* v);
  /// Makes p, m, v the state of spilled subgroup `i` on NVMe (a checkpoint load, the first spill):
  /// written and verified before it returns. Between phases.
  void store(std::size_t i, const float* p, const float* m, const float* v);
  /// Subgroups whose last write-back failed: their state is in host memory only.
  [[nodiscard]] std::vector<std::size_t> held() const;
  /// Bytes the staging buffers take in pinned host memory.
  [[nodiscard]] std::uint64_t staging_bytes() const;
  /// The rates at which a SimDevice's virtual clock times the transfers (the stated ones on a
  /// phantom device; in data mode the tier's measured ones, the real transfers aside). 0: none.
  void set_rates(double read_bytes_per_s, double write_bytes_per_s);

 private:
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  enum class Kind : std::uint8_t { read, write };
  struct Job {
    Kind kind;
    std::size_t subgroup;
    std::size_t buffer;
    Event after;
    double queued_ns = 0;  // on the transfers' clock (NvmeTransfer)
  };
  struct Buffer {
    PinnedBuffer memory;
    std::size_t owner = kNone;  // the subgroup whose state it holds or will hold
    bool held = false;          // its write-back failed: it holds the only copy of `owner`
    bool writing = false;       // a write-back out of it is queued or running
  };

  [[nodiscard]] Staged view(std::size_t buffer, std::size_t subgroup) const;
  void reserve(std::size_t buffers);
  void queue(Job job);
  void queue_next_read(std::size_t buffer);
  void serve(Kind kind);  // an I/O thread: the reads or the writes
  void run(const Job& job);
  void wait_idle(std::unique_lock<std::mutex>& lock);
  std::size_t free_buffer() const;
  std::uint64_t buffer_bytes() const;

  Device& device_;
  NvmeStore* store_;
  SlabSource* slabs_;
  bool phantom_;
  double timed_read_rate_, timed_write_rate_;
  std::vector<std::size_t> sizes_;
  std::vector<std::size_t> index_;  // subgroup -> extent in the store; kNone: not spilled
  std::size_t largest_ = 0;
  std::vector<Buffer> buffers_;

  // A phase.
  std::vector<std::size_t> order_;
  std::size_t next_read_ = 0;
  std::vector<std::size_t> buffer_of_;  // subgroup -> buffer while staged
  std::vector<char> ready_;             // subgroup -> its read completed (this phase)
  std::vector<std::size_t> uses_;       // subgroup -> acquisitions left this phase
  std::vector<Event> read_done_;        // timed storage: subgroup -> the read's event (device clock)
  bool timed_storage_ = false;          // the device times storage transfers (a SimDevice: virtual clock)
  Stream storage_{};                    // the storage transfers' stream
  double phase_start_ns_ = 0;
  NvmeUse use_;
  // The phase's transfers and waits (under mutex_: the I/O threads add theirs). On a phantom
  // device each transfer's end is an event on the storage stream, read at finish() against
  // phase_mark_ (recorded at begin(), when the stream is idle).
  std::vector<NvmeTransfer> transfers_;
  std::vector<Event> transfer_done_;
  std::size_t timed_transfers_ = 0;
  Event phase_mark_{};
  [[nodiscard]] double clock_ns() const;  // the transfers' clock (NvmeTransfer)

  // The I/O threads.
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Job> reads_, writes_;
  bool read_busy_ = false, write_busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;     // the phase's first I/O error
  bool reads_stopped_ = false;   // a read failed: later reads are skipped
  std::thread read_thread_, write_thread_;
};

}  // namespace memtide::tiering
