#pragma once
/// @file
/// Whole training iterations on a phantom SimDevice, with the same engine code a GPU run uses:
/// the real CachingAllocator and its PhaseTracker see every allocation of forward and backward,
/// the UpdateEngine's gradient path takes the gradients during backward, and its plan and the
/// real UpdateScheduler run the update phase. Only the model's kernels and collectives are
/// stand-ins (intervals of the right length on the right engines), so that a 20B-parameter
/// iteration simulates in well under a second with no GPU and no host memory for the state.
///
/// One rank of a ZeRO-3 data-parallel group is simulated: it holds 1/N of the parameters (fp16)
/// and of the optimizer state (fp32, in host memory), all-gathers each layer's parameters
/// before using it (forward, and again in backward) and reduce-scatters each layer's gradients.
///
/// Three contenders run on the same model and node, each as its published behaviour says (the
/// assumptions are written next to each in iteration_sim.cpp and docs/simulator.md):
/// - zero3_offload: DeepSpeed ZeRO-3 with the optimizer offloaded. Gradients are flushed as
///   Deep Optimizer States' Figure 6 measured: fp16 through pageable staging with a CPU upcast,
///   2.5 GB/s, stalling the GPU. Every update on the CPU, then the fp16 params uploaded.
/// - twinflow: ZeRO-3 with a static 20% of the optimizer state resident on the GPU (updated
///   there, its gradients kept on the GPU); the rest as zero3_offload.
/// - memtide: gradients upcast on the GPU and flushed asynchronously in fp32 by the engine's
///   gradient path; the update phase planned by the PerfModel (policy auto) and run by the
///   UpdateScheduler.

#include <cstdint>
#include <string>
#include <vector>

#include "memtide/allocator/phase_tracker.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/tiering/window/layer_window.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/tiering/engine/update_scheduler.hpp"

namespace memtide::tiering {

/// A GPT-shaped decoder: `layers` blocks of 12 h^2 + 13 h parameters and a tied embedding.
struct ModelShape {
  std::string name = "custom";
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  int seq = 2048;          ///< the paper's sequence length
  int micro_batch = 1;     ///< the paper's micro-batch (1: no configuration runs out of memory)
  int micro_batches = 1;   ///< per optimizer step (gradient accumulation)
  int vocab = 50304;       ///< GPT-NeoX's padded vocabulary
  double nominal_params = 0;  ///< the size its name states (7e9 for "7B"); 0 for a custom shape

  [[nodiscard]] double layer_params() const;
  [[nodiscard]] double params() const;
  /// Throws InvalidArgument naming the first field that is not positive, or hidden not a
  /// multiple of heads.
  void validate() const;
  /// The Table 2 models of Deep Optimizer States: "7B", "8.3B", "10B", "13B", "20B", and "40B"
  /// (8192 hidden, 48 layers: STRONGHOLD's scale, for the layer window). Throws
  /// InvalidArgument naming the accepted names.
  static ModelShape table2(const std::string& name);
  static const std::vector<std::string>& table2_names();
};

/// The node, and what is assumed of it. The defaults are the paper's 4 x H100 testbed.
struct NodeSpec {
  int gpus = 4;  ///< GPUs per node, one rank each
  /// Nodes in the job: the ZeRO-3 data-parallel degree is nodes x gpus. Above one, each
  /// collective is modelled as two rings (docs/simulator.md): inside the node over the GPU links,
  /// and across nodes over each GPU's own NIC (a rail-optimised network), one hop's latency per
  /// step of the inter-node ring.
  int nodes = 1;
  double inter_node_bytes_per_s = 50e9;  ///< each GPU's NIC, each way (400 Gb/s InfiniBand NDR)
  double inter_node_latency_s = 5e-6;    ///< one step of the inter-node ring
  /// Achieved FLOP/s of the model's kernels per GPU. 100 TFLOP/s (a tenth of an H100 SXM's dense
  /// bf16 peak: micro-batch 1 keeps the GEMMs small, and ZeRO-3's fetch hooks sit between them)
  /// makes the simulated ZeRO-3 baseline reach the ~30 TFLOP/s per GPU over whole iterations that
  /// the paper measured for it (Figure 15, 0% on the GPU).
  double gpu_flops = 100e12;
  /// Achieved bandwidth of a ring all-gather or reduce-scatter per GPU (NVLink 4 carries 450 GB/s
  /// each way; collectives reach about two thirds of it).
  double link_bytes_per_s = 300e9;
  /// DeepSpeed's fp16 gradient flush through pageable staging (Figure 6: allocate pageable
  /// memory, D2H, upcast on the CPU, one after another): 2.5 GB/s, and the GPU waits for it.
  double pageable_flush_bytes_per_s = 2.5e9;
  bool checkpointing = true;              ///< activation checkpointing (the paper: on)
  std::size_t subgroup_params = 100'000'000;  ///< the paper's subgroup size
  double twinflow_static_fraction = 0.2;  ///< the paper's TwinFlow ratio
  /// Host memory for one rank's optimizer state (16 B/param of its shard); 0: as much as it
  /// needs. Below that, the subgroups that do not fit live on NVMe (every contender: ZeRO-Infinity
  /// spills the same way), read and written at the rates below: the rank's share of the node's
  /// drives.
  std::uint64_t host_budget_bytes = 0;
  double nvme_read_bytes_per_s = 3e9;
  double nvme_write_bytes_per_s = 2e9;
  /// The layer window (STRONGHOLD; the memtide contender only): 0 keeps the rank's fp16
  /// parameter shard in device memory for good; m > 0 keeps it in host memory and only m blocks'
  /// shards in m + 1 device buffers, each copied in m blocks ahead of its use (forward, then
  /// backward) and the first m of the next forward during the update phase; kWindowAuto sizes m
  /// with choose_window from the blocks' modelled times and the memory the rest leaves. The
  /// output head (the tied embedding) stays resident.
  int window_blocks = 0;
  static constexpr int kWindowAuto = -1;
  /// CPU updates during backward (STRONGHOLD 3-E; the memtide contender only): a subgroup the
  /// previous plan placed on the CPU is updated by the host as soon as its gradients are home,
  /// in the time the host would otherwise wait for the GPU, while backward goes on; the update
  /// phase runs what is left. With `speculative_backup` (clipping or loss scaling: the update is
  /// speculative and redone if the norm clips or a gradient overflows, which is taken not to
  /// happen here) each such subgroup's params and moments are saved first: 24 more DRAM bytes per
  /// param.
  bool updates_during_backward = false;
  bool speculative_backup = true;
  /// One GPU and its share of the host: capacity, PCIe, update rates, host DRAM (phantom is set
  /// by the simulator).
  SimConfig device;
  /// Throws InvalidArgument naming the first field out of range.
  void validate() const;
};

enum class Contender { zero3_offload, twinflow, memtide };
/// "zero3_offload", "twinflow", "memtide".
const char* to_string(Contender c) noexcept;
inline constexpr Contender kContenders[] = {Contender::zero3_offload, Contender::twinflow, Contender::memtide};

struct PhaseTimes {
  double forward_s = 0;
  double backward_s = 0;
  double update_s = 0;
  double iteration_s = 0;
};

/// One contender's last simulated iteration.
struct IterationResult {
  Contender contender = Contender::memtide;
  PhaseTimes simulated;
  PhaseTimes predicted;  ///< PerfModel::predict_iteration, from the same inputs
  /// Peak allocated device memory per phase (forward, backward, update, other): what the phase
  /// needs at once, the engine's loans (residents, slots, kept gradients) included.
  std::uint64_t peak_bytes[kPhaseCount] = {};
  /// Peak reserved per phase: the allocator's segments, cached free blocks included.
  std::uint64_t peak_reserved_bytes[kPhaseCount] = {};
  std::uint64_t capacity_bytes = 0;
  Plan plan;                     ///< the update's placement
  double update_bound_s = 0;     ///< the resource bound of that placement
  std::size_t nvme_subgroups = 0;  ///< subgroups on NVMe (NodeSpec::host_budget_bytes)
  double nvme_bytes = 0;           ///< bytes the NVMe tier read and wrote in the update phase
  double grad_bytes_to_host = 0; ///< gradient bytes sent to host memory in the iteration
  /// Allocations in the iteration that found no cached block and had to release the cache and
  /// retry, each waiting for the device first (AllocatorStats::num_alloc_retries): memory pressure.
  std::int64_t alloc_retries = 0;
  /// The layer window the iteration ran with (0: none); with NodeSpec::kWindowAuto, how it was
  /// chosen (choose_window's words and numbers).
  int window_blocks = 0;
  std::string window_why;
  double window_h2d_bytes = 0;   ///< parameter bytes the window copied in during the iteration
  /// The iteration's all-gathers and reduce-scatters end to end (they overlap compute), in s:
  /// across nodes, the modelled hierarchical rings (NodeSpec::nodes).
  double collective_s = 0;
  /// Params updated during backward (NodeSpec::updates_during_backward), and the host's time on them then.
  double backward_update_params = 0;
  double backward_update_busy_s = 0;
  /// When the first forward, the first backward and the update began and when the update ended,
  /// in s on the virtual clock.
  double phase_start_s[3] = {};
  double end_s = 0;
  /// Every phase in the order it ran: with micro-batches, each one's forward and backward, then
  /// the update.
  struct PhaseSpan {
    Phase phase = Phase::forward;
    double start_s = 0;
    double end_s = 0;
  };
  std::vector<PhaseSpan> spans;
  std::vector<SimOp> ops;        ///< every operation of the iteration (SimulationOptions::record_ops)
  /// Device memory over the iteration (SimulationOptions::record_ops): sampled by the host at
  /// every phase mark and block, on the virtual clock.
  struct MemorySample {
    double t_ns = 0;
    std::uint64_t allocated = 0;
    std::uint64_t reserved = 0;
  };
  std::vector<MemorySample> memory;
  /// The update phase's operations with their subgroups (record_ops), start and end in ns on the
  /// virtual clock.
  std::vector<TieringOp> tiering;
  /// The NVMe tier's transfers and waits in the update phase (record_ops), on the virtual clock.
  std::vector<NvmeTransfer> nvme_transfers;
  /// The rank's host memory as the host budget counts it (NodeSpec::host_budget_bytes): the fp32
  /// state of the subgroups kept in host memory (16 B/param), the gradients of those on NVMe
  /// (4 B/param) and the read-ahead's staging; and the spill file's bytes (12 B/param spilled).
  double host_state_bytes = 0;
  double nvme_staging_bytes = 0;
  double nvme_file_bytes = 0;

  /// A checkpoint save beside training (SimulationOptions::save; SimulatedSave): asked for after
  /// the last reported iteration, then iterations run until it is written.
  struct SaveRun {
    bool ran = false;
    double state_bytes = 0;          ///< 12 B/param of the rank's shard
    double write_bytes_per_s = 0;    ///< the rate it was written at
    double save_s = 0;               ///< from the ask to the last byte
    std::vector<double> iteration_s;  ///< each iteration that ran beside it
    std::vector<double> waited_s;     ///< how long that iteration's steps waited for the writer
    double copied_bytes = 0;          ///< copied aside by the steps (copy-on-write)
    double peak_buffer_bytes = 0;
    double buffer_bound_bytes = 0;
  };
  SaveRun save;
};

struct SimulationOptions {
  /// Iterations run; the last is reported. The first ones fill the phase tracker's history and
  /// the calibration, as on a GPU.
  int iterations = 3;
  bool record_ops = false;
  /// After the reported iteration, ask for a checkpoint save of the rank's optimizer state and
  /// run iterations beside it until it is written (at most 1000): IterationResult::save.
  bool save = false;
  /// The save's disk rate (0: the rank's NVMe write rate, NodeSpec::nvme_write_bytes_per_s).
  double save_write_bytes_per_s = 0;
  std::uint64_t save_buffer_bytes = 0;  ///< its copy-on-write buffer (0: two of the largest subgroup)
};

/// The layer window's inputs for `model` on `node` (one rank): per block its modelled forward
/// and backward (recomputation included), its shard's copy in (fp16) and its gradient shard's
/// flush out (fp32, memtide's gradient path), and the device bytes its buffer holds.
std::vector<BlockProfile> window_profiles(const ModelShape& model, const NodeSpec& node);

/// Simulates `options.iterations` iterations of `contender`. Deterministic: the same inputs give
/// the same result. Throws InvalidArgument for a bad shape or node, and OutOfMemory when the
/// model does not fit the device (with the phase and the bytes).
IterationResult simulate_iteration(const ModelShape& model, const NodeSpec& node, Contender contender,
                                   const SimulationOptions& options = {});

}  // namespace memtide::tiering
