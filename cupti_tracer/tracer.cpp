#include "memtide/cupti_tracer/tracer.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "memtide/device/device.hpp"

#if MEMTIDE_HAVE_CUPTI_H
#include <cupti_activity.h>
#include <cupti_result.h>
#endif

namespace memtide::cupti {
namespace {

#if MEMTIDE_HAVE_CUPTI_H
constexpr int kMemcpy = CUPTI_ACTIVITY_KIND_MEMCPY;
constexpr int kMemset = CUPTI_ACTIVITY_KIND_MEMSET;
constexpr int kKernel = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
constexpr int kMaxLimitReached = CUPTI_ERROR_MAX_LIMIT_REACHED;
constexpr int kMultipleSubscribers = CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
constexpr std::uint32_t kFlushForced = CUPTI_ACTIVITY_FLAG_FLUSH_FORCED;
#else
constexpr int kMemcpy = 1, kMemset = 2, kKernel = 10, kMaxLimitReached = 12, kMultipleSubscribers = 39;
constexpr std::uint32_t kFlushForced = 1;
#endif

// Buffers of a few MB: few requests a second while tracing, little host memory. 8 B aligned:
// activity records are "padded and aligned to ensure that each member of the record is naturally
// aligned" (cupti_activity.h; CUPTI's Activity API:
// https://docs.nvidia.com/cupti/api/group__CUPTI__ACTIVITY__API.html).
constexpr std::size_t kBufferBytes = std::size_t{8} << 20;
constexpr std::size_t kBufferAlign = 8;

std::atomic<Tracer*> g_active{nullptr};

const char* kind_name(int kind) {
  return kind == kMemcpy ? "MEMCPY" : kind == kMemset ? "MEMSET" : kind == kKernel ? "CONCURRENT_KERNEL" : "?";
}

template <class F>
bool bind(void* lib, const char* name, F& out, std::string& problem) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  if (out == nullptr && problem.empty()) problem = std::string("libcupti has no ") + name;
  return out != nullptr;
}

}  // namespace

const char* to_string(Status s) noexcept {
  switch (s) {
    case Status::off: return "off";
    case Status::active: return "active";
    case Status::partial: return "partial";
    case Status::no_gpu: return "no_gpu";
    case Status::no_cupti: return "no_cupti";
    case Status::busy: return "busy";
  }
  return "?";
}

const char* to_string(Activity::Kind k) noexcept {
  switch (k) {
    case Activity::Kind::h2d: return "h2d";
    case Activity::Kind::d2h: return "d2h";
    case Activity::Kind::d2d: return "d2d";
    case Activity::Kind::other_copy: return "copy";
    case Activity::Kind::memset: return "memset";
    case Activity::Kind::kernel: return "kernel";
  }
  return "?";
}

Api Api::load() {
  Api api;
  const CudaStatus cuda = cuda_status();
  api.devices = cuda.usable ? cuda.device_count : 0;
#if !MEMTIDE_HAVE_CUPTI_H
  api.problem = "memtide was built without the CUPTI headers (cupti_activity.h, from the CUDA toolkit)";
  return api;
#else
  std::vector<std::string> names;
  // MEMTIDE_CUPTI_LIBRARY is a row of the options table (so it is no "unknown variable") but is read
  // here from the environment, as before: reading the whole table here coincided with LeakSanitizer
  // crashing at the exit of CuptiTracer.TheRealLoaderReportsAStatusNotAnError in a loaded ctest run
  // (two runs of two; never with getenv). The cause is not known.
  if (const char* own = std::getenv("MEMTIDE_CUPTI_LIBRARY"); own != nullptr && *own != '\0') names.emplace_back(own);
  names.emplace_back("libcupti.so.13");
  names.emplace_back("libcupti.so");
  void* lib = nullptr;
  std::string tried;
  for (const std::string& n : names) {
    lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      api.library = n;
      break;
    }
    tried += (tried.empty() ? "" : "; ") + n + ": " + (dlerror() ? "not loadable" : "not found");
  }
  if (lib == nullptr) {
    api.problem = "libcupti could not be loaded (" + tried + "); it ships with the CUDA toolkit (extras/CUPTI)";
    return api;
  }
  // Never dlclose: CUPTI keeps threads and callbacks into memtide for the life of the process.
  std::string& p = api.problem;
  bind(lib, "cuptiActivityEnable", api.activity_enable, p);
  bind(lib, "cuptiActivityDisable", api.activity_disable, p);
  bind(lib, "cuptiActivityRegisterCallbacks", api.register_callbacks, p);
  bind(lib, "cuptiActivityFlushAll", api.flush_all, p);
  bind(lib, "cuptiActivityGetNextRecord", api.get_next_record, p);
  bind(lib, "cuptiActivityGetNumDroppedRecords", api.get_num_dropped, p);
  bind(lib, "cuptiGetTimestamp", api.get_timestamp, p);
  return api;
#endif
}

#if MEMTIDE_HAVE_CUPTI_H
namespace {
// The fields every record kind memtide reads has under the same names.
template <class Record>
Activity timed(const Record* r, Activity::Kind kind) {
  Activity a;
  a.kind = kind;
  a.start_ns = r->start;
  a.end_ns = r->end;
  a.device = r->deviceId;
  a.stream = r->streamId;
  return a;
}
}  // namespace
#endif

std::optional<Activity> decode(const void* record) {
#if MEMTIDE_HAVE_CUPTI_H
  switch (static_cast<const CUpti_Activity*>(record)->kind) {
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* r = static_cast<const CUpti_ActivityMemcpy6*>(record);
      Activity a = timed(r, r->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? Activity::Kind::h2d
                            : r->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? Activity::Kind::d2h
                            : r->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? Activity::Kind::d2d
                                                                             : Activity::Kind::other_copy);
      const auto host_side = a.kind == Activity::Kind::h2d ? r->srcKind : r->dstKind;
      a.pinned = host_side != CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE;
      a.bytes = r->bytes;
      return a;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* r = static_cast<const CUpti_ActivityMemset4*>(record);
      Activity a = timed(r, Activity::Kind::memset);
      a.bytes = r->bytes;
      return a;
    }
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL:
      return timed(static_cast<const CUpti_ActivityKernel10*>(record), Activity::Kind::kernel);
    default:
      return std::nullopt;
  }
#else
  (void)record;
  return std::nullopt;
#endif
}

PcieUse pcie_use(const std::vector<Activity>& activities, std::uint64_t from_ns, std::uint64_t to_ns) {
  PcieUse out;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans[2];
  for (const Activity& a : activities) {
    const int dir = a.kind == Activity::Kind::h2d ? 0 : a.kind == Activity::Kind::d2h ? 1 : -1;
    if (dir < 0 || a.end_ns <= from_ns || a.start_ns >= to_ns || a.end_ns <= a.start_ns) continue;
    const std::uint64_t s = std::max(a.start_ns, from_ns), e = std::min(a.end_ns, to_ns);
    LinkUse& use = dir == 0 ? out.h2d : out.d2h;
    use.bytes += static_cast<double>(a.bytes) * static_cast<double>(e - s) / static_cast<double>(a.end_ns - a.start_ns);
    spans[dir].emplace_back(s, e);
  }
  for (int dir = 0; dir < 2; ++dir) {  // busy time: the union of the copies' intervals
    auto& v = spans[dir];
    std::sort(v.begin(), v.end());
    std::uint64_t busy = 0, cur_s = 0, cur_e = 0;
    bool open = false;
    for (auto [s, e] : v) {
      if (open && s <= cur_e) {
        cur_e = std::max(cur_e, e);
        continue;
      }
      if (open) busy += cur_e - cur_s;
      cur_s = s, cur_e = e, open = true;
    }
    if (open) busy += cur_e - cur_s;
    (dir == 0 ? out.h2d : out.d2h).busy_ns = static_cast<double>(busy);
  }
  return out;
}

Tracer::Tracer(Api api, std::size_t capacity) : api_(std::move(api)), capacity_(std::max<std::size_t>(capacity, 1)) {}

Tracer::~Tracer() {
  stop();
  Tracer* self = this;
  g_active.compare_exchange_strong(self, nullptr);
}

Status Tracer::start() {
  std::string problem;
  Status status = Status::active;
  std::vector<int> enabled;
  if (api_.devices <= 0) {
    status = Status::no_gpu;
    problem = "no GPU answers (the CUDA runtime sees none)";
  } else if (!api_.problem.empty()) {
    status = Status::no_cupti;
    problem = api_.problem;
  } else {
    Tracer* expected = nullptr;
    if (!g_active.compare_exchange_strong(expected, this) && expected != this) {
      status = Status::busy;
      problem = "another memtide tracer is active in this process";
    } else if (const int rc = api_.register_callbacks(&Tracer::buffer_requested, &Tracer::buffer_completed); rc != 0) {
      status = rc == kMultipleSubscribers ? Status::busy : Status::no_cupti;
      problem = "cuptiActivityRegisterCallbacks returned " + std::to_string(rc) +
                (rc == kMultipleSubscribers ? " (another CUPTI subscriber: torch.profiler, nsys or ncu)" : "");
    } else {
      bool subscriber = false;
      for (int kind : {kMemcpy, kMemset, kKernel}) {
        const int refused = api_.activity_enable(kind);
        if (refused == 0) {
          enabled.push_back(kind);
          continue;
        }
        subscriber = subscriber || refused == kMultipleSubscribers;
        problem += std::string(problem.empty() ? "" : "; ") + kind_name(kind) + " refused (CUPTI " +
                   std::to_string(refused) +
                   (refused == kMultipleSubscribers ? ": another subscriber holds CUPTI" : "") + ")";
      }
      if (enabled.empty()) {
        status = subscriber ? Status::busy : Status::no_gpu;
      } else if (enabled.size() < 3) {
        status = Status::partial;
      }
    }
    if (status != Status::active && status != Status::partial) {
      Tracer* self = this;
      g_active.compare_exchange_strong(self, nullptr);
    }
  }
  std::lock_guard lock(mutex_);
  status_ = status;
  detail_ = problem;
  enabled_ = enabled;
  return status;
}

void Tracer::stop() {
  std::vector<int> enabled;
  {
    std::lock_guard lock(mutex_);
    enabled.swap(enabled_);
    if (status_ == Status::active || status_ == Status::partial) status_ = Status::off;
  }
  if (enabled.empty()) return;
  if (api_.flush_all != nullptr) (void)api_.flush_all(kFlushForced);  // outside our lock: it calls back
  for (int kind : enabled) (void)api_.activity_disable(kind);
  Tracer* self = this;
  g_active.compare_exchange_strong(self, nullptr);
}

void Tracer::flush() {
  bool running = false;
  {
    std::lock_guard lock(mutex_);
    running = !enabled_.empty();
  }
  if (running && api_.flush_all != nullptr) (void)api_.flush_all(0);
}

Status Tracer::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

std::string Tracer::detail() const {
  std::lock_guard lock(mutex_);
  return detail_;
}

std::uint64_t Tracer::now_ns() const {
  std::uint64_t t = 0;
  if (api_.get_timestamp != nullptr && api_.get_timestamp(&t) != 0) t = 0;
  return t;
}

std::vector<Activity> Tracer::take() {
  std::lock_guard lock(mutex_);
  return std::exchange(activities_, {});
}

PcieUse Tracer::pcie_between(std::uint64_t from_ns, std::uint64_t to_ns) const {
  std::lock_guard lock(mutex_);
  return pcie_use(activities_, from_ns, to_ns);
}

std::uint64_t Tracer::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

void Tracer::on_buffer(std::uint8_t* buffer, std::size_t valid) {
  if (buffer == nullptr || valid == 0 || api_.get_next_record == nullptr) return;
  std::vector<Activity> decoded;
  void* record = nullptr;
  for (;;) {
    const int rc = api_.get_next_record(buffer, valid, &record);
    if (rc != 0) break;  // CUPTI_ERROR_MAX_LIMIT_REACHED: the end (anything else: stop too)
    if (auto a = decode(record)) decoded.push_back(*a);
  }
  (void)kMaxLimitReached;
  std::lock_guard lock(mutex_);
  for (const Activity& a : decoded) {
    if (activities_.size() >= capacity_) {
      activities_.erase(activities_.begin());  // the oldest goes
      ++dropped_;
    }
    activities_.push_back(a);
  }
}

void Tracer::buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  // Never return null (CUPTI before API 27 could crash): a failed allocation hands an empty size.
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void Tracer::buffer_completed(void* context, std::uint32_t stream, std::uint8_t* buffer, std::size_t size,
                              std::size_t valid) {
  (void)size;
  // Never throw into CUPTI.
  try {
    if (Tracer* t = g_active.load(); t != nullptr) {
      t->on_buffer(buffer, valid);
      std::size_t lost = 0;
      if (t->api_.get_num_dropped != nullptr && t->api_.get_num_dropped(context, stream, &lost) == 0 && lost > 0) {
        std::lock_guard lock(t->mutex_);
        t->dropped_ += lost;
      }
    }
  } catch (...) {
  }
  std::free(buffer);
}

// ---- the process's tracer --------------------------------------------------------------------

namespace {

struct Process {
  std::mutex mutex;
  std::unique_ptr<Tracer> tracer;
  double offset_ns = 0;  // steady clock - CUPTI's clock
};

Process& process() {
  static auto* p = new Process;  // never destroyed: CUPTI may call back at exit
  return *p;
}

double steady_ns() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

bool tracing(Status s) { return s == Status::active || s == Status::partial; }

}  // namespace

ProcessTrace::Started ProcessTrace::start(Api api) {
  Process& p = process();
  std::lock_guard lock(p.mutex);
  Started out;
  out.library = api.library;
  if (p.tracer) p.tracer->stop();
  p.tracer = std::make_unique<Tracer>(std::move(api));
  out.status = p.tracer->start();
  if (tracing(out.status)) p.offset_ns = steady_ns() - static_cast<double>(p.tracer->now_ns());
  out.detail = p.tracer->detail();
  out.dropped = p.tracer->dropped();
  return out;
}

std::vector<ProcessTrace::Timed> ProcessTrace::stop() {
  Process& p = process();
  std::lock_guard lock(p.mutex);
  std::vector<Timed> out;
  if (!p.tracer) return out;
  p.tracer->stop();
  for (const Activity& a : p.tracer->take()) {
    out.push_back(
        {a, static_cast<double>(a.start_ns) + p.offset_ns, static_cast<double>(a.end_ns) + p.offset_ns});
  }
  return out;
}

std::optional<PcieUse> ProcessTrace::pcie(double from_ns, double to_ns) {
  Process& p = process();
  std::lock_guard lock(p.mutex);
  if (!p.tracer || !tracing(p.tracer->status())) return std::nullopt;
  p.tracer->flush();
  const double from = from_ns - p.offset_ns, to = to_ns - p.offset_ns;
  if (!(to > from) || from < 0) return std::nullopt;
  return p.tracer->pcie_between(static_cast<std::uint64_t>(from), static_cast<std::uint64_t>(to));
}

}  // namespace memtide::cupti
