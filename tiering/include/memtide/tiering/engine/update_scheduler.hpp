#pragma once
/// @file
/// UpdateScheduler: one optimizer update phase for a Plan (paper Algorithm 1, section 4.3): CPU
/// subgroups stepped on the ThreadPool and uploaded, streamed GPU subgroups prefetched into slots,
/// stepped and flushed while the next prefetch runs, static residents kept on the GPU, spilled
/// subgroups stepped from NVMe staging. Events order everything and nothing is allocated inside
/// the loop; the same code runs on SimDevice and CudaDevice (docs/architecture.md, "Optimizer
/// state, gradient path, update phase").

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/tiering/nvme/nvme_staging.hpp"
#include "memtide/tiering/nvme/spill_state.hpp"
#include "memtide/tiering/engine/optimizer_state.hpp"
#include "memtide/tiering/engine/step_report.hpp"
#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

/// A run of a subgroup's gradient that a CPU update reads where it lies (a CPU tensor autograd
/// made) instead of the host gradient array: elements [begin, end) of the subgroup.
struct GradPiece {
  std::size_t begin = 0;
  std::size_t end = 0;
  const void* data = nullptr;  ///< element `begin`'s gradient
  DType dtype = DType::fp32;   ///< fp32, fp16 or bf16
};

/// Hyper-parameters of one step (see AdamwArgs).
struct StepParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;
  double grad_scale = 1.0;
  double clip = 1.0;
  bool l2 = false;
  /// Set when the gradients were already checked (the GradSink checks them on the GPU on their
  /// way to the host); nullopt: the scheduler checks every gradient before stepping anything.
  std::optional<bool> grads_finite;

  friend bool operator==(const StepParams&, const StepParams&) = default;
};

struct SchedulerConfig {
  std::size_t staging_buffers = 2;  ///< pinned low-precision staging buffers for CPU subgroups
  Stream main_stream{};             ///< the training stream: phase start orders after it; slots return to it
  CpuIsa isa = CpuIsa::automatic;
};

class UpdateScheduler final : public SpillResidents {
 public:
  /// `pool`: the CPU update's threads (null = the calling thread only). `staging_slabs`: where
  /// pinned staging comes from (null: heap memory registered with the device).
  UpdateScheduler(OptimizerState& state, CachingAllocator& allocator, ThreadPool* pool, SchedulerConfig config = {},
                  SlabSource* staging_slabs = nullptr);
  /// Moves static residents back to the host arrays, frees device memory, streams and events.
  ~UpdateScheduler();
  UpdateScheduler(const UpdateScheduler&) = delete;
  UpdateScheduler& operator=(const UpdateScheduler&) = delete;

  /// Runs one update phase for `plan` (one placement per subgroup; gpu_slots >= 1 when any is
  /// Placement::gpu). Returns when every update and transfer has completed. On an error (an
  /// NVMe read or write-back failed) the phase is stopped, every queued transfer completes and
  /// the error is rethrown; subgroups stepped before it keep their new state.
  StepReport run(const Plan& plan, const StepParams& params);

  /// For the next run only: subgroup i's CPU update reads these gradients where they are (in
  /// order, not overlapping, offsets local to the subgroup) and the host gradient array between
  /// them. Empty: the host array alone.
  void set_grad_pieces(std::size_t i, std::vector<GradPiece> pieces);

  /// The NVMe tier for subgroups with Subgroup::on_nvme (null: none may be). `read_ahead`:
  /// staging buffers beyond those GPU slots hold (>= 1).
  void set_nvme(NvmeStaging* staging, std::size_t read_ahead) override;

  /// Called with a subgroup's index before the scheduler writes its state (a CPU update, a GPU
  /// flush, a resident copied home): a running checkpoint save keeps its view of it there
  /// (StateSnapshot::protect), so the writer and the step overlap. For a subgroup on NVMe the
  /// hook also gets where its whole state is now (the staging buffer it was read into), else
  /// nulls. Null hook: nobody is told.
  using BeforeHostWrite = std::function<void(std::size_t, const float*, const float*, const float*)>;
  void set_before_host_write(BeforeHostWrite hook) { before_host_write_ = std::move(hook); }

  /// Copies the state of static residents back into the host arrays (checkpoints, tests).
  void sync_to_host();
  /// The same for subgroup `i` alone (nothing when it is not resident).
  void sync_to_host(std::size_t i) override;
  /// Moves every static resident back to the host and frees its device memory.
  void release_residents();
  /// Frees every static resident's device memory without copying it back: for when the host
  /// arrays were changed since the last sync_to_host and are now the truth (a checkpoint load).
  /// The next run moves the residents in again from the host.
  void discard_residents();
  [[nodiscard]] bool is_resident(std::size_t subgroup) const override;
  /// Subgroups resident on the GPU now.
  [[nodiscard]] std::size_t resident_count() const;
  /// Device bytes the scheduler holds between phases: its static residents and its counter.
  [[nodiscard]] std::uint64_t held_bytes() const;
  /// Device bytes the streamed slots of the last phase took (0 before the first).
  [[nodiscard]] std::uint64_t last_slot_bytes() const noexcept { return last_slot_bytes_; }

 private:
  enum class OpKind : std::uint8_t { h2d, d2h, gpu };
  struct Op {
    OpKind kind;
    Event start, end;
    double bytes;
    double params;
    const char* what;
    std::size_t subgroup;
  };
  struct Arrays {  ///< p, m, v, g of one subgroup in device memory
    void* block = nullptr;
    float* p = nullptr;
    float* m = nullptr;
    float* v = nullptr;
    float* g = nullptr;
  };

  // The phases of Algorithm 1.
  bool check_gradients(const StepParams& params);
  void begin_phase(const Plan& plan);
  void prefetch_in(std::size_t j);
  void gpu_update(std::size_t j, const StepParams& params);
  void static_update(std::size_t i, const StepParams& params);
  void cpu_update(std::size_t i, const StepParams& params);
  bool cpu_step(std::size_t i, const AdamwArgs& whole);
  StepReport end_phase(double phase_start_ns);
  /// After an error: waits for every stream and transfer, gives the slots back.
  void stop_phase() noexcept;
  /// Per entry of the state: on NVMe.
  [[nodiscard]] std::vector<bool> spilled() const;
  /// Subgroup i's state (p, m, v) from staging, or its host arrays.
  NvmeStaging::Staged host_state(std::size_t i);

  // Stream ordering, in one place: `work` runs on `stream` after `after`, between timing events.
  template <typename Work>
  Event enqueue(OpKind kind, const char* what, std::size_t subgroup, Stream stream, Event after, double bytes,
                double params, Work&& work);

  void place_residents(const std::vector<Placement>& placement);
  /// Subgroups [first, last) of pack j.
  [[nodiscard]] std::pair<std::size_t, std::size_t> pack_members(std::size_t j) const;
  void copy_back_async(std::size_t i);  ///< resident i's state D2H into its host arrays, queued
  Arrays carve(void* block, std::size_t n, bool with_grad) const;
  AdamwArgs args_for(const StepParams& params, std::size_t i) const;
  double host_now_ns();
  Event take_event();

  OptimizerState& state_;
  Device& device_;
  CachingAllocator& allocator_;
  ThreadPool* pool_;
  SchedulerConfig config_;
  bool phantom_;
  double cpu_bytes_per_param_ = 0;  ///< DRAM traffic of one CPU-updated param

  Stream prefetch_{}, upload_{}, compute_{}, flush_{};
  Event phase_start_{};
  std::vector<Event> events_;  ///< timing events, reused every phase
  std::size_t next_event_ = 0;
  std::vector<Op> ops_;

  std::vector<PinnedBuffer> staging_;
  std::vector<Event> staging_free_;
  PinnedBuffer host_counter_;
  unsigned int* device_counter_ = nullptr;

  std::vector<std::vector<GradPiece>> grad_pieces_;  ///< per subgroup, for the next run (set_grad_pieces)
  BeforeHostWrite before_host_write_;
  void before_host_write(std::size_t i, const NvmeStaging::Staged& now) const;
  std::vector<Arrays> residents_;  ///< per subgroup; block (its pack's) != null when GPU-resident
  ResidentPacks packs_;            ///< how residents share device blocks
  std::vector<void*> pack_blocks_;  ///< per pack, counted from the last subgroup; null when empty
  std::vector<Arrays> slots_;
  std::vector<Event> slot_free_;
  std::vector<std::size_t> streamed_;  ///< subgroups placed Placement::gpu, in order
  std::vector<Event> prefetched_;      ///< per streamed subgroup
  std::vector<std::size_t> streamed_index_;  ///< subgroup -> index in streamed_
  AllocatorStats setup_stats_{};
  std::int64_t setup_allocations_ = 0;
  std::size_t cpu_count_ = 0;
  double cpu_busy_ns_ = 0;
  double phase_start_ns_ = 0;       // host clock at the running phase's start
  std::vector<TieringOp> cpu_log_;  // the running phase's CPU updates
  double cpu_params_ = 0;
  std::uint64_t cpu_ops_ = 0;
  bool cpu_nonfinite_ = false;
  std::size_t params_[3] = {0, 0, 0};
  std::uint64_t last_slot_bytes_ = 0;
  NvmeStaging* nvme_ = nullptr;
  bool nvme_active_ = false;  ///< the running phase has subgroups on NVMe (begun on nvme_)
  std::size_t nvme_read_ahead_ = 1;
  std::vector<NvmeStaging::Staged> staged_;  ///< per streamed subgroup: its state in staging
};

}  // namespace memtide::tiering
