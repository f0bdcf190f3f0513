#include "memtide/tiering/iteration_sim.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/update_engine.hpp"

namespace memtide::tiering {
namespace {

struct Table2Row {
  const char* name;
  int layers, hidden, heads;
};
// Deep Optimizer States, Table 2 (LLaMA2 7B/13B, Megatron 8.3B, GPT 10B, GPT-NeoX 20B).
constexpr Table2Row kTable2[] = {
    {"7B", 32, 4096, 32}, {"8.3B", 72, 3072, 24}, {"10B", 50, 4096, 32}, {"13B", 40, 5120, 40}, {"20B", 48, 6144, 64}};

void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument(what);
}

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
  // This rank's share of a unit (ZeRO-3 cuts every parameter N ways), in elements.
  [[nodiscard]] std::size_t shard(int u) const {
    return static_cast<std::size_t>(std::ceil(params(u) / node.gpus));
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
  // A ring collective moves (N - 1) / N of the full unit's fp16 bytes through each GPU.
  [[nodiscard]] double collective_bytes(int u) const {
    return params(u) * 2 * (node.gpus - 1) / static_cast<double>(node.gpus);
  }
};

// One rank's machine and the engine on it, for all iterations of one contender.
class Rank {
 public:
  Rank(const ModelShape& model, const NodeSpec& node, Contender contender)
      : model_(model), node_(node), contender_(contender), units_{model, node, double(model.seq) * model.micro_batch},
        device_(phantom(node.device)), allocator_(device_), arena_(HostArenaConfig{}) {
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
    engine_->model_params(DType::bf16);  // the rank's fp16 params live in device memory for good
  }

  ~Rank() {
    engine_.reset();
    device_.destroy_stream(compute_);
    device_.destroy_stream(comm_);
    device_.destroy_stream(flush_);
  }

  IterationResult iterate(int iteration, bool record) {
    IterationResult out;
    out.contender = contender_;
    out.capacity_bytes = device_.config().capacity;
    device_.record_ops(record);
    (void)device_.take_ops();
    recording_ = record;
    memory_.clear();
    const double bytes_before = engine_->grad_bytes_to_host();

    const double t0 = now_s();
    allocator_.mark_phase(Phase::forward);
    sample();
    PassWork forward, backward;
    std::vector<std::vector<void*>> kept(static_cast<std::size_t>(model_.micro_batches));
    for (int mb = 0; mb < model_.micro_batches; ++mb) this->forward(kept[mb], forward);
    device_.synchronize();
    const double t1 = now_s();
    allocator_.mark_phase(Phase::backward);
    sample();
    for (int mb = 0; mb < model_.micro_batches; ++mb) this->backward(kept[mb], backward);
    if (pushed_) (void)engine_->finish_grads();
    pushed_ = false;
    device_.synchronize();
    const double t2 = now_s();

    allocator_.mark_phase(Phase::update);
    sample();
    const Policy policy = contender_ == Contender::memtide ? Policy::automatic
                          : contender_ == Contender::twinflow ? Policy::static_split
                                                              : Policy::cpu;
    const double fraction = contender_ == Contender::twinflow ? node_.twinflow_static_fraction : 0.0;
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

    out.simulated = PhaseTimes{t1 - t0, t2 - t1, t3 - t2, t3 - t0};
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
    out.grad_bytes_to_host = engine_->grad_bytes_to_host() - bytes_before + blocking_bytes_;
    blocking_bytes_ = 0;
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

  // All-gathers unit u's fp16 params on the link; the buffer is the compute stream's once the
  // event fires.
  struct Gathered {
    void* buffer;
    Event ready;
  };
  Gathered gather(int u, PassWork& work) {
    const auto bytes = static_cast<std::size_t>(units_.params(u) * 2);
    void* buffer = allocator_.allocate(bytes, comm_);
    const double t = units_.collective_bytes(u) / node_.link_bytes_per_s * 1e9;
    device_.enqueue_collective(comm_, units_.collective_bytes(u), node_.link_bytes_per_s);
    work.comm_ns += t;
    if (work.lead_ns == 0) work.lead_ns = t;
    Event ready = device_.create_event();
    device_.record_event(ready, comm_);
    return {buffer, ready};
  }
  // After the compute stream's last use of a gathered unit (it waited for g.ready).
  void release(Gathered g, std::size_t bytes) {
    device_.destroy_event(g.ready);
    allocator_.record_stream(g.buffer, compute_);
    allocator_.deallocate(g.buffer, bytes, comm_);
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
    Event done = device_.create_event();
    device_.record_event(done, compute_);
    in_flight_.push_back(done);
    if (in_flight_.size() > 2) {
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
      void* act = allocator_.allocate(units_.activation_bytes(u), compute_);
      compute(units_.forward_flops(u), work);
      if (const std::size_t k = units_.kept_bytes(u); k > 0) {
        kept.push_back(node_.checkpointing ? allocator_.allocate(k, compute_) : act);
      }
      if (node_.checkpointing || units_.head(u)) allocator_.deallocate(act, units_.activation_bytes(u), compute_);
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
      void* act = node_.checkpointing || units_.head(u) ? allocator_.allocate(act_bytes, compute_) : nullptr;
      if (node_.checkpointing && !units_.head(u)) compute(units_.forward_flops(u), work);
      const auto full_bytes = static_cast<std::size_t>(units_.params(u) * 2);
      void* grad = allocator_.allocate(full_bytes, compute_);
      void* act_grad = allocator_.allocate(act_bytes, compute_);
      compute(2 * units_.forward_flops(u), work);
      allocator_.deallocate(act_grad, act_bytes, compute_);
      if (act != nullptr) allocator_.deallocate(act, act_bytes, compute_);
      if (!units_.head(u)) {
        allocator_.deallocate(kept.back(), node_.checkpointing ? units_.kept_bytes(u) : act_bytes, compute_);
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
    void* shard = allocator_.allocate(n * 2, comm_);
    const double rs_ns = units_.collective_bytes(u) / node_.link_bytes_per_s * 1e9;
    device_.enqueue_collective(comm_, units_.collective_bytes(u), node_.link_bytes_per_s);
    work.comm_ns += rs_ns;
    allocator_.record_stream(grad, comm_);
    allocator_.deallocate(grad, full_bytes, compute_);

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
    allocator_.deallocate(shard, n * 2, comm_);
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
  double blocking_bytes_ = 0;  // fp16 gradient bytes flushed the blocking way this iteration
  bool pushed_ = false;
};

}  // namespace

double ModelShape::layer_params() const {
  const double h = hidden;
  return 12 * h * h + 13 * h;
}

double ModelShape::params() const { return layers * layer_params() + static_cast<double>(vocab) * hidden; }

void ModelShape::validate() const {
  const std::pair<const char*, int> fields[] = {{"layers", layers}, {"hidden", hidden}, {"heads", heads},
                                                {"seq", seq},       {"micro_batch", micro_batch},
                                                {"micro_batches", micro_batches}, {"vocab", vocab}};
  for (const auto& [field, v] : fields) {
    require(v > 0, "model " + name + ": " + field + " must be positive, got " + std::to_string(v));
  }
  require(hidden % heads == 0, "model " + name + ": hidden " + std::to_string(hidden) +
                                   " is not a multiple of heads " + std::to_string(heads));
  require(hidden <= (1 << 20) && layers <= 100000 && seq <= (1 << 24) && vocab <= (1 << 24) &&
              micro_batch <= (1 << 16) && micro_batches <= 4096,
          "model " + name + ": a dimension is far beyond any model (hidden <= 2^20, layers <= 1e5, seq and vocab <= "
                            "2^24, micro_batch <= 65536, micro_batches <= 4096)");
}

ModelShape ModelShape::table2(const std::string& name) {
  for (const Table2Row& r : kTable2) {
    if (name == r.name) {
      ModelShape m;
      m.name = r.name;
      m.layers = r.layers;
      m.hidden = r.hidden;
      m.heads = r.heads;
      return m;
    }
  }
  std::string known;
  for (const Table2Row& r : kTable2) known += std::string(known.empty() ? "" : ", ") + r.name;
  throw InvalidArgument("model \"" + name + "\" is not one of the paper's Table 2 models (" + known +
                        "); give a custom shape instead");
}

const std::vector<std::string>& ModelShape::table2_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Table2Row& r : kTable2) out.emplace_back(r.name);
    return out;
  }();
  return names;
}

void NodeSpec::validate() const {
  require(gpus >= 1 && gpus <= 1024, "node: gpus must be 1 to 1024, got " + std::to_string(gpus));
  const std::pair<const char*, double> rates[] = {{"gpu_flops", gpu_flops},
                                                  {"link_bytes_per_s", link_bytes_per_s},
                                                  {"pageable_flush_bytes_per_s", pageable_flush_bytes_per_s},
                                                  {"device.h2d_bytes_per_s", device.h2d_bytes_per_s},
                                                  {"device.d2h_bytes_per_s", device.d2h_bytes_per_s},
                                                  {"device.cpu_update_params_per_s", device.cpu_update_params_per_s},
                                                  {"device.gpu_update_params_per_s", device.gpu_update_params_per_s},
                                                  {"device.host_dram_bytes_per_s", device.host_dram_bytes_per_s}};
  for (const auto& [field, v] : rates) {
    require(v > 0 && std::isfinite(v), std::string("node: ") + field + " must be a positive rate, got " + std::to_string(v));
  }
  require(subgroup_params > 0, "node: subgroup_params must be positive");
  require(twinflow_static_fraction >= 0 && twinflow_static_fraction <= 1,
          "node: twinflow_static_fraction must be in [0, 1], got " + std::to_string(twinflow_static_fraction));
  require(device.capacity >= (std::size_t{1} << 30), "node: device.capacity must be at least 1 GiB");
  for (const auto& [field, v] : {std::pair{"nvme_read_bytes_per_s", nvme_read_bytes_per_s},
                                 std::pair{"nvme_write_bytes_per_s", nvme_write_bytes_per_s}}) {
    require(v > 0 && std::isfinite(v), std::string("node: ") + field + " must be a positive rate, got " + std::to_string(v));
  }
}

const char* to_string(Contender c) noexcept {
  switch (c) {
    case Contender::zero3_offload: return "zero3_offload";
    case Contender::twinflow: return "twinflow";
    case Contender::memtide: return "memtide";
  }
  return "?";
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
  Rank rank(model, node, contender);
  IterationResult out;
  for (int i = 0; i < options.iterations; ++i) {
    out = rank.iterate(i, options.record_ops && i + 1 == options.iterations);
  }
  return out;
}

}  // namespace memtide::tiering
