#include "memtide/simulator/iteration_sim.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/engine/backward_choice.hpp"
#include "memtide/tiering/engine/optimizer_state.hpp"
#include "memtide/simulator/save_sim.hpp"
#include "memtide/tiering/engine/update_engine.hpp"
#include "sim_checks.hpp"

namespace memtide::tiering {
namespace {

using sim::require;

// The model as the simulator walks it: `layers` blocks, then the tied embedding used as the
// output head ("unit" layers + 1; the embedding lookup at the start costs no FLOPs worth counting).
struct Units {
  const ModelShape& m;
  const NodeSpec& node;
  double tokens;  // per micro-batch

  [[nodiscard]] int count() const { return m.layers + 1; }
  [[nodiscard]] bool head(int u) const { return u == m.layers; }
  [[nodiscard]] double params(int u) const {
    return head(u) ? static_cast<double>(m.vocab) * m.hidden : m.layer_params();
  }
  // This rank's share of a unit (ZeRO-3 cuts every parameter over all ranks), in elements.
  [[nodiscard]] std::size_t shard(int u) const {
    return static_cast<std::size_t>(std::ceil(params(u) / (static_cast<double>(node.gpus) * node.nodes)));
  }
  // Forward FLOPs: 2 per weight per token for the matmuls, plus attention's two s x s products.
  [[nodiscard]] double forward_flops(int u) const {
    const double h = m.hidden;
    if (head(u)) return 2 * tokens * m.vocab * h;
    return 2 * tokens * 12 * h * h + 4.0 * m.micro_batch * m.seq * static_cast<double>(m.seq) * h;
  }
  // Working activations of one block while it runs, fp16 (Megatron-LM's s b h (34 + 5 a s / h));
  // for the head, the fp32 logits.
  [[nodiscard]] std::size_t activation_bytes(int u) const {
    const double h = m.hidden;
    if (head(u)) return static_cast<std::size_t>(tokens * m.vocab * 4);
    return static_cast<std::size_t>(tokens * h * (34 + 5.0 * m.heads * m.seq / h));
  }
  // What a block keeps for backward: its input (checkpointing) or all its activations.
  [[nodiscard]] std::size_t kept_bytes(int u) const {
    if (head(u)) return 0;
    return node.checkpointing ? static_cast<std::size_t>(tokens * m.hidden * 2) : activation_bytes(u);
  }
  [[nodiscard]] double ns(double flops) const { return flops / node.gpu_flops * 1e9; }
  // A ring collective moves (N - 1) / N of the full unit's fp16 bytes through each GPU's links.
  [[nodiscard]] double collective_bytes(int u) const {
    return params(u) * 2 * (node.gpus - 1) / static_cast<double>(node.gpus);
  }
  // How long an all-gather or reduce-scatter of unit u takes, in ns. Across M nodes (modelled,
  // not simulated): a ring among the M ranks of each local index over their own NICs first,
  // (M - 1) / (M N) of the unit each way plus a hop's latency per step, then the node's ring.
  [[nodiscard]] double collective_ns(int u) const {
    const double intra = collective_bytes(u) / node.link_bytes_per_s * 1e9;
    if (node.nodes == 1) return intra;
    const double nodes = node.nodes;
    const double inter = params(u) * 2 * (nodes - 1) / (nodes * node.gpus) / node.inter_node_bytes_per_s * 1e9 +
                         (nodes - 1) * node.inter_node_latency_s * 1e9;
    return intra + inter;
  }
};

// One rank's machine and the engine on it, for all iterations of one contender.
class Rank {
 public:
  Rank(const ModelShape& model, const NodeSpec& node, Contender contender, int window)
      : model_(model), node_(node), contender_(contender), units_{model, node, double(model.seq) * model.micro_batch},
        device_(phantom(node.device)), allocator_(device_), arena_(HostArenaConfig{}),
        window_(window < model.layers ? window : 0) {
    try {
      set_up(node, contender);
    } catch (...) {
      tear_down();  // out of memory for the window's buffers, say: nothing stays allocated
      throw;
    }
  }

  /// Asks for a checkpoint save (SimulatedSave) and runs iterations from `first` on beside it
  /// until it is written.
  IterationResult::SaveRun save_beside(int first, double rate, std::uint64_t buffer) {
    std::vector<std::size_t> sizes;
    for (std::size_t s = 0; s < n_; s += node_.subgroup_params) sizes.push_back(std::min(n_, s + node_.subgroup_params) - s);
    std::shared_ptr<SimulatedSave> save;
    engine_->start_save([&] {
      save = std::make_shared<SimulatedSave>(device_, sizes, rate, buffer);
      return save;
    });
    IterationResult::SaveRun out;
    out.ran = true;
    out.state_bytes = static_cast<double>(save->total_bytes());
    out.write_bytes_per_s = rate;
    out.buffer_bound_bytes = static_cast<double>(save->buffer_bound());
    for (int i = first; !save->done(); ++i) {
      require(i - first < 1000, "simulate_iteration: the checkpoint save (" + format_bytes(save->total_bytes()) + " at " +
                                    format_bytes(static_cast<std::uint64_t>(rate)) +
                                    "/s) is not written after 1000 iterations: its write rate "
                                    "(save_write_bytes_per_s, --save-write) is too low");
      const double waited = save->waited_ns();
      out.iteration_s.push_back(iterate(i, false).simulated.iteration_s);
      out.waited_s.push_back((save->waited_ns() - waited) / 1e9);
    }
    out.save_s = (save->end_ns() - save->start_ns()) / 1e9;
    out.copied_bytes = static_cast<double>(save->copied_bytes());
    out.peak_buffer_bytes = static_cast<double>(save->peak_buffer_bytes());
    return out;
  }

  /// The most device memory forward and backward held so far, less the engine's loans.
  [[nodiscard]] std::uint64_t own_peak() const { return own_peak_; }

  ~Rank() { tear_down(); }

 private:
  void set_up(const NodeSpec& node, Contender contender) {
    compute_ = device_.create_stream();
    comm_ = device_.create_stream();
    flush_ = device_.create_stream();
    // The rank's flat shard: every unit's share, in layer order; subgroups cut it.
    for (int u = 0; u < units_.count(); ++u) {
      offset_.push_back(n_);
      n_ += units_.shard(u);
    }
    std::vector<std::pair<std::size_t, std::size_t>> subgroups;
    for (std::size_t s = 0; s < n_; s += node.subgroup_params) subgroups.emplace_back(s, std::min(n_, s + node.subgroup_params));
    EngineConfig config;
    config.defaults = sim_rates(device_.config());
    config.nvme.host_budget_bytes = node.host_budget_bytes;
    config.nvme.read_bytes_per_s = node.nvme_read_bytes_per_s;
    config.nvme.write_bytes_per_s = node.nvme_write_bytes_per_s;
    engine_ = std::make_unique<UpdateEngine>(allocator_, arena_, n_, std::move(subgroups), nullptr, config);
    if (window_ == 0) {
      engine_->model_params(DType::bf16);  // the rank's fp16 params live in device memory for good
    } else {
      open_window();
    }
    if (node.updates_during_backward && contender == Contender::memtide) {
      upload_ = device_.create_stream();
      upload_host_ = static_cast<unsigned char*>(reserve_phantom_host(n_ * 2));
      device_.host_register(upload_host_, n_ * 2);
    }
  }

  void tear_down() {
    if (upload_host_ != nullptr) {
      device_.synchronize();
      device_.destroy_stream(upload_);
      device_.host_unregister(upload_host_);
    }
    engine_.reset();
    close_window();
    for (const auto& [p, held] : held_) allocator_.deallocate(p, held.first, held.second);
    device_.destroy_stream(compute_);
    device_.destroy_stream(comm_);
    device_.destroy_stream(flush_);
  }

 public:
  IterationResult iterate(int iteration, bool record) {
    IterationResult out;
    out.contender = contender_;
    out.capacity_bytes = device_.config().capacity;
    device_.record_ops(record);
    (void)device_.take_ops();
    recording_ = record;
    memory_.clear();
    const double bytes_before = engine_->grad_bytes_to_host();
    const std::int64_t retries_before = allocator_.stats().num_alloc_retries;

    window_h2d_bytes_ = 0;
    collective_ns_ = 0;
    if (window_ > 0 && next_fetch_ == 0) prefetch_window();  // the first iteration: no update before it
    // Gradient accumulation as ZeRO-3 runs it: each micro-batch's forward, then its backward, so
    // one micro-batch's activations are alive at a time; the update follows the last.
    const double t0 = now_s();
    PassWork forward, backward;
    double forward_s = 0, backward_s = 0, t1 = t0, last_backward_start = t0;
    out.spans.clear();
    for (int mb = 0; mb < model_.micro_batches; ++mb) {
      const bool last = mb + 1 == model_.micro_batches;
      const double f0 = now_s();
      allocator_.mark_phase(Phase::forward);
      sample();
      std::vector<void*> kept;
      this->forward(kept, forward);
      device_.synchronize();
      const double b0 = now_s();
      if (mb == 0) t1 = b0;
      forward_s += b0 - f0;
      out.spans.push_back({Phase::forward, f0, b0});
      allocator_.mark_phase(Phase::backward);
      sample();
      if (last) {
        last_backward_start = b0;
        begin_backward_updates();
        backward_updates_on_ = bwd_enabled_;  // the accumulation boundary
      }
      this->backward(kept, backward);
      backward_updates_on_ = false;
      if (last) {
        work_until(device_.stream_ready_ns(compute_));  // the host keeps updating while the GPU ends backward
        if (pushed_) (void)engine_->finish_grads();
        pushed_ = false;
        device_.synchronize();
      } else {
        // The next forward starts when this backward's compute has; its gradients drain meanwhile.
        device_.stream_synchronize(compute_);
      }
      const double e = now_s();
      backward_s += e - b0;
      out.spans.push_back({Phase::backward, b0, e});
    }
    const double t2 = now_s();
    last_backward_ns_ = (t2 - last_backward_start) * 1e9;

    allocator_.mark_phase(Phase::update);
    sample();
    if (window_ > 0) {
      // The next forward's first window comes in while the update phase runs (it contends with
      // the update's own copies on the H2D engine, as on a GPU).
      next_use_ = next_fetch_ = 0;
      prefetch_window();
    }
    const Policy policy = contender_ == Contender::memtide ? Policy::automatic
                          : contender_ == Contender::twinflow ? Policy::static_split
                                                              : Policy::cpu;
    const double fraction = contender_ == Contender::twinflow ? node_.twinflow_static_fraction : 0.0;
    if (window_ > 0) {
      // The window's prefetch above takes the H2D link first: the plan counts it.
      double bytes = 0;
      for (int u = 0; u < std::min(window_, model_.layers); ++u) bytes += static_cast<double>(units_.shard(u) * 2);
      engine_->set_phase_h2d_bytes(bytes);
    }
    finish_backward_updates();  // what backward began ends first
    if (contender_ == Contender::memtide && node_.updates_during_backward) {
      engine_->set_done_before_phase(bwd_done_);  // the plan is made for the rest
    }
    const EnginePlan plan = engine_->plan(policy, fraction);
    std::vector<Segment> segments;
    const auto& groups = engine_->subgroups();
    for (std::size_t i = 0; i < groups.size(); ++i) {
      StepParams p;
      p.step = iteration + 1;
      segments.push_back(Segment{i, groups[i].first, groups[i].second, p});
    }
    // The gradients were checked on their way (the engine's path) or are taken as finite (the
    // baselines'): nothing to scan in a phantom host array.
    const EngineStep step = engine_->step(plan.plan.placement, plan.plan.gpu_slots, segments, 1.0, 1.0, false,
                                          false, plan.plan.prediction.total_ns, true);
    device_.synchronize();
    const double t3 = now_s();
    sample();
    last_placement_ = plan.plan.placement;

    out.simulated = PhaseTimes{forward_s, backward_s, t3 - t2, t3 - t0};
    out.spans.push_back({Phase::update, t2, t3});
    const IterationPrediction predicted = PerfModel{}.predict_iteration(forward, backward, plan.plan.prediction);
    out.predicted = PhaseTimes{predicted.forward_ns / 1e9, predicted.backward_ns / 1e9, predicted.update_ns / 1e9,
                               predicted.total_ns / 1e9};
    (void)engine_->observe_iteration(predicted.total_ns, out.simulated.iteration_s * 1e9);
    const PhaseReport report = allocator_.phase_report();
    for (int p = 0; p < kPhaseCount; ++p) {
      out.peak_bytes[p] = report.running.phases[p].peak_allocated;
      out.peak_reserved_bytes[p] = report.running.phases[p].peak_reserved;
    }
    out.plan = plan.plan;
    out.update_bound_s = plan.plan.prediction.bound_ns / 1e9;
    out.nvme_subgroups = engine_->nvme_info().spilled;
    out.nvme_bytes = step.total.nvme.read_bytes + step.total.nvme.write_bytes;
    {
      const NvmeTierInfo nvme = engine_->nvme_info();
      const auto spilled = static_cast<double>(nvme.spilled_params);
      // A phantom device has no staging buffers to count: the read-ahead's, as the budget counts them.
      double largest = 0;
      for (std::size_t g = 0; g < engine_->on_nvme().size(); ++g) {
        const std::size_t lo = g * node_.subgroup_params;
        if (engine_->on_nvme()[g]) largest = std::max(largest, static_cast<double>(std::min(n_, lo + node_.subgroup_params) - lo));
      }
      out.nvme_staging_bytes = nvme.spilled ? static_cast<double>(EngineConfig{}.nvme.read_ahead) * 12.0 * largest : 0.0;
      out.nvme_file_bytes = 12.0 * spilled;
      out.host_state_bytes = 16.0 * (static_cast<double>(n_) - spilled) + 4.0 * spilled + out.nvme_staging_bytes;
    }
    out.grad_bytes_to_host = engine_->grad_bytes_to_host() - bytes_before + blocking_bytes_;
    blocking_bytes_ = 0;
    out.window_blocks = window_ > 0 ? window_ : 0;
    out.backward_update_params = bwd_params_;
    out.backward_update_busy_s = bwd_busy_ns_ / 1e9;
    out.window_h2d_bytes = window_h2d_bytes_;
    out.collective_s = collective_ns_ / 1e9;
    out.alloc_retries = allocator_.stats().num_alloc_retries - retries_before;
    out.phase_start_s[0] = t0;
    out.phase_start_s[1] = t1;
    out.phase_start_s[2] = t2;
    out.end_s = t3;
    if (record) {
      out.ops = device_.take_ops();
      out.memory = std::move(memory_);
      for (TieringOp op : step.total.ops) {
        op.start_ns += step.total.phase_start_ns;
        op.end_ns += step.total.phase_start_ns;
        out.tiering.push_back(op);
      }
      out.nvme_transfers = step.total.nvme_transfers;
    }
    recording_ = false;
    device_.record_ops(false);
    return out;
  }

 private:
  static SimConfig phantom(SimConfig c) {
    c.phantom = true;
    return c;
  }
  double now_s() { return device_.now_ns() / 1e9; }

  // Every allocation of the passes and the window goes through these, so that a pass an out of
  // memory error cut short leaves nothing behind: ~Rank gives back what is still held.
  void* take(std::size_t bytes, Stream stream) {
    void* p = allocator_.allocate(bytes, stream);
    held_.emplace(p, std::pair{bytes, stream});
    return p;
  }
  void give(void* p, std::size_t bytes, Stream stream) {
    allocator_.deallocate(p, bytes, stream);
    held_.erase(p);
  }

  // All-gathers unit u's fp16 params on the link; the buffer is the compute stream's once the
  // event fires.
  struct Gathered {
    void* buffer;
    Event ready;
  };
  Gathered gather(int u, PassWork& work) {
    const auto bytes = static_cast<std::size_t>(units_.params(u) * 2);
    void* buffer = take(bytes, comm_);
    const double t = units_.collective_ns(u);
    const bool windowed = window_ > 0 && !units_.head(u);
    if (windowed) take_from_window(u);  // the all-gather reads the shard from its window buffer
    enqueue_collective(u);
    if (windowed) release_to_window();
    work.comm_ns += t;
    if (work.lead_ns == 0) work.lead_ns = t;
    Event ready = device_.create_event();
    device_.record_event(ready, comm_);
    return {buffer, ready};
  }
  void enqueue_collective(int u) {
    const double ns = units_.collective_ns(u);
    collective_ns_ += ns;
    if (node_.nodes == 1) {
      device_.enqueue_collective(comm_, units_.collective_bytes(u), node_.link_bytes_per_s);
      return;
    }
    // Across nodes the link engine is busy for the modelled time (in the node ring's bytes).
    device_.enqueue_collective(comm_, ns / 1e9 * node_.link_bytes_per_s, node_.link_bytes_per_s);
  }
  // After the compute stream's last use of a gathered unit (it waited for g.ready).
  void release(Gathered g, std::size_t bytes) {
    device_.destroy_event(g.ready);
    allocator_.record_stream(g.buffer, compute_);
    give(g.buffer, bytes, comm_);
  }
  void compute(double flops, PassWork& work) {
    const double ns = units_.ns(flops);
    device_.enqueue_compute(compute_, 0, {}, ns);
    work.compute_ns += ns;
  }
  // The host runs at most two units ahead of the GPU, as ZeRO-3's prefetch does: it waits for
  // the unit before the previous one. (A host that ran a whole pass ahead would hold every
  // gathered unit at once, which no runtime does.)
  void sample() {
    if (!recording_) return;
    const AllocatorStats st = allocator_.stats();
    memory_.push_back({device_.now_ns(), static_cast<std::uint64_t>(st.allocated_bytes[0].current),
                       static_cast<std::uint64_t>(st.reserved_bytes[0].current)});
  }
  void throttle() {
    sample();
    // What forward and backward need of their own, the engine's loans aside (it gives them back).
    const std::uint64_t allocated = static_cast<std::uint64_t>(allocator_.stats().allocated_bytes[0].current);
    const std::uint64_t loans = engine_->resident_bytes() + engine_->kept_grad_bytes();
    own_peak_ = std::max(own_peak_, allocated > loans ? allocated - loans : 0);
    Event done = device_.create_event();
    device_.record_event(done, compute_);
    in_flight_.push_back(done);
    if (in_flight_.size() > 2) {
      work_until(device_.event_time_ns(in_flight_.front()));  // instead of idling
      device_.event_synchronize(in_flight_.front());
      device_.destroy_event(in_flight_.front());
      in_flight_.erase(in_flight_.begin());
    }
  }
  void drain() {
    for (Event e : in_flight_) device_.destroy_event(e);
    in_flight_.clear();
  }

  void forward(std::vector<void*>& kept, PassWork& work) {
    std::optional<Gathered> next = gather(0, work);
    for (int u = 0; u < units_.count(); ++u) {
      Gathered g = *next;
      next.reset();
      if (u + 1 < units_.count()) next = gather(u + 1, work);  // prefetch: overlaps this unit
      device_.stream_wait_event(compute_, g.ready);
      void* act = take(units_.activation_bytes(u), compute_);
      compute(units_.forward_flops(u), work);
      if (const std::size_t k = units_.kept_bytes(u); k > 0) {
        kept.push_back(node_.checkpointing ? take(k, compute_) : act);
      }
      if (node_.checkpointing || units_.head(u)) give(act, units_.activation_bytes(u), compute_);
      release(g, static_cast<std::size_t>(units_.params(u) * 2));
      throttle();
    }
    drain();
  }

  void backward(std::vector<void*>& kept, PassWork& work) {
    std::optional<Gathered> next = gather(units_.count() - 1, work);
    for (int u = units_.count() - 1; u >= 0; --u) {
      Gathered g = *next;
      next.reset();
      if (u > 0) next = gather(u - 1, work);
      device_.stream_wait_event(compute_, g.ready);
      const std::size_t act_bytes = units_.activation_bytes(u);
      // Checkpointing recomputes the block's forward first (the paper's 33% more work).
      void* act = node_.checkpointing || units_.head(u) ? take(act_bytes, compute_) : nullptr;
      if (node_.checkpointing && !units_.head(u)) compute(units_.forward_flops(u), work);
      const auto full_bytes = static_cast<std::size_t>(units_.params(u) * 2);
      void* grad = take(full_bytes, compute_);
      void* act_grad = take(act_bytes, compute_);
      compute(2 * units_.forward_flops(u), work);
      give(act_grad, act_bytes, compute_);
      if (act != nullptr) give(act, act_bytes, compute_);
      if (!units_.head(u)) {
        give(kept.back(), node_.checkpointing ? units_.kept_bytes(u) : act_bytes, compute_);
        kept.pop_back();
      }
      release(g, full_bytes);
      reduce_scatter_and_flush(u, grad, full_bytes, work);
      throttle();
    }
    drain();
  }

  // The unit's full gradient is reduce-scattered on the link into this rank's shard, which then
  // goes to the optimizer the way the contender sends it.
  void reduce_scatter_and_flush(int u, void* grad, std::size_t full_bytes, PassWork& work) {
    Event done = device_.create_event();
    device_.record_event(done, compute_);
    device_.stream_wait_event(comm_, done);
    device_.destroy_event(done);
    const std::size_t n = units_.shard(u);
    void* shard = take(n * 2, comm_);
    const double rs_ns = units_.collective_ns(u);
    enqueue_collective(u);
    work.comm_ns += rs_ns;
    allocator_.record_stream(grad, comm_);
    give(grad, full_bytes, compute_);

    // Which part goes through the engine's gradient path: all of it for memtide, the
    // GPU-resident subgroups' for TwinFlow, none for ZeRO-3.
    const std::size_t begin = offset_[static_cast<std::size_t>(u)];
    std::size_t blocking = 0;
    const auto& groups = engine_->subgroups();
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const std::size_t a = std::max(begin, groups[i].first);
      const std::size_t b = std::min(begin + n, groups[i].second);
      if (a >= b) continue;
      const bool on_gpu = !last_placement_.empty() && last_placement_[i] != Placement::cpu;
      const bool path = contender_ == Contender::memtide || (contender_ == Contender::twinflow && on_gpu);
      if (path) {
        if (!flush_waits_) {
          // The gradient path reads the shard on its own streams; the flush stream hands it over
          // and waits until it was read, so the collectives on comm_ never wait for the flush.
          Event rs = device_.create_event();
          device_.record_event(rs, comm_);
          device_.stream_wait_event(flush_, rs);
          device_.destroy_event(rs);
          flush_waits_ = true;
        }
        engine_->push_grad(a, static_cast<unsigned char*>(shard) + (a - begin) * 2, DType::bf16, b - a, flush_);
        pushed_ = true;
        const double ns = static_cast<double>(b - a) * 4 / device_.config().d2h_bytes_per_s * 1e9;
        work.async_ns += ns;
        if (u == 0) work.tail_ns += ns;
      } else {
        blocking += b - a;
      }
    }
    if (flush_waits_) {
      allocator_.record_stream(shard, flush_);
      flush_waits_ = false;
    }
    if (backward_updates_on_) complete_subgroups(begin);
    if (blocking > 0) {
      // DeepSpeed's flush: the GPU waits while fp16 goes through pageable staging (Figure 6).
      Event rs = device_.create_event();
      device_.record_event(rs, comm_);
      device_.stream_wait_event(compute_, rs);
      device_.destroy_event(rs);
      const double bytes = static_cast<double>(blocking) * 2;
      const double ns = bytes / node_.pageable_flush_bytes_per_s * 1e9;
      device_.enqueue_compute(compute_, 0, {}, ns);
      work.stall_ns += ns;
      blocking_bytes_ += bytes;
      allocator_.record_stream(shard, compute_);
    }
    give(shard, n * 2, comm_);
  }

  // ---- the layer window ----------------------------------------------------------------------
  // The rank's shards of the blocks live in (phantom, pinned) host memory; m + 1 device buffers
  // take them in turn, in the order the all-gathers read them: every micro-batch's forward
  // (blocks 0 .. L-1), then every micro-batch's backward (L-1 .. 0). The shard for the gather m
  // places ahead is copied in when a gather takes its own, into the buffer the gather before it
  // left (the copy waits for that gather on the link).
  void open_window() {
    home_offset_.assign(static_cast<std::size_t>(model_.layers), 0);
    std::size_t home = 0;
    for (int u = 0; u < model_.layers; ++u) {
      home_offset_[static_cast<std::size_t>(u)] = home;
      home += units_.shard(u) * 2;
      slot_bytes_ = std::max(slot_bytes_, units_.shard(u) * 2);
    }
    home_bytes_ = home;
    home_ = static_cast<unsigned char*>(reserve_phantom_host(home_bytes_));
    device_.host_register(home_, home_bytes_);
    head_ = take(units_.shard(model_.layers) * 2, Stream{});  // the head stays
    h2d_ = device_.create_stream();
    for (int k = 0; k <= window_; ++k) {
      slots_.push_back(take(slot_bytes_, Stream{}));
      free_.push_back({k, Event{}});
    }
    for (int mb = 0; mb < model_.micro_batches; ++mb) {
      for (int u = 0; u < model_.layers; ++u) order_.push_back(u);
      for (int u = model_.layers - 1; u >= 0; --u) order_.push_back(u);
    }
    // At each turn from forward to backward the last m blocks stay (STRONGHOLD): the first m
    // gathers of backward read the buffers the last m of forward filled.
    for (std::size_t k = 0; k < order_.size(); ++k) {
      if (!turn_kept(k) || k < turn_of(k)) fetches_.push_back(k);
    }
  }
  // The first use of backward in the micro-batch of use k.
  [[nodiscard]] std::size_t turn_of(std::size_t k) const {
    const auto pass = static_cast<std::size_t>(model_.layers);
    return k / (2 * pass) * (2 * pass) + pass;
  }
  // Whether use k is one of the last m of its forward or the first m of its backward.
  [[nodiscard]] bool turn_kept(std::size_t k) const {
    const auto m = static_cast<std::size_t>(window_);
    const std::size_t turn = turn_of(k);
    return k + m >= turn && k < turn + m;
  }
  void close_window() {
    if (home_ == nullptr) return;
    device_.synchronize();
    for (auto& f : fetched_) device_.destroy_event(f.second);
    for (auto& f : free_) {
      if (f.second.valid()) device_.destroy_event(f.second);
    }
    for (void* p : slots_) give(p, slot_bytes_, Stream{});
    give(head_, units_.shard(model_.layers) * 2, Stream{});
    device_.destroy_stream(h2d_);
    device_.host_unregister(home_);
  }
  // Copies in the shard of the next use that needs one (into the buffer freed longest ago).
  void fetch_next() {
    if (free_.empty()) throw Error("iteration simulator: the layer window has no free buffer");
    const int u = order_[fetches_[next_fetch_++]];
    auto [slot, free] = free_.front();
    free_.erase(free_.begin());
    if (free.valid()) {
      device_.stream_wait_event(h2d_, free);
      device_.destroy_event(free);
    }
    const std::size_t bytes = units_.shard(u) * 2;
    device_.copy_async(slots_[static_cast<std::size_t>(slot)], home_ + home_offset_[static_cast<std::size_t>(u)], bytes,
                       CopyKind::host_to_device, h2d_);
    window_h2d_bytes_ += static_cast<double>(bytes);
    Event ready = device_.create_event();
    device_.record_event(ready, h2d_);
    fetched_.push_back({slot, ready});
  }
  void prefetch_window() {
    while (static_cast<int>(fetched_.size()) < window_ && next_fetch_ < fetches_.size() && !free_.empty()) fetch_next();
  }
  // The gather of block u (the next in order_) reads its shard once the copy has landed.
  void take_from_window(int u) {
    if (order_[next_use_] != u) throw Error("iteration simulator: the window's order lost its place");
    taken_use_ = next_use_++;
    if (turn_kept(taken_use_) && taken_use_ >= turn_of(taken_use_)) {  // still there from forward
      taken_slot_ = kept_slot_.at(u);
      return;
    }
    if (fetched_.empty()) fetch_next();  // a window of one whose copy the gather waits for
    auto [slot, ready] = fetched_.front();
    fetched_.erase(fetched_.begin());
    device_.stream_wait_event(comm_, ready);
    device_.destroy_event(ready);
    taken_slot_ = slot;
  }
  void release_to_window() {
    if (turn_kept(taken_use_) && taken_use_ < turn_of(taken_use_)) {
      kept_slot_[order_[taken_use_]] = taken_slot_;  // backward reads it again
    } else {
      Event done = device_.create_event();
      device_.record_event(done, comm_);
      free_.push_back({taken_slot_, done});
    }
    prefetch_window();  // the shard m gathers ahead
  }

  // ---- CPU updates during backward ----------------------------------------------------------
  // Backward walks the flat shard downwards, so once the unit at `begin` has sent its gradients,
  // every subgroup starting at or above it is complete. One the previous plan put on the CPU (and
  // not on NVMe) is queued; it is ready once its fp32 gradient has crossed PCIe after the unit's
  // compute. The host works through the queue whenever it would otherwise wait for the GPU.
  struct Pending {
    std::size_t subgroup;
    double left;      // params not updated yet
    double ready_ns;  // its gradients are in host memory
  };
  //
  // Which subgroups: the engine's own rule (choose_backward_updates), timed with the last
  // backward and the host's modelled cost. Their gradients go to the host whatever the plan said; the update
  // phase is planned for the rest (UpdateEngine::set_done_before_phase). So each subgroup is
  // updated during backward, on the CPU in the update phase, or on the GPU.
  void begin_backward_updates() {
    const auto& groups = engine_->subgroups();
    const std::size_t n = groups.size();
    bwd_done_.assign(n, false);
    bwd_take_.assign(n, false);
    bwd_pending_.clear();
    bwd_frontier_ = n;
    bwd_params_ = bwd_busy_ns_ = 0;
    bwd_enabled_ = contender_ == Contender::memtide && node_.updates_during_backward && !last_placement_.empty() &&
                   last_backward_ns_ > 0;
    if (!bwd_enabled_) {
      if (contender_ == Contender::memtide && node_.updates_during_backward) engine_->set_host_gradients({});
      return;
    }
    // The last backward's length spread over the shard says when each subgroup's gradients were
    // complete; its fp32 gradients then cross PCIe before the host can start.
    const SimConfig& c = device_.config();
    std::map<std::size_t, double> ready;
    for (std::size_t k = 0; k < n; ++k) {
      const auto params = static_cast<double>(groups[k].second - groups[k].first);
      const double complete = last_backward_ns_ * (1 - static_cast<double>(groups[k].first) / static_cast<double>(n_));
      ready[k] = complete + params * 4 / c.d2h_bytes_per_s * 1e9;
    }
    const double ns_per_param =
        1e9 / c.cpu_update_params_per_s + (node_.speculative_backup ? 24e9 / c.host_dram_bytes_per_s : 0);
    const BackwardChoice choice =
        choose_backward_updates({last_placement_, engine_->on_nvme(), groups, ready, ns_per_param, last_backward_ns_, n});
    for (std::size_t k : choice.subgroups) bwd_take_[k] = true;
    engine_->set_host_gradients(bwd_take_);  // their gradients go to the host, whatever the plan said
  }
  void complete_subgroups(std::size_t begin) {
    const auto& groups = engine_->subgroups();
    while (bwd_frontier_ > 0 && groups[bwd_frontier_ - 1].first >= begin) {
      const std::size_t i = --bwd_frontier_;
      if (!bwd_take_[i]) continue;
      const auto params = static_cast<double>(groups[i].second - groups[i].first);
      const double flush_ns = params * 4 / device_.config().d2h_bytes_per_s * 1e9;
      bwd_pending_.push_back({i, params, device_.stream_ready_ns(compute_) + flush_ns});
    }
  }
  void work_until(double until_ns) {
    const double per_param = adamw_bytes_per_param(DType::fp32, DType::bf16);
    while (!bwd_pending_.empty() && device_.now_ns() < until_ns) {
      Pending& p = bwd_pending_.front();
      if (p.ready_ns >= until_ns) return;
      if (p.ready_ns > device_.now_ns()) device_.advance_host(p.ready_ns - device_.now_ns());
      const double room = (until_ns - device_.now_ns()) / 1e9 * device_.config().cpu_update_params_per_s;
      const double n = std::min(p.left, std::max(room, 1.0));
      bwd_busy_ns_ += update_on_host(n, per_param);
      p.left -= n;
      if (p.left <= 0) {
        finish_subgroup(p.subgroup);
        bwd_pending_.erase(bwd_pending_.begin());
      }
    }
  }
  // Its new fp16 params go to the GPU's copy of the model (the window reads them from home).
  void finish_subgroup(std::size_t i) {
    bwd_done_[i] = true;
    if (window_ > 0) return;
    const auto& g = engine_->subgroups()[i];
    device_.copy_async(static_cast<unsigned char*>(engine_->model_params(DType::bf16)) + g.first * 2,
                       upload_host_ + g.first * 2, (g.second - g.first) * 2, CopyKind::host_to_device, upload_);
  }
  double update_on_host(double n, double per_param) {
    double ns = device_.run_host_work(HostWork{n * per_param, n}, {});
    if (node_.speculative_backup) ns += device_.host_work(n * 24, device_.config().host_dram_bytes_per_s);
    bwd_params_ += n;
    return ns;
  }
  // What backward took but did not end, the host ends at the start of the update phase.
  void finish_backward_updates() {
    for (const Pending& p : bwd_pending_) {
      (void)update_on_host(p.left, adamw_bytes_per_param(DType::fp32, DType::bf16));
      finish_subgroup(p.subgroup);
    }
    bwd_pending_.clear();
  }

  const ModelShape& model_;
  const NodeSpec& node_;
  Contender contender_;
  Units units_;
  SimDevice device_;
  CachingAllocator allocator_;
  HostArena arena_;  // the engine's host tier; unused on a phantom device
  Stream compute_{}, comm_{}, flush_{};
  bool flush_waits_ = false;  // flush_ has waited for this unit's reduce-scatter
  std::vector<std::size_t> offset_;
  std::size_t n_ = 0;
  std::unique_ptr<UpdateEngine> engine_;
  std::vector<Placement> last_placement_;
  bool recording_ = false;
  std::vector<IterationResult::MemorySample> memory_;
  std::vector<Event> in_flight_;  // compute of the units the host has run ahead by
  std::unordered_map<void*, std::pair<std::size_t, Stream>> held_;  // take()n, not yet given back
  double blocking_bytes_ = 0;  // fp16 gradient bytes flushed the blocking way this iteration
  bool pushed_ = false;
  // The layer window (window_ > 0).
  int window_ = 0;
  Stream h2d_{};
  unsigned char* home_ = nullptr;
  std::size_t home_bytes_ = 0;
  std::vector<std::size_t> home_offset_;
  std::size_t slot_bytes_ = 0;
  std::vector<void*> slots_;
  void* head_ = nullptr;
  std::vector<int> order_;                      // blocks in the order their gathers come
  std::vector<std::size_t> fetches_;            // the uses that copy their shard in
  std::map<int, int> kept_slot_;                // block -> its buffer across the turn
  std::size_t next_fetch_ = 0, next_use_ = 0;   // places in fetches_ and order_
  std::size_t taken_use_ = 0;
  std::vector<std::pair<int, Event>> fetched_;  // slot and copy-done, oldest first
  std::vector<std::pair<int, Event>> free_;     // slot and when its last reader is done
  int taken_slot_ = -1;
  double window_h2d_bytes_ = 0;
  std::uint64_t own_peak_ = 0;
  // CPU updates during backward.
  bool bwd_enabled_ = false, backward_updates_on_ = false;
  std::vector<bool> bwd_done_, bwd_take_;
  double last_backward_ns_ = 0;
  Stream upload_{};
  unsigned char* upload_host_ = nullptr;  // the fp16 params' phantom host copy
  std::vector<Pending> bwd_pending_;
  std::size_t bwd_frontier_ = 0;
  double bwd_params_ = 0, bwd_busy_ns_ = 0;
  double collective_ns_ = 0;  // the iteration's all-gathers and reduce-scatters, one after another
};

}  // namespace

std::vector<BlockProfile> window_profiles(const ModelShape& model, const NodeSpec& node) {
  model.validate();
  node.validate();
  const Units units{model, node, double(model.seq) * model.micro_batch};
  std::vector<BlockProfile> out;
  for (int u = 0; u < model.layers; ++u) {
    const double gather_ns = units.collective_ns(u);
    const double fwd = units.ns(units.forward_flops(u)) * model.micro_batches;
    const double bwd = units.ns((node.checkpointing ? 3 : 2) * units.forward_flops(u)) * model.micro_batches;
    BlockProfile b;
    b.forward_ns = std::max(fwd, gather_ns);
    b.backward_ns = std::max(bwd, 2 * gather_ns);  // gather and reduce-scatter share the link
    b.h2d_ns = static_cast<double>(units.shard(u)) * 2 / node.device.h2d_bytes_per_s * 1e9;
    b.d2h_ns = static_cast<double>(units.shard(u)) * 4 / node.device.d2h_bytes_per_s * 1e9;
    b.bytes = units.shard(u) * 2;
    out.push_back(b);
  }
  return out;
}

IterationResult simulate_iteration(const ModelShape& model, const NodeSpec& node, Contender contender,
                                   const SimulationOptions& options) {
  model.validate();
  node.validate();
  require(options.iterations >= 1 && options.iterations <= 1000,
          "simulate_iteration: iterations must be 1 to 1000, got " + std::to_string(options.iterations));
  const double shard = model.params() / node.gpus;
  require(shard / static_cast<double>(node.subgroup_params) <= static_cast<double>(kMaxSubgroups),
          "simulate_iteration: the rank's " + std::to_string(static_cast<long long>(shard)) + " params in subgroups of " +
              std::to_string(node.subgroup_params) + " are more than " + std::to_string(kMaxSubgroups) + " subgroups");
  require(node.window_blocks >= NodeSpec::kWindowAuto,
          "simulate_iteration: window_blocks must be >= 0 or kWindowAuto, got " + std::to_string(node.window_blocks));
  int window = contender == Contender::memtide ? node.window_blocks : 0;
  std::string why;
  if (window == NodeSpec::kWindowAuto) {
    // What the rest of forward and backward needs: two iterations with the smallest window, less
    // its two buffers and the engine's loans (which it gives back when asked); the window gets
    // what is left, less a twentieth for the allocator's rounding and cache.
    const std::vector<BlockProfile> blocks = window_profiles(model, node);
    std::uint64_t other = 0;
    try {
      Rank probe(model, node, contender, 1);
      for (int i = 0; i < 2; ++i) (void)probe.iterate(i, false);
      other = probe.own_peak() - window_bytes(blocks, 1) + node.device.capacity / 20;
    } catch (const OutOfMemory& e) {
      throw OutOfMemory(std::string("the layer window cannot fit model ") + model.name +
                        " even at one block and its prefetch: " + e.what());
    }
    const std::uint64_t capacity = node.device.capacity;
    const WindowSize chosen = choose_window(blocks, capacity > other ? capacity - other : 0);
    // choose_window judges the pass alone; every buffer the window takes is also memory the update
    // phase's GPU subgroups and the gradient path no longer have. So the simulator judges its
    // choice and the halvings below it on whole iterations and keeps the smallest within 1% of
    // the best (one that runs out of memory is out).
    std::vector<std::pair<int, double>> tried;
    for (int m = chosen.blocks;; m = std::max(1, m / 2)) {
      try {
        Rank candidate(model, node, contender, m);
        double t = 0;
        for (int i = 0; i < options.iterations; ++i) t = candidate.iterate(i, false).simulated.iteration_s;
        tried.emplace_back(m, t);
      } catch (const OutOfMemory&) {
        tried.emplace_back(m, INFINITY);
      }
      if (m == 1) break;
    }
    double best = INFINITY;
    for (const auto& [m, t] : tried) best = std::min(best, t);
    if (!std::isfinite(best)) {
      throw OutOfMemory("the layer window cannot fit model " + model.name + ": every window from " +
                        std::to_string(chosen.blocks) + " blocks down to 1 runs out of device memory");
    }
    window = 0;
    why = "pass model: " + chosen.why + "; whole iterations:";
    for (const auto& [m, t] : tried) {
      why += " m=";
      why += std::to_string(m);
      why += std::isfinite(t) ? std::string(" ") + format_duration_ns(t * 1e9) : std::string(" out of memory");
      why += ',';
      if (t <= best * 1.01) window = m;  // the halvings come smallest last
    }
    why += " chose ";
    why += std::to_string(window);
  }
  Rank rank(model, node, contender, window);
  IterationResult out;
  for (int i = 0; i < options.iterations; ++i) {
    out = rank.iterate(i, options.record_ops && i + 1 == options.iterations);
  }
  if (options.save) {
    const double rate = options.save_write_bytes_per_s > 0 ? options.save_write_bytes_per_s : node.nvme_write_bytes_per_s;
    out.save = rank.save_beside(options.iterations, rate, options.save_buffer_bytes);
  }
  if (window >= model.layers) {
    why = (why.empty() ? std::string() : why + "; ") + std::to_string(window) + " >= the model's " +
          std::to_string(model.layers) + " blocks: every block stays on the GPU (no window)";
    window = 0;
  }
  out.window_blocks = window;
  out.window_why = why;
  return out;
}

}  // namespace memtide::tiering
