// memtide as torch's own CUDA allocator: a c10::cuda::CUDACachingAllocator::CUDAAllocator whose
// every hook is memtide's CachingAllocator. Built at install time against the torch found then
// (torch_bridge/CMakeLists.txt), loaded by memtide.use_with_torch(); see docs/torch_bridge.md for
// why a subclass and not the pluggable allocator's setters.
//
// Torch's interface moves between releases. Two habits keep this file building across them:
// a hook whose signature changed is defined in each known form (the one torch declares is the
// override, the others are plain members), and types whose constructors changed are built
// through `if constexpr` on what they accept.

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"
#include "memtide/runtime/runtime.hpp"

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using memtide::CachingAllocator;
using memtide::Runtime;

thread_local std::string t_bridge_error;

memtide::Stream to_stream(cudaStream_t s) { return memtide::Stream{static_cast<void*>(s)}; }
memtide::PoolId to_pool(c10::MempoolId_t id) { return {id.first, id.second}; }

// A memtide message without its own "memtide: " (the hook's name goes in front instead).
const char* unprefixed(const char* what) {
  constexpr const char kPrefix[] = "memtide: ";
  return std::strncmp(what, kPrefix, sizeof kPrefix - 1) == 0 ? what + sizeof kPrefix - 1 : what;
}

// memtide's errors as torch's: OutOfMemory becomes torch.OutOfMemoryError in Python, a bad
// argument ValueError, the rest RuntimeError. Every hook goes through here, so no memtide
// exception type reaches torch's code (which catches only c10::Error and std::exception).
template <typename F>
decltype(auto) translated(const char* where, F&& body) {
  try {
    return body();
  } catch (const memtide::OutOfMemory& e) {
    C10_THROW_ERROR(OutOfMemoryError, e.what());
  } catch (const memtide::InvalidArgument& e) {
    C10_THROW_ERROR(ValueError, std::string("memtide ") + where + ": " + unprefixed(e.what()));
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    C10_THROW_ERROR(Error, std::string("memtide ") + where + ": " + unprefixed(e.what()));
  }
}

void delete_ptr(void* ptr);

// Hooks written without `override` changed form across torch releases (or are not in all of
// them): the form this torch declares overrides, any other is an ordinary member.
class MemtideTorchAllocator final : public cca::CUDAAllocator {
 public:
  // ---- allocation: torch calls these for every tensor ----------------------------------------

  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = current_device();
    void* ptr = size == 0 ? nullptr : alloc(size, device, current_stream(device));
    return {ptr, ptr, &delete_ptr, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_ptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    translated("copy_data", [&] {
      if (Runtime::get().backend() != memtide::Backend::cuda) {
        throw std::runtime_error("device-to-device copy needs a GPU (memtide runs on its simulated device)");
      }
      const cudaError_t rc = cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice);
      if (rc != cudaSuccess) throw std::runtime_error(std::string("cudaMemcpy: ") + cudaGetErrorString(rc));
    });
  }
  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const c10::DeviceIndex device = current_device();
    return alloc(nbytes, device, current_stream(device));
  }
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return alloc(nbytes, current_device(), to_stream(stream));
  }
  void raw_delete(void* ptr) override { free(ptr); }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    translated("free", [&] { owner(ptr).deallocate(ptr, memtide::Stream{}); });
  }

  // ---- life cycle and limits -------------------------------------------------------------------

  void init(int device_count) override {
    translated("init", [&] {
      const int have = Runtime::get().device_count();
      if (device_count != have) {
        MEMTIDE_LOG(warn, "torch bridge: torch sees " + std::to_string(device_count) + " device(s), memtide " +
                              std::to_string(have));
      }
    });
    initialized_.store(true);
  }
  bool initialized() override { return initialized_.load(); }
  double getMemoryFraction(c10::DeviceIndex device) {
    return translated("getMemoryFraction", [&] { return Runtime::get().allocator(device).memory_fraction(); });
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    translated("setMemoryFraction", [&] { Runtime::get().allocator(device).set_memory_fraction(fraction); });
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) { return {}; }
  // emptyCache took no argument before torch grew private-pool emptying.
  void emptyCache(c10::MempoolId_t) { empty_cache(); }
  void emptyCache() { empty_cache(); }
  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    translated("cacheInfo", [&] { *largest = Runtime::get().allocator(device).largest_free_block(); });
  }
  void* getBaseAllocation(void* ptr, size_t* size) override {
    return translated("getBaseAllocation", [&] {
      const auto seg = owner(ptr).segment_of(ptr);
      if (!seg) throw memtide::InvalidArgument("pointer is not allocated by memtide");
      if (size != nullptr) *size = seg->second;
      return seg->first;
    });
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // Like torch's own allocator: a tensor memtide did not allocate (from_blob, another
    // allocator's) is not its business.
    if (ptr.get() == nullptr || ptr.get_deleter() != &delete_ptr) return;
    translated("recordStream", [&] { owner(ptr.get()).record_stream(ptr.get(), handle_of(stream)); });
  }

  // ---- statistics and snapshots ----------------------------------------------------------------

  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return translated("getDeviceStats", [&] {
      const memtide::AllocatorStats s = Runtime::get().allocator(device).stats();
      cca::DeviceStats out;
      auto copy = [](const memtide::StatArray& from, auto& to) {
        for (std::size_t i = 0; i < from.size(); ++i) {
          to[i].current = from[i].current;
          to[i].peak = from[i].peak;
          to[i].allocated = from[i].allocated;
          to[i].freed = from[i].freed;
        }
      };
      copy(s.allocation, out.allocation);
      copy(s.segment, out.segment);
      copy(s.active, out.active);
      copy(s.inactive_split, out.inactive_split);
      copy(s.allocated_bytes, out.allocated_bytes);
      copy(s.reserved_bytes, out.reserved_bytes);
      copy(s.active_bytes, out.active_bytes);
      copy(s.inactive_split_bytes, out.inactive_split_bytes);
      copy(s.requested_bytes, out.requested_bytes);
      out.num_alloc_retries = s.num_alloc_retries;
      out.num_ooms = s.num_ooms;
      out.num_sync_all_streams = s.num_sync_all_streams;
      out.num_device_alloc = s.num_device_alloc;
      out.num_device_free = s.num_device_free;
      // memtide splits blocks of every size (no max_split_size), which torch reports as max.
      out.max_split_size = std::numeric_limits<int64_t>::max();
      return out;
    });
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    translated("resetAccumulatedStats", [&] { Runtime::get().allocator(device).reset_accumulated_stats(); });
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    translated("resetPeakStats", [&] { Runtime::get().allocator(device).reset_peak_stats(); });
  }

  cca::SnapshotInfo snapshot(c10::MempoolId_t pool, bool include_traces) {
    return translated("snapshot", [&] { return make_snapshot(pool, include_traces); });
  }
  cca::SnapshotInfo snapshot(c10::MempoolId_t pool) { return snapshot(pool, true); }
  cca::SnapshotInfo snapshot() { return snapshot({0, 0}, true); }

  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext, bool clear,
                     const std::vector<std::string>&) {
    record_history(enabled, clear);
  }
  // The form before clearHistory and skip_actions.
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext) { record_history(enabled, false); }
  bool isHistoryEnabled() {
    Runtime& rt = Runtime::get();
    for (int d = 0; d < rt.device_count(); ++d) {
      if (CachingAllocator* a = rt.opened(d); a != nullptr && a->record_history()) return true;
    }
    return false;
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard lock(observers_mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  // memtide never rejects an allocation ahead of trying it, so these are never called.
  void attachOomRejectionObserver(std::function<void(int64_t, size_t, size_t, size_t)>) {}
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker) override {
    TORCH_WARN_ONCE("memtide does not feed allocator trace trackers; use torch.cuda.memory._record_memory_history "
                    "and _snapshot (memtide records the trace) instead");
  }

  // ---- CUDA graphs and memory pools ------------------------------------------------------------

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t pool,
                           std::function<bool(cudaStream_t)> filter) override {
    translated("beginAllocateToPool", [&] {
      std::function<bool(memtide::Stream)> by_stream;
      if (filter) {
        by_stream = [f = std::move(filter)](memtide::Stream s) { return f(static_cast<cudaStream_t>(s.handle)); };
      }
      Runtime::get().allocator(device).begin_allocate_to_pool(to_pool(pool), std::move(by_stream));
    });
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    translated("endAllocateToPool", [&] { Runtime::get().allocator(device).end_allocate_to_pool(to_pool(pool)); });
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t pool) override {
    translated("releasePool", [&] { Runtime::get().allocator(device).release_pool(to_pool(pool)); });
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t pool,
                          std::shared_ptr<cca::CUDAAllocator> other) {
    if (other != nullptr && other.get() != this) {
      C10_THROW_ERROR(Error, "memtide is torch's CUDA allocator; a torch.cuda.MemPool with an allocator of its own "
                             "is not supported");
    }
    translated("createOrIncrefPool", [&] { Runtime::get().allocator(device).create_or_incref_pool(to_pool(pool)); });
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t pool) {
    return translated("getPoolUseCount", [&] { return Runtime::get().allocator(device).pool_use_count(to_pool(pool)); });
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, c10::MempoolId_t) override {
    C10_THROW_ERROR(Error, kNoCheckpoints);
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override {
    C10_THROW_ERROR(Error, kNoCheckpoints);
  }

  // ---- what memtide does not do ----------------------------------------------------------------

  cca::ShareableHandle shareIpcHandle(void*) override {
    C10_THROW_ERROR(Error, "memtide does not share CUDA memory between processes (CUDA IPC); torch.multiprocessing "
                           "cannot send CUDA tensors while memtide is torch's allocator");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    C10_THROW_ERROR(Error, "memtide does not open CUDA IPC handles of other processes");
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    if (Runtime::get().backend() != memtide::Backend::cuda) return;
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t rc = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (rc == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(rc);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    // memtide's segments come from cudaMalloc, so a plain copy works whenever peer access is on.
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  std::string name() override { return "memtide"; }

 private:
  static constexpr const char* kNoCheckpoints =
      "memtide does not checkpoint private pools (torch.compile's CUDA graph trees need it); set "
      "torch._inductor.config.triton.cudagraph_trees = False to capture with plain CUDA graphs";

  static c10::DeviceIndex current_device() {
    if (Runtime::get().backend() != memtide::Backend::cuda) return 0;
    return c10::cuda::current_device();
  }
  // The cudaStream_t of a torch stream. On the simulated device there is no CUDA to ask: the only
  // streams then are memtide's own, wrapped with getStreamFromExternal, whose id is the handle.
  static memtide::Stream handle_of(const c10::cuda::CUDAStream& stream) {
    if (Runtime::get().backend() != memtide::Backend::cuda) {
      return memtide::Stream{reinterpret_cast<void*>(static_cast<std::intptr_t>(stream.id()))};
    }
    return to_stream(stream.stream());
  }
  static memtide::Stream current_stream(c10::DeviceIndex device) {
    if (Runtime::get().backend() != memtide::Backend::cuda) return memtide::Stream{};
    return to_stream(c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* alloc(size_t size, c10::DeviceIndex device, memtide::Stream stream) {
    initialized_.store(true, std::memory_order_relaxed);
    CachingAllocator* a = nullptr;
    try {
      a = &Runtime::get().allocator(device);
      return a->allocate(size, stream);
    } catch (const memtide::OutOfMemory& e) {
      notify_oom(device, a);
      C10_THROW_ERROR(OutOfMemoryError, e.what());
    } catch (const memtide::InvalidArgument& e) {
      C10_THROW_ERROR(ValueError, std::string("memtide allocate: ") + e.what());
    } catch (const c10::Error&) {
      throw;
    } catch (const std::exception& e) {
      C10_THROW_ERROR(Error, std::string("memtide allocate: ") + e.what());
    }
  }

  // The allocator holding `ptr`: with one device open, that one (its free checks the pointer).
  static CachingAllocator& owner(void* ptr) {
    Runtime& rt = Runtime::get();
    CachingAllocator* only = nullptr;
    int open = 0;
    for (int d = 0; d < rt.device_count(); ++d) {
      if (CachingAllocator* a = rt.opened(d)) {
        only = a;
        ++open;
      }
    }
    if (open == 1) return *only;
    for (int d = 0; d < rt.device_count(); ++d) {
      if (CachingAllocator* a = rt.opened(d); a != nullptr && a->allocation_size(ptr)) return *a;
    }
    throw memtide::InvalidArgument("pointer is not allocated by memtide (unknown or already freed)");
  }

  void notify_oom(c10::DeviceIndex device, CachingAllocator* a) {
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard lock(observers_mutex_);
      observers = oom_observers_;
    }
    if (observers.empty() || a == nullptr) return;
    std::size_t free = 0;
    std::size_t total = 0;
    try {
      const memtide::MemInfo mem = a->device().mem_info();
      free = mem.free;
      total = mem.total;
    } catch (const std::exception&) {
      // The observers still learn of the failure.
    }
    const auto allocated = static_cast<std::size_t>(a->stats().allocated_bytes[0].current);
    for (auto& observer : observers) observer(device, allocated, total, free);
  }

  void empty_cache() {
    translated("emptyCache", [&] {
      for (CachingAllocator* a : Runtime::get().opened()) {
        if (a != nullptr) a->empty_cache();
      }
    });
  }

  void record_history(bool enabled, bool clear) {
    translated("recordHistory", [&] {
      Runtime& rt = Runtime::get();
      for (int d = 0; d < rt.device_count(); ++d) {
        CachingAllocator& a = rt.allocator(d);
        if (clear && a.record_history()) a.set_record_history(false);
        a.set_record_history(enabled);
      }
    });
  }

  static cca::TraceEntry::Action to_action(memtide::TraceAction a) {
    using A = cca::TraceEntry::Action;
    switch (a) {
      case memtide::TraceAction::alloc: return A::ALLOC;
      case memtide::TraceAction::free_requested: return A::FREE_REQUESTED;
      case memtide::TraceAction::free_completed: return A::FREE_COMPLETED;
      case memtide::TraceAction::segment_alloc: return A::SEGMENT_ALLOC;
      case memtide::TraceAction::segment_free: return A::SEGMENT_FREE;
      case memtide::TraceAction::segment_map: return A::SEGMENT_MAP;
      case memtide::TraceAction::segment_unmap: return A::SEGMENT_UNMAP;
      case memtide::TraceAction::oom: return A::OOM;
      case memtide::TraceAction::snapshot: return A::SNAPSHOT;
    }
    return A::ALLOC;
  }

  // A trace entry in whichever constructor this torch has: with the owning pool (newer) or without.
  // (A template, so that only the branch this torch can compile is compiled.)
  template <typename Entry = cca::TraceEntry>
  static Entry make_trace_entry(typename Entry::Action action, c10::DeviceIndex device, const memtide::TraceEntry& e) {
    void* stream = reinterpret_cast<void*>(static_cast<std::uintptr_t>(e.stream));
    if constexpr (std::is_constructible_v<Entry, typename Entry::Action, c10::DeviceIndex, size_t, size_t, void*,
                                          c10::MempoolId_t, c10::approx_time_t>) {
      Entry out(action, device, e.addr, e.size, stream, c10::MempoolId_t{0, 0}, c10::approx_time_t{0});
      out.time_.t_ = static_cast<time_t>(e.time_us);
      return out;
    } else {
      Entry out(action, device, e.addr, e.size, stream, c10::approx_time_t{0});
      out.time_.t_ = static_cast<time_t>(e.time_us);
      return out;
    }
  }

  cca::SnapshotInfo make_snapshot(c10::MempoolId_t pool, bool include_traces) {
    cca::SnapshotInfo out;
    Runtime& rt = Runtime::get();
    for (int d = 0; d < rt.device_count(); ++d) {
      out.device_traces.emplace_back();
      CachingAllocator* a = rt.opened(d);
      if (a == nullptr) continue;
      const memtide::Snapshot snap = a->snapshot();
      const auto device = static_cast<c10::DeviceIndex>(d);
      for (const memtide::SegmentSnapshot& s : snap.segments) {
        const c10::MempoolId_t owner{s.pool_first, s.pool_second};
        if (pool != c10::MempoolId_t{0, 0} && owner != pool) continue;
        cca::SegmentInfo seg;
        seg.device = device;
        seg.address = s.address;
        seg.total_size = s.total_size;
        seg.requested_size = s.requested_size;
        seg.allocated_size = s.allocated_size;
        seg.active_size = s.active_size;
        seg.stream = reinterpret_cast<void*>(static_cast<std::uintptr_t>(s.stream));
        seg.is_large = !s.small;
        seg.is_expandable = s.expandable;
        seg.owner_private_pool_id = owner;
        for (const memtide::BlockSnapshot& b : s.blocks) {
          cca::BlockInfo block;
          block.size = b.size;
          block.requested_size = b.requested_size;
          block.allocated = b.state == memtide::BlockState::active_allocated;
          block.active = b.state != memtide::BlockState::inactive;
          seg.blocks.push_back(std::move(block));
        }
        out.segments.push_back(std::move(seg));
      }
      if (include_traces && !snap.device_traces.empty()) {
        for (const memtide::TraceEntry& e : snap.device_traces.front()) {
          out.device_traces.back().push_back(make_trace_entry(to_action(e.action), device, e));
        }
      }
    }
    return out;
  }

  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
};

MemtideTorchAllocator& bridge() {
  // Never destroyed: torch may free tensors from static destructors after this library's.
  static auto* instance = new MemtideTorchAllocator();
  return *instance;
}

void delete_ptr(void* ptr) { bridge().free(ptr); }

}  // namespace

// ---- the C functions memtide's Python package calls (through ctypes) ---------------------------

extern "C" {

__attribute__((visibility("default"))) const char* memtide_torch_bridge_error(void) { return t_bridge_error.c_str(); }

/// The torch version this bridge was compiled against ("2.15.0").
__attribute__((visibility("default"))) const char* memtide_torch_bridge_torch_version(void) { return TORCH_VERSION; }

/// Makes memtide torch's CUDA allocator. 0 on success; -1 when torch's current allocator has
/// handed out memory already (the message in memtide_torch_bridge_error()).
__attribute__((visibility("default"))) int memtide_torch_bridge_install(void) {
  t_bridge_error.clear();
  try {
    cca::CUDAAllocator* current = cca::allocator.load();
    if (current == &bridge()) return 0;
    if (current != nullptr && current->initialized()) {
      t_bridge_error = "torch's CUDA allocator (" + current->name() +
                       ") is in use already; memtide must be installed before the first CUDA allocation";
      return -1;
    }
    (void)Runtime::get();  // bad options fail here, naming the option, not inside a tensor allocation
    cca::allocator.store(&bridge());
    return 0;
  } catch (const std::exception& e) {
    t_bridge_error = e.what();
    return -1;
  }
}

/// Drives each hook through torch's own entry points (the functions in namespace
/// c10::cuda::CUDACachingAllocator that torch's CUDA code calls), so a test or `memtide info` sees
/// them reach memtide without a GPU: allocation, base allocation, cache info, record_stream on a
/// second stream (its free must wait for that stream), stats and free. Writes a JSON object to
/// `out`; 0 on success, -1 with memtide_torch_bridge_error() set.
__attribute__((visibility("default"))) int memtide_torch_bridge_selfcheck(char* out, size_t capacity) {
  t_bridge_error.clear();
  try {
    if (cca::allocator.load() != &bridge()) throw std::runtime_error("the bridge is not torch's allocator");
    const c10::DeviceIndex device = 0;
    const size_t bytes = 3 << 20;
    void* ptr = cca::raw_alloc_with_stream(bytes, nullptr);
    size_t segment = 0;
    void* base = cca::getBaseAllocation(ptr, &segment);
    size_t largest = 0;
    cca::cacheInfo(device, &largest);
    // A second stream of memtide's device (on a GPU, a real CUDA stream) wrapped as torch wraps
    // external streams.
    memtide::Device& dev = Runtime::get().allocator(device).device();
    const memtide::Stream side = dev.create_stream();
    {
      c10::DataPtr data(ptr, ptr, &delete_ptr, c10::Device(c10::DeviceType::CUDA, device));
      cca::recordStream(data, c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(side.handle), device));
      data.release_context();  // the DataPtr must not free: raw_delete below does
    }
    const auto active_before = cca::getDeviceStats(device).active_bytes[0].current;
    cca::raw_delete(ptr);
    const auto stats = cca::getDeviceStats(device);
    dev.stream_synchronize(side);
    dev.destroy_stream(side);
    const std::string json =
        "{\"ptr\": " + std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) +
        ", \"base\": " + std::to_string(reinterpret_cast<std::uintptr_t>(base)) +
        ", \"segment_bytes\": " + std::to_string(segment) + ", \"largest_free\": " + std::to_string(largest) +
        ", \"active_bytes_before_free\": " + std::to_string(active_before) +
        ", \"allocated_bytes_after_free\": " + std::to_string(stats.allocated_bytes[0].current) +
        ", \"active_bytes_after_free\": " + std::to_string(stats.active_bytes[0].current) +
        ", \"name\": \"" + cca::name() + "\"}";
    if (json.size() + 1 > capacity) throw std::runtime_error("selfcheck: output buffer too small");
    std::memcpy(out, json.c_str(), json.size() + 1);
    return 0;
  } catch (const std::exception& e) {
    t_bridge_error = e.what();
    return -1;
  }
}

/// 1 when torch's CUDA allocator is memtide's bridge.
__attribute__((visibility("default"))) int memtide_torch_bridge_active(void) {
  return cca::allocator.load() == &bridge() ? 1 : 0;
}

}  // extern "C"
