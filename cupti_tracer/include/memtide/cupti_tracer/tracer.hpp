#pragma once
/// @file
/// CUPTI activity tracing: the device's copies, memsets and kernels as they really ran, with
/// their own timestamps, so the timeline and the Calibration see all PCIe traffic, including the
/// traffic memtide did not issue.
///
/// libcupti is loaded with dlopen (memtide never links it), the activity kinds are enabled one
/// by one, and the tracer reports a status instead of failing (Kineto's rule): active, partial
/// (some kinds refused), no_gpu, no_cupti (the library or a symbol is missing), busy (another
/// subscriber, such as torch.profiler or nsys, holds CUPTI: one per process up to CUDA 13.2).
/// Every entry point it uses goes through an `Api` table, so tests drive it with fakes and
/// synthetic records, with no GPU (as Kineto tests its CUPTI code).

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace memtide::cupti {

enum class Status { off, active, partial, no_gpu, no_cupti, busy };
/// "off", "active", "partial", "no_gpu", "no_cupti", "busy".
const char* to_string(Status s) noexcept;

/// One device activity, decoded from a CUPTI record. Times are CUPTI's (ns).
struct Activity {
  enum class Kind : std::uint8_t { h2d, d2h, d2d, other_copy, memset, kernel };
  Kind kind = Kind::kernel;
  std::uint64_t start_ns = 0;
  std::uint64_t end_ns = 0;
  std::uint64_t bytes = 0;
  std::uint32_t device = 0;
  std::uint32_t stream = 0;
  bool pinned = true;  ///< copies: the host side was pinned (false: pageable staging)
};
/// "h2d", "d2h", "d2d", "copy", "memset", "kernel".
const char* to_string(Activity::Kind k) noexcept;

/// The CUPTI entry points memtide uses (CUptiResult as int; 0 is success). `load()` fills them
/// from libcupti; a test gives its own.
struct Api {
  int (*activity_enable)(int kind) = nullptr;
  int (*activity_disable)(int kind) = nullptr;
  int (*register_callbacks)(void (*requested)(std::uint8_t**, std::size_t*, std::size_t*),
                            void (*completed)(void*, std::uint32_t, std::uint8_t*, std::size_t, std::size_t)) = nullptr;
  int (*flush_all)(std::uint32_t flag) = nullptr;
  int (*get_next_record)(std::uint8_t* buffer, std::size_t valid, void** record) = nullptr;
  int (*get_num_dropped)(void* context, std::uint32_t stream, std::size_t* dropped) = nullptr;
  int (*get_timestamp)(std::uint64_t* ns) = nullptr;
  int devices = 0;          ///< GPUs the CUDA runtime sees; 0 means no_gpu
  std::string library;      ///< where libcupti was loaded from
  std::string problem;      ///< why it could not be loaded (empty when it was)

  /// dlopen libcupti (libcupti.so.13, then libcupti.so; MEMTIDE_CUPTI_LIBRARY first if set) and
  /// dlsym each entry point; asks the CUDA runtime how many GPUs there are. Never throws.
  static Api load();
};

/// Decodes one CUPTI record of a kind memtide enables (MEMCPY, MEMSET, CONCURRENT_KERNEL);
/// nullopt for any other kind. `record` points at a CUpti_Activity.
std::optional<Activity> decode(const void* record);

/// PCIe use in one direction over a time window.
struct LinkUse {
  double bytes = 0;
  double busy_ns = 0;  ///< time at least one copy was running (overlaps merged)
  [[nodiscard]] double bytes_per_s() const { return busy_ns > 0 ? bytes / busy_ns * 1e9 : 0; }
};
struct PcieUse {
  LinkUse h2d, d2h;
};
/// The PCIe use of the copies in [from_ns, to_ns): a copy counts for the part of it inside.
PcieUse pcie_use(const std::vector<Activity>& activities, std::uint64_t from_ns, std::uint64_t to_ns);

/// The process's activity tracer (CUPTI allows one subscriber). Thread-safe.
class Tracer {
 public:
  /// `capacity`: activities kept until take(); beyond it the oldest are dropped and counted.
  explicit Tracer(Api api, std::size_t capacity = std::size_t{1} << 20);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  /// Registers the buffer callbacks and enables MEMCPY, MEMSET and CONCURRENT_KERNEL one by one
  /// (never KERNEL: it serializes kernels). Returns (and keeps) the status. Never throws.
  Status start();
  /// Flushes what CUPTI holds (forced) and disables the kinds. Call after synchronizing the device.
  void stop();
  /// Hands CUPTI's completed buffers over now (not forced: running records stay).
  void flush();

  [[nodiscard]] Status status() const;
  /// Why the status is not active: the refused kinds and CUPTI's codes, or the load problem.
  [[nodiscard]] std::string detail() const;
  /// CUPTI's clock now (ns), for marks on the same clock as the records; 0 when not loaded.
  [[nodiscard]] std::uint64_t now_ns() const;
  /// The activities decoded since the last take().
  [[nodiscard]] std::vector<Activity> take();
  /// The PCIe use of the activities held now (not taken) in [from_ns, to_ns) on CUPTI's clock.
  [[nodiscard]] PcieUse pcie_between(std::uint64_t from_ns, std::uint64_t to_ns) const;
  /// Records lost: CUPTI's own count plus those dropped beyond `capacity`.
  [[nodiscard]] std::uint64_t dropped() const;

  /// CUPTI's buffer-completed callback, for this tracer (public for tests: they hand it buffers
  /// of synthetic records, as Kineto's tests do). Walks the records with api.get_next_record.
  void on_buffer(std::uint8_t* buffer, std::size_t valid);

 private:
  static void buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records);
  static void buffer_completed(void* context, std::uint32_t stream, std::uint8_t* buffer, std::size_t size,
                               std::size_t valid);

  Api api_;
  std::size_t capacity_;
  mutable std::mutex mutex_;  // never held while calling into CUPTI (flush_all would deadlock)
  Status status_ = Status::off;
  std::string detail_;
  std::vector<int> enabled_;
  std::vector<Activity> activities_;
  std::uint64_t dropped_ = 0;
};

/// The process's one tracer (CUPTI takes one subscriber per process), its records put on the
/// steady clock (std::chrono::steady_clock, which the allocator's trace uses): what the Python
/// module's device_trace_start/stop and the engine's PCIe calibration share. Thread-safe; the
/// tracer is never destroyed (CUPTI may call back at exit).
class ProcessTrace {
 public:
  struct Started {
    Status status = Status::off;
    std::string detail;   ///< Tracer::detail()
    std::string library;  ///< where libcupti was loaded from
    std::uint64_t dropped = 0;
  };
  /// One activity with its times on the steady clock (ns since its epoch).
  struct Timed {
    Activity activity;
    double start_ns = 0;
    double end_ns = 0;
  };

  /// (Re)starts tracing through `api` (Api::load() in use; a test passes a fake), stopping a
  /// tracer started before. Never throws for a missing GPU, library or a busy CUPTI.
  static Started start(Api api);
  /// Stops tracing (synchronize the device first) and takes its activities; empty when none was started.
  static std::vector<Timed> stop();
  /// The PCIe use in [from_ns, to_ns) on the steady clock of the activities CUPTI has handed over
  /// (completed buffers only: records it still holds are missed, not waited for); nullopt when
  /// nothing traces or the window is empty or before the trace.
  static std::optional<PcieUse> pcie(double from_ns, double to_ns);
};

}  // namespace memtide::cupti
