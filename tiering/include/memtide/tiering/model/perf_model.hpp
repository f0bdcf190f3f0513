#pragma once
/// @file
/// The update-phase performance model (paper Eq. 1, extended) and the planner built on it.
/// `PerfModel::predict` walks the subgroups as the UpdateScheduler runs them on a virtual clock
/// (the schedule it assumes, and what it counts beyond the paper, are in docs/architecture.md,
/// "Update-phase PerfModel"); `PerfModel::plan` searches placements. Also here: the fitting
/// functions (model/fitting.cpp) that turn device memory, a host budget and backward's time into
/// what a plan may hold.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memtide/tiering/model/placement.hpp"

namespace memtide {
struct SimConfig;
}  // namespace memtide

namespace memtide::tiering {

/// Throughputs the model runs on. Calibration keeps them current from measurements.
struct Rates {
  double h2d_bytes_per_s = 55e9;         ///< pinned host -> device
  double d2h_bytes_per_s = 55e9;         ///< device -> pinned host
  double cpu_update_params_per_s = 2e9;  ///< U_c: the fused CPU step (low-precision copy included)
  double gpu_update_params_per_s = 35e9; ///< U_g
  double cpu_downscale_params_per_s = 0; ///< D_c: a separate fp32 -> 16-bit pass; 0 = fused into U_c
  double host_dram_bytes_per_s = 220e9;  ///< host DRAM, shared by CPU updates and DMA
  double cpu_dram_bytes_per_param = 30;  ///< DRAM traffic of one CPU-updated param
  double nvme_read_bytes_per_s = 0;      ///< the NVMe tier's reads; 0 = no NVMe tier
  double nvme_write_bytes_per_s = 0;     ///< the NVMe tier's writes; 0 = no NVMe tier
};

/// The rates a SimDevice runs at, as the model sees them: comparing the model with the simulator
/// then tests the model's schedule, not its inputs. The CPU's DRAM traffic per param is the
/// fused step's with fp32 grads and a bf16 copy. (The simulator's per-operation latency has no
/// counterpart in the model.)
Rates sim_rates(const SimConfig& config);

/// What is being updated and what the GPU can hold.
struct Workload {
  std::vector<std::size_t> subgroup_params;  ///< params per subgroup, in update order
  std::size_t low_precision_bytes = 2;       ///< bytes per param of the model's copy (fp16/bf16)
  bool grads_on_host = true;                 ///< fp32 grads are in host memory
  /// Per subgroup: its fp32 gradient is already in device memory (kept there by the gradient
  /// path), so a GPU update needs no gradient upload. Empty: none is.
  std::vector<bool> grad_on_device;
  std::size_t gpu_slot_limit = 3;            ///< streamed subgroups that fit in the headroom at once
  std::size_t gpu_static_limit = 0;          ///< subgroups that may stay resident on the GPU
  /// Per subgroup: its state (fp32 params, exp_avg, exp_avg_sq: 12 B/param) lives on the NVMe
  /// tier. It is read before its update and written back after it (after the flush when updated
  /// on the GPU), `nvme_read_ahead` subgroups ahead; a static resident keeps its state on the GPU
  /// and moves nothing. Empty: none is.
  std::vector<bool> on_nvme;
  std::size_t nvme_read_ahead = 2;           ///< NVMe subgroups in host staging at once (>= 1)
  /// Bytes others copy host -> device at the start of the update phase: the layer window's first
  /// blocks of the next forward, fetched into the HBM the phase leaves free. They take the H2D
  /// link (and DRAM) first.
  double phase_h2d_bytes = 0;
};

/// Bytes per parameter of the optimizer state that moves between tiers: the fp32 param, exp_avg
/// and exp_avg_sq (what a streamed subgroup copies each way, what NVMe holds).
inline constexpr double kStateBytesPerParam = 12;
/// Bytes per parameter of the fp32 gradient; with the state, 16 B/param of host memory.
inline constexpr double kGradBytesPerParam = 4;
/// Bytes per parameter a mixed-precision model keeps on the GPU all iteration, whatever the plan:
/// its 16-bit params and its 16-bit gradients (what an update phase may not count as free).
inline constexpr double kGpuModelBytesPerParam = 4;

/// Streamed subgroups in flight at once: with three, one is being prefetched, one updated and one
/// flushed, so both PCIe directions and the GPU are busy; more buys nothing but memory.
inline constexpr std::size_t kUsefulSlots = 3;

/// The most subgroups a workload may have (2^20): 20B params at this count make subgroups of 19k,
/// whose ~10 us of per-operation cost exceeds their transfer time. Plans in well under a second.
inline constexpr std::size_t kMaxSubgroups = std::size_t{1} << 20;

/// Device memory a plan may use.
struct GpuBudget {
  std::uint64_t update_bytes = 0;    ///< free during the update phase only: streamed slots
  std::uint64_t resident_bytes = 0;  ///< free through the whole iteration: static residents
};

/// Bytes one GPU slot (or static resident) takes for subgroups of up to `largest` params: the
/// p, m, v arrays and, when it comes from the host, the gradient, each 512-byte aligned.
std::uint64_t gpu_slot_bytes(std::size_t largest, bool with_grad = true);

/// How static residents share device blocks. A resident of a few MiB alone would take part of a
/// shared 20 MiB allocator segment (PyTorch's CUDACachingAllocator, and memtide's, share one
/// among requests under 10 MiB), and the rest of it holds nothing the plan counted: at 500K params
/// per subgroup two 7.6 MiB residents took 20 MiB, the plan overran the device, and its residents
/// were given back. So `per_pack` consecutive subgroups (counted from the last) share one block of
/// at least 256 MiB, which gets a segment of its own rounded to 2 MiB (under 1% more): `pack_bytes`
/// is what a full pack reserves.
struct ResidentPacks {
  std::size_t per_pack = 1;
  std::uint64_t pack_bytes = 0;
  std::uint64_t slot_bytes = 0;  ///< one resident's arrays, gpu_slot_bytes(largest, true)
  /// Device bytes `residents` residents hold: whole packs, and a last one sized to its members.
  [[nodiscard]] std::uint64_t bytes_for(std::size_t residents) const {
    return residents / per_pack * pack_bytes + residents % per_pack * slot_bytes;
  }
};
ResidentPacks resident_packs(std::size_t largest);

/// The one place that turns device memory into what a plan may hold: sets
/// `work.gpu_slot_limit` (slots that fit `budget.update_bytes`) and `work.gpu_static_limit`
/// (residents, with their gradient, packed as resident_packs() says, that fit
/// `budget.resident_bytes` and what the useful slots leave of the update budget). Both at most
/// the number of subgroups.
void fit_gpu_budget(Workload& work, const GpuBudget& budget);

/// The one place that decides which subgroups live on NVMe: the fewest that bring the host state
/// (16 B/param) within `host_budget_bytes`, spread evenly over the update order and never among
/// the last `work.gpu_static_limit` (residents). Sets `work.on_nvme`; returns how many. Throws
/// InvalidArgument when even spilling every other subgroup's state cannot fit the budget.
std::size_t fit_host_budget(Workload& work, std::uint64_t host_budget_bytes);

/// The order in which an update phase reads the subgroups whose state is on NVMe (`spilled`,
/// one flag per subgroup; static residents are never read): the order the scheduler's host loop
/// needs them, a streamed subgroup's read `slots` streamed subgroups ahead of its update (it is
/// prefetched to the GPU that far ahead). The scheduler and the PerfModel's walk share it.
std::vector<std::size_t> nvme_read_order(const std::vector<Placement>& placement, const std::vector<bool>& spilled,
                                         std::size_t slots);

/// Staging buffers a phase needs: `read_ahead`, plus one per GPU slot that a spilled subgroup
/// may hold from its read until its flush.
std::size_t nvme_staging_buffers(const std::vector<Placement>& placement, const std::vector<bool>& spilled,
                                 std::size_t slots, std::size_t read_ahead);

/// A subgroup that could be updated on the host during backward: when its gradients are in host
/// memory and how long the host takes to update it, both in ns from backward's start.
struct BackwardCandidate {
  std::size_t subgroup = 0;
  double ready_ns = 0;
  double work_ns = 0;
};

/// The one place that decides which subgroups are updated during backward: those one host worker
/// finishes before `end_ns`, taken as they become ready (ties by subgroup), each starting when it
/// and the worker are free; one that would finish later is skipped. At most `cap`, in the order taken.
std::vector<std::size_t> fit_before_end(std::vector<BackwardCandidate> candidates, double end_ns, std::size_t cap);

/// Predicted busy time per resource and the resulting update time.
struct Prediction {
  double total_ns = 0;  ///< predicted update-phase time
  double bound_ns = 0;  ///< the busiest resource's time: no schedule of this placement beats it
  double cpu_ns = 0, gpu_ns = 0, h2d_ns = 0, d2h_ns = 0, dram_ns = 0;
  double nvme_ns = 0;   ///< NVMe reads plus writes, one drive serving both
  std::string busiest;  ///< "cpu", "gpu", "h2d", "d2h", "dram" or "nvme"
  double nvme_bytes = 0;  ///< bytes the NVMe tier reads and writes
  double h2d_bytes = 0, d2h_bytes = 0;  ///< bytes each copy engine moves
  double dram_bytes = 0;                ///< host DRAM traffic: CPU updates plus all DMA
};

/// A placement for one update phase.
struct Plan {
  Policy policy = Policy::automatic;
  std::vector<Placement> placement;
  double k = 0;                      ///< stride of streamed GPU updates (see interleave); 0 = none
  std::size_t gpu_slots = 0;         ///< GPU buffers the scheduler takes for streamed subgroups
  std::size_t static_residents = 0;
  Prediction prediction;
  std::size_t gpu_streamed = 0;      ///< subgroups placed Placement::gpu
};

/// The GPU's work in one forward or backward pass, for the whole-iteration prediction. Every
/// field is a time in ns on the resource named.
struct PassWork {
  double compute_ns = 0;     ///< kernels on the compute stream (recomputation included)
  double comm_ns = 0;        ///< collectives on their own link, overlapped with compute
  double lead_ns = 0;        ///< what must finish before the first kernel (the first all-gather)
  double stall_ns = 0;       ///< work that stalls the compute stream (a blocking gradient flush)
  double async_ns = 0;       ///< work that overlaps the pass and must end with it (asynchronous flushes)
  double tail_ns = 0;        ///< of async_ns, what can only start after the last kernel (the last flush)
};

/// A whole iteration, predicted.
struct IterationPrediction {
  double forward_ns = 0;
  double backward_ns = 0;
  double update_ns = 0;
  double total_ns = 0;
};

/// Stateless and cheap to copy; safe to use from several threads at once.
class PerfModel {
 public:
  /// Update time of `placement` (one entry per subgroup) under `rates`.
  /// Throws InvalidArgument (naming the field) for a non-positive or NaN rate, an empty workload,
  /// a zero-size subgroup, a placement of the wrong length, or streamed GPU subgroups when
  /// `work.gpu_slot_limit` is 0.
  [[nodiscard]] Prediction predict(const Workload& work, const Rates& rates,
                                   const std::vector<Placement>& placement) const;
  /// The one place where a policy becomes a placement: the plan `policy` gives for `work`. `k` is
  /// the stride of Algorithm 1 (one in every k streamable subgroups on the GPU, fractional k
  /// allowed, see interleave); the round(static_fraction * n) static residents, capped by
  /// `work.gpu_static_limit`, come last. cpu, static_split and interleaved (default k = 2) are
  /// placements by rule, as is automatic with `k`; automatic without `k` searches strides and
  /// static counts for the lowest predicted total, never worse than the other policies (the
  /// search is described in docs/architecture.md, "Planner"). `gpu_slots` is
  /// min(gpu_slot_limit, kUsefulSlots) when anything is streamed, else 0. Throws InvalidArgument
  /// as `predict` does, and for static_fraction outside [0, 1] or a k below 1 or not finite.
  [[nodiscard]] Plan plan(const Workload& work, const Rates& rates, Policy policy, double static_fraction = 0,
                          std::optional<double> k = std::nullopt) const;

  /// A whole iteration: each pass takes lead + max(compute + stall + tail, comm, async), the
  /// busiest of the streams that overlap (collectives and asynchronous flushes run beside the
  /// kernels; a blocking flush and the flush of the last gradients do not); the update phase is
  /// `update`'s total. Throws InvalidArgument for a negative or non-finite time.
  [[nodiscard]] IterationPrediction predict_iteration(const PassWork& forward, const PassWork& backward,
                                                      const Prediction& update) const;
};

}  // namespace memtide::tiering
