#pragma once
/// @file
/// A simulated GPU on a virtual clock: data or phantom memory, operations run at once in issue
/// order and timed by a throughput model (docs/architecture.md, "Device", has the model).

#include <map>
#include <vector>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "memtide/device/device.hpp"

namespace memtide {

/// Throughput model. Defaults are one H100 of the Deep Optimizer States testbed: PCIe Gen5 at
/// ~55 GB/s each way pinned, 16/9 GB/s pageable D2H/H2D, HBM3; host DRAM is a Sapphire Rapids
/// socket (8 channels DDR5-4800, ~220 GB/s sustained).
struct SimConfig {
  std::size_t capacity = 80ULL << 30;
  bool phantom = false;
  double h2d_bytes_per_s = 55e9;
  double d2h_bytes_per_s = 55e9;
  double h2d_pageable_bytes_per_s = 9e9;
  double d2h_pageable_bytes_per_s = 16e9;
  double hbm_bytes_per_s = 3.0e12;
  double host_dram_bytes_per_s = 220e9;
  double op_latency_ns = 2000.0;  ///< launch + DMA setup per operation
  /// Device-side optimizer step throughput (params/s). An H100 streams the ~30 B/param of a
  /// fused AdamW step far faster than this; 25 G params/s is the paper's testbed figure per GPU
  /// (about 100 G params/s for the 4-GPU node). 0 = derive the step's time from HBM bytes alone.
  double gpu_update_params_per_s = 25e9;
  /// Host CPU optimizer step throughput (params/s) that callers simulating a CPU update pass to
  /// host_work (the paper's host: ~8 G params/s for 4 GPUs, 2 G params/s per GPU).
  double cpu_update_params_per_s = 2e9;
  int index = 0;
};

/// Time one engine or the host spent busy, for tests and the planner.
struct SimEngineStats {
  double busy_ns = 0;
  double bytes = 0;
  std::uint64_t ops = 0;
};

/// One operation the simulated machine ran (recorded when record_ops is on): for tests that
/// check when work happened, and for timelines.
struct SimOp {
  const char* engine = "";  ///< "h2d", "d2h", "compute", "link", "storage" or "host"
  double start_ns = 0;
  double end_ns = 0;
  double bytes = 0;
};

class SimDevice final : public Device {
 public:
  explicit SimDevice(SimConfig config = {});
  ~SimDevice() override;

  [[nodiscard]] const SimConfig& config() const noexcept { return config_; }
  /// The host's virtual clock, in nanoseconds.
  [[nodiscard]] double now_ns();
  /// The host idles or computes for `ns` without touching DRAM.
  void advance_host(double ns);
  /// The host streams `dram_bytes` through DRAM at up to `max_bytes_per_s` (a CPU kernel), sharing
  /// DRAM with in-flight DMA. Advances the host clock and returns the duration in ns.
  double host_work(double dram_bytes, double max_bytes_per_s);
  /// Device-side compute on `stream` (a kernel): it moves `hbm_bytes` through HBM and lasts at
  /// least `min_ns`. In data mode `body` runs now, on the host, over this device's memory (it is
  /// the simulated kernel); in phantom mode it is not called. Returns the virtual end time.
  double enqueue_compute(Stream stream, double hbm_bytes, const std::function<void()>& body, double min_ns = 0);
  /// When `event` fires (or fired), in virtual ns: what a host waiting for it would wait until,
  /// so that the iteration simulator can give the host other work meanwhile.
  [[nodiscard]] double event_time_ns(Event event);
  /// When the last operation queued on `stream` completes, in virtual ns.
  [[nodiscard]] double stream_ready_ns(Stream stream);

  /// A collective (all-gather, reduce-scatter) among the node's GPUs on `stream`: `bytes` sent
  /// at `bytes_per_s` over the GPU links, an engine of its own (NVLink: it overlaps compute and
  /// PCIe). Returns the virtual end time.
  double enqueue_collective(Stream stream, double bytes, double bytes_per_s);

  /// Starts (or stops) recording every operation; take_ops() hands over what was recorded.
  void record_ops(bool on);
  [[nodiscard]] std::vector<SimOp> take_ops();

  [[nodiscard]] SimEngineStats link_stats();
  [[nodiscard]] SimEngineStats storage_stats();
  [[nodiscard]] SimEngineStats h2d_stats();
  [[nodiscard]] SimEngineStats d2h_stats();
  [[nodiscard]] SimEngineStats compute_stats();

  /// Bytes of device memory in use.
  [[nodiscard]] std::size_t used_bytes();
  /// Host ranges registered with host_register: start address -> bytes.
  [[nodiscard]] std::map<std::uintptr_t, std::size_t> registered_host_ranges();

 private:
  struct SimStream {
    double ready_ns = 0;
  };
  struct SimEvent {
    double time_ns = 0;
  };
  struct Engine {
    explicit Engine(const char* n) : name(n) {}
    const char* name;
    double free_ns = 0;
    SimEngineStats stats;
  };
  /// Host-DRAM usage as a step function of virtual time: rate in bytes/s from each key onwards.
  class DramTimeline {
   public:
    explicit DramTimeline(double capacity) : capacity_(capacity) { steps_[0.0] = 0.0; }
    /// Moves `bytes` starting at t0, at up to `max_rate`, where each byte moved costs
    /// `dram_factor` bytes of DRAM traffic. Returns the end time.
    double reserve(double t0, double bytes, double max_rate, double dram_factor);
    void prune(double before);

   private:
    std::map<double, double>::iterator split_at(double t);
    double capacity_;
    std::map<double, double> steps_;
  };

  void* do_allocate(std::size_t bytes) override;
  void do_deallocate(void* ptr, std::size_t bytes) override;
  Stream do_create_stream() override;
  void do_destroy_stream(Stream stream) override;
  Event do_create_event(bool timing) override;
  void do_destroy_event(Event event) override;
  void do_record_event(Event event, Stream stream) override;
  void do_stream_wait_event(Stream stream, Event event) override;
  bool do_event_query(Event event) override;
  void do_event_synchronize(Event event) override;
  float do_event_elapsed_ms(Event start, Event end) override;
  void do_stream_synchronize(Stream stream) override;
  void do_synchronize() override;
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) override;
  void do_memset_async(void* ptr, int value, std::size_t bytes, Stream stream) override;
  void do_host_register(void* ptr, std::size_t bytes) override;
  void do_host_unregister(void* ptr) override;
  MemInfo do_mem_info() override;
  /// Virtual memory like CUDA's: 2 MiB granules; in data mode the reservation is inaccessible
  /// host address space whose mapped granules become readable and writable.
  std::size_t do_vmm_granularity() override;
  void* do_reserve_address(std::size_t bytes) override;
  void do_release_address(void* base, std::size_t bytes) override;
  void do_map_memory(void* at, std::size_t bytes) override;
  void do_unmap_memory(void* at, std::size_t bytes) override;
  /// Runs the kernel's host form at its simulated time: HBM-bound, or bound by the simulated
  /// GPU's optimizer rate for a step.
  void do_enqueue_kernel(Stream stream, const DeviceKernel& kernel) override;
  [[nodiscard]] bool do_can_run(const DeviceKernel& kernel) const override;
  double do_host_now_ns() override;
  /// Charges the work to the virtual host clock (DRAM shared with DMA; a CPU step is also bound
  /// by cpu_update_params_per_s) and runs `body` in data mode.
  double do_run_host_work(const HostWork& work, const std::function<void()>& body) override;
  /// Storage transfers (the NVMe spill tier) run on an engine of their own.
  [[nodiscard]] bool do_times_storage() const override { return true; }
  void do_enqueue_storage(Stream stream, double bytes, double bytes_per_s) override;

  SimStream& stream_locked(Stream stream);
  SimEvent& event_locked(Event event);
  void check_device_range_locked(const void* ptr, std::size_t bytes, const char* what) const;
  bool host_pinned_locked(const void* ptr, std::size_t bytes) const;
  /// Schedules one operation on `engine` for `stream`; returns its end time.
  double schedule_locked(SimStream& s, Engine& engine, double bytes, double rate, double dram_factor);
  void set_host_now_locked(double t);

  SimConfig config_;
  std::mutex mutex_;
  double host_now_ns_ = 0;
  std::size_t used_ = 0;
  std::uintptr_t next_phantom_ = 0;
  struct Allocation {
    std::size_t bytes;
    std::unique_ptr<unsigned char, void (*)(void*)> data;
  };
  std::map<std::uintptr_t, Allocation> allocations_;
  std::map<std::uintptr_t, std::size_t> registered_;
  std::map<std::uintptr_t, std::size_t> reservations_;  ///< base -> bytes
  std::map<std::uintptr_t, std::size_t> mapped_;        ///< mapped granules of reservations
  SimStream default_stream_;
  std::unordered_map<void*, std::unique_ptr<SimStream>> streams_;
  std::unordered_map<void*, std::unique_ptr<SimEvent>> events_;
  Engine h2d_{"h2d"}, d2h_{"d2h"}, compute_{"compute"}, link_{"link"},
      storage_{"storage"};
  std::multimap<double, double> compute_busy_;  // the compute engine's kernels not yet done: start -> end
  double compute_longest_ns_ = 0;                // the longest of them (end - start): how far back one reaches
  bool recording_ = false;
  std::vector<SimOp> ops_;
  DramTimeline dram_;
};

/// SimConfig from the options table (sim_capacity, sim_phantom).
SimConfig sim_config_from_options();

}  // namespace memtide
